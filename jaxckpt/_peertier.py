"""The peer-replicated local tier: each process's local part on ``local_replicas`` nodes.

With ``local_replicas=k > 1`` a tiered manager holds a :class:`Peers`: a
listener of its own (:mod:`jaxckpt._peer`) serving ``replicas/`` of this
process's local root, the addresses and nodes of every process, the job's
secret (all three through the coordination service, at open) and the
placement (:mod:`jaxckpt._placement`). It does two things:

* **replicate** (the background part of a save, after this process's part is
  durable on its own local root and before its local marker): every file of
  the part's attempt goes to each of the ``k - 1`` holders, who store it under
  ``replicas/<step>/<process>/<attempt>/`` of their own local root (checked
  against its CRC32C on arrival), then the replica's index (every file's size
  and CRC32C), which makes the replica complete. The local commit waits for
  every holder's acknowledgement; a dead or stalled holder fails the save
  after ``peer_timeout_s``, and no marker is written.
* **heal** (before a restore picks its step, on every process together):
  every process reports the steps it holds on its own root and the replicas
  it holds; the newest step whose every part is somewhere (the union of the
  surviving local tiers), that not every process has itself, and that is not
  older than the newest durable step, is *healed*: each process lacking its
  part fetches it from a holder (every file checked against the replica's
  index, the next holder tried when a copy is corrupt) and commits it again on
  its own local root; holders that lost their replica get it again. When some
  process finds no intact copy of its part, every process goes on to the next
  newest complete step (:func:`fallback` says which, and the log says it), so
  one corrupt replica costs one step, not every local step. The restore
  selection then finds the step on every process's local tier.

:func:`join_tiers` opens it, as the local tier's ``peers`` (a tier without
replicas has :class:`~jaxckpt._tier.NoReplicas`, which does nothing); the
save session replicates through it and the restore selection heals through
it, and the session closes it with the manager.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from jaxckpt import _pools
from jaxckpt._agree import Agreement
from jaxckpt._keys import (
    REPLICAS,
    StepLocation,
    is_held_manifest_name,
    is_temp_key,
    new_attempt,
    replica_holdings,
    replica_index_key,
    replica_prefix,
)
from jaxckpt._options import CheckpointOptions
from jaxckpt._peer import PeerClient, PeerServer, connect, new_secret
from jaxckpt._phases import reached
from jaxckpt._placement import Placement, node_id, place
from jaxckpt._promote import PromotionRequest, request_promotion
from jaxckpt._records import FileDigest, ReplicaIndex
from jaxckpt._tier import Tier, take_epochs
from jaxckpt.errors import CheckpointError, CorruptCheckpointError, PeerError

log = logging.getLogger("jaxckpt")

PEER_HOST_ENV = "JAXCKPT_PEER_HOST"
MIN_FRAME_BYTES = 256 << 20
"""The least a peer accepts in one frame: a file of a part is at most ``max_object_bytes``
(a chunk or a pack), but a process's manifest part can be larger."""
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


Held = tuple[int, int, str]
"""A replica a process holds: (step, source process, attempt)."""


def heal_target(
    reports: Sequence[tuple[Iterable[int], Iterable[Held]]],
    step: int | None,
    durable: int | None,
    *,
    below: int | None = None,
) -> int | None:
    """The step to heal, from every process's (own steps, replicas held) report.

    The newest step older than ``below`` (or ``step``) whose every process's
    part is on some process (its own, or a replica), that some process lacks
    on its own root, and that is not older than the newest ``durable`` step;
    else None.

    >>> heal_target([([1, 2], []), ([1], [(2, 0, "a")]), ([1], [(2, 1, "b")])], None, 1)
    >>> heal_target([([1, 2], [(2, 2, "c")]), ([1], [(2, 0, "a")]), ([1], [(2, 1, "b")])], None, 1)
    2
    """
    complete, everywhere = _coverage(reports)
    if below is not None:
        complete = {s for s in complete if s < below}
    target = step if step is not None else max(complete, default=None)
    if target is None or target not in complete or target in everywhere:
        return None
    return None if durable is not None and target < durable else target


def _coverage(
    reports: Sequence[tuple[Iterable[int], Iterable[Held]]],
) -> tuple[set[int], set[int]]:
    """The steps complete in the union of the local tiers, and those every process holds."""
    parts: dict[int, set[int]] = {}
    everywhere: set[int] | None = None
    for process, (own, held) in enumerate(reports):
        own = set(own)
        for s in own:
            parts.setdefault(s, set()).add(process)
        for s, source, _ in held:
            parts.setdefault(s, set()).add(source)
        everywhere = own if everywhere is None else everywhere & own
    complete = {s for s, ps in parts.items() if len(ps) == len(reports)}
    return complete, everywhere or set()


def fallback(
    reports: Sequence[tuple[Iterable[int], Iterable[Held]]],
    failed: int,
    durable: int | None,
    *,
    asked: bool,
) -> tuple[int | None, str]:
    """After healing step ``failed`` failed: the next step to heal (None: no more) and
    what the restore does instead, said in words for the log.

    >>> reports = [([2, 3], [(2, 1, "a"), (3, 1, "a")]), ([], [(2, 0, "a"), (3, 0, "a")])]
    >>> fallback(reports, 3, None, asked=False)
    (2, 'healing step 2 instead, the next newest step complete across the local tiers')
    >>> fallback([([2, 3], []), ([2], [(3, 0, "a")])], 3, None, asked=False)
    (None, 'the restore reads step 2, which every process holds on its local tier')
    >>> fallback(reports, 3, 1, asked=True)
    (None, 'the restore of step 3 reads the durable root if it holds the step')
    """
    if asked:
        return None, f"the restore of step {failed} reads the durable root if it holds the step"
    nxt = heal_target(reports, None, durable, below=failed)
    if nxt is not None:
        return (
            nxt,
            f"healing step {nxt} instead, the next newest step complete across the local tiers",
        )
    complete, everywhere = _coverage(reports)
    older = max((s for s in complete if s < failed), default=None)
    if older is not None and older in everywhere and (durable is None or older >= durable):
        return None, f"the restore reads step {older}, which every process holds on its local tier"
    if durable is not None:
        return None, f"the restore reads the durable root (its newest step is {durable})"
    return None, (
        "no older step is complete across the local tiers and nothing is durable: "
        "there is no step to restore"
    )


class Peers:
    """This process's side of the peer-replicated local tier (collective to open).

    Args:
      tiers: the manager's tiers (local first, the durable root last).
      agreement: the manager's (the secret, the nodes and the addresses).
      options: ``local_replicas``, ``peer_timeout_s``, ``peer_host``.

    Raises:
      PlacementError: fewer nodes than ``local_replicas``.
    """

    def __init__(
        self, tiers: Sequence[Tier], agreement: Agreement, options: CheckpointOptions
    ) -> None:
        self._local, self._durable = tiers[0], tiers[-1]
        self._agreement = agreement
        self._timeout_s = options.peer_timeout_s
        self.me = jax.process_index()
        nodes = agreement.gather("peer-nodes", node_id())
        self.placement: Placement = place(nodes, options.local_replicas)
        primary = self.me == agreement.primary
        self._secret = bytes.fromhex(
            agreement.agree("peer-secret", new_secret().hex() if primary else None)
        )
        self._max_bytes = max(options.max_object_bytes, MIN_FRAME_BYTES)
        self._server = PeerServer(
            self._local.storage,
            self._secret,
            host=bind_host(options),
            timeout_s=self._timeout_s,
            max_bytes=self._max_bytes,
        )
        try:
            self.addresses: list[str] = agreement.gather("peer-addresses", self._server.address)
        except BaseException:
            self._server.close()
            raise

    def close(self) -> None:
        """Closes the listener (the manager's ``close``)."""
        self._server.close()

    def _connect(self, process: int) -> Any:
        return connect(
            self.addresses[process],
            self._secret,
            timeout_s=self._timeout_s,
            max_bytes=self._max_bytes,
        )

    def _where(self, process: int) -> str:
        return (
            f"process {process} (node {self.placement.nodes[process]}, {self.addresses[process]})"
        )

    # -- replication -------------------------------------------------------------

    def replicate(
        self,
        loc: StepLocation,
        *,
        metrics: dict[str, float] | None,
        keep: bool,
        request: bytes | None = None,
    ) -> None:
        """Sends this process's part of ``loc`` to every holder; returns once each has
        acknowledged every file and the index (which carries the promotion ``request``).

        Raises:
          PeerError: a holder could not be reached, refused, or timed out (named).
        """
        holders = self.placement.holders(self.me)
        reached("replicating", loc.step)
        start = time.monotonic()
        with _pools.borrow("peers", len(holders)) as pool:
            promote = None if request is None else request.decode()
            futures = [
                pool.submit(self._push, h, loc, dict(metrics or {}), keep, promote) for h in holders
            ]
            sent = [f.result() for f in futures]
        log.info(
            "step %d: replicated this process's part (%d bytes) to %s in %.2fs",
            loc.step,
            sent[0] if sent else 0,
            ", ".join(f"process {h}" for h in holders),
            time.monotonic() - start,
        )

    def _push(
        self,
        holder: int,
        loc: StepLocation,
        metrics: dict[str, float],
        keep: bool,
        promote: str | None,
    ) -> int:
        storage, step = self._local.storage, loc.step
        assert loc.attempt is not None
        base = f"{replica_prefix(step, self.me)}{loc.attempt}/"
        files: dict[str, FileDigest] = {}
        try:
            with self._connect(holder) as peer:
                for key in storage.list(loc.prefix):
                    if is_temp_key(key):
                        continue
                    data = storage.read(key)
                    if data is None:
                        raise CheckpointError(f"{self._local.uri}/{key} vanished while replicated")
                    if len(data) > self._max_bytes:
                        raise PeerError(
                            f"{self._local.uri}/{key} is {len(data)} bytes, over the peer "
                            f"transport's bound of {self._max_bytes} (max_object_bytes)"
                        )
                    name = key[len(loc.prefix) :]
                    peer.put(base + name, data)
                    files[name] = FileDigest.of(data)
                index = ReplicaIndex(
                    step=step,
                    process=self.me,
                    attempt=loc.attempt,
                    num_processes=jax.process_count(),
                    files=files,
                    metrics=metrics,
                    keep=keep,
                    promote=promote,
                )
                peer.put(replica_index_key(step, self.me, loc.attempt), index.to_bytes())
        except PeerError as e:
            raise PeerError(
                f"step {step}: replicating process {self.me}'s part to {self._where(holder)} "
                f"failed: {e}"
            ) from e
        return sum(d.size for d in files.values())

    # -- healing -----------------------------------------------------------------

    def held(self) -> list[Held]:
        """The complete replicas this process holds (listed; their indexes are read on use)."""
        return replica_holdings(self._local.storage.list(REPLICAS))

    def heal(self, step: int | None) -> None:
        """Brings the newest step complete in the union of the local tiers (or ``step``)
        back onto every process's own local root (collective; see the module docstring).

        When a process finds no intact copy of its part of that step, every process
        goes on to the next newest complete step (never older than the newest durable
        one); the log says which step the restore gets instead.
        """
        own = self._local.visible()
        held = self.held()
        gathered = self._agreement.gather("peer-coverage", [own, held])
        marker = self._durable.latest() if self.me == self._agreement.primary else None
        durable = self._agreement.agree("peer-durable", None if marker is None else marker.step)
        reports = [(list(o), [(int(s), int(p), str(a)) for s, p, a in hs]) for o, hs in gathered]
        target = heal_target(reports, step, durable)
        while target is not None:
            fetched = True
            if target not in own:
                sources = [
                    (p, attempt)
                    for p, (_, hs) in enumerate(reports)
                    for s, source, attempt in hs
                    if s == target and source == self.me
                ]
                try:
                    fetched = self._fetch(target, sources)
                except CheckpointError as e:  # this process's own root failed: said, agreed
                    log.warning(
                        "step %d: fetching process %d's part failed: %s", target, self.me, e
                    )
                    fetched = False
            outcomes = self._agreement.gather(f"peer-healed-{target}", fetched)
            failed = [p for p, ok in enumerate(outcomes) if not ok]
            if not failed:
                self._replenish(target, reports)
                return
            nxt, instead = fallback(reports, target, durable, asked=step is not None)
            log.warning(
                "step %d cannot be healed: no peer holds an intact copy of the part of "
                "process%s %s; %s",
                target,
                "es" if len(failed) > 1 else "",
                ", ".join(map(str, failed)),
                instead,
            )
            target = nxt

    def _fetch(self, step: int, sources: Sequence[tuple[int, str]]) -> bool:
        """Fetches this process's part of ``step`` from the first holder with an intact
        copy and commits it on the own local root; False (logged) if none has one."""
        protocol = self._local.protocol
        for holder, attempt in sources:
            loc = StepLocation(step, new_attempt(protocol.write_epoch()))
            try:
                with self._connect(holder) as peer:
                    index = self._copy_in(peer, step, attempt, loc)
                extra = [n for n in index.files if is_held_manifest_name(n)]
                self._request_again(index)
                protocol.commit(
                    loc,
                    num_processes=index.num_processes,
                    metrics=index.metrics,
                    keep=index.keep,
                    processes=[self.me],
                    extra=extra,
                )
            except (PeerError, CorruptCheckpointError) as e:
                log.warning(
                    "the replica of step %d of process %d on %s is unusable (%s); "
                    "trying the next copy",
                    step,
                    self.me,
                    self._where(holder),
                    e,
                )
                protocol.abandon(loc)
                continue
            log.info(
                "step %d: fetched this process's part from %s and committed it on %s",
                step,
                self._where(holder),
                self._local.uri,
            )
            return True
        log.warning("step %d: no peer holds an intact copy of process %d's part", step, self.me)
        return False

    def _request_again(self, index: ReplicaIndex) -> None:
        """A step chosen for promotion and not durable yet is requested again (before its
        local marker, as a save does), taken over by this job's durable epoch: this
        process's promoter uploads the part it fetched, once."""
        epoch = self._durable.protocol.epoch
        if index.promote is None or epoch is None or self._durable.holds(index.step):
            return
        where = f"replica index of step {index.step}"
        request = PromotionRequest.from_bytes(index.promote.encode(), where)
        request_promotion(self._local.protocol, request.restamped(epoch, time.time()))

    def _copy_in(
        self, peer: PeerClient, step: int, attempt: str, loc: StepLocation
    ) -> ReplicaIndex:
        key = replica_index_key(step, self.me, attempt)
        raw = peer.get(key)
        if raw is None:
            raise CorruptCheckpointError(f"{peer.peer}: {key} is missing")
        index = ReplicaIndex.from_bytes(raw, f"{peer.peer}: {key}")
        if (index.step, index.process, index.attempt) != (step, self.me, attempt):
            raise CorruptCheckpointError(f"{peer.peer}: {key} names another part")
        if index.num_processes != jax.process_count():  # another topology: the durable root
            raise CorruptCheckpointError(
                f"step {step} was saved by {index.num_processes} processes, not "
                f"{jax.process_count()}; its replicas do not fit this job"
            )
        self._local.protocol.begin_save(loc)
        base = f"{replica_prefix(step, self.me)}{attempt}/"
        for name, digest in sorted(index.files.items()):
            data = peer.get(base + name)
            if data is None or FileDigest.of(data) != digest:
                what = "is missing" if data is None else "does not match its checksum"
                raise CorruptCheckpointError(f"step {step}: {peer.peer}: {base}{name} {what}")
            self._local.storage.write(loc.key(name), data)
        return index

    def _replenish(self, step: int, reports: Sequence[Any]) -> None:
        """Sends this process's part of ``step`` again to holders that lost it."""
        if not self._local.holds(step):
            return
        have = {
            p
            for p, (_, hs) in enumerate(reports)
            for s, src, _ in hs
            if (s, src) == (step, self.me)
        }
        missing = [h for h in self.placement.holders(self.me) if h not in have]
        if not missing:
            return
        marker = self._local.marker(step)
        for holder in missing:
            try:
                self._push(holder, marker.location, dict(marker.metrics), marker.keep, None)
                log.info(
                    "step %d: replica of process %d sent again to %s",
                    step,
                    self.me,
                    self._where(holder),
                )
            except (PeerError, CheckpointError) as e:
                log.warning(
                    "step %d: could not restore a replica on %s: %s", step, self._where(holder), e
                )


def join_tiers(tiers: Sequence[Tier], agreement: Agreement, options: CheckpointOptions) -> None:
    """Takes the tiers' epochs (``_tier.take_epochs``) and, with ``local_replicas > 1`` on a
    writable manager, connects the local tier to its peers (collective).

    Raises:
      PlacementError: fewer nodes than ``local_replicas``.
    """
    take_epochs(tiers, agreement, options)
    if options.local_replicas > 1 and not options.read_only:
        tiers[0].peers = Peers(tiers, agreement, options)


def bind_host(options: CheckpointOptions) -> str:
    """Where the peer listener binds: ``peer_host``, ``JAXCKPT_PEER_HOST``, loopback for a
    coordinator on loopback, else the address of this host's name."""
    if options.peer_host:
        return options.peer_host
    if os.environ.get(PEER_HOST_ENV):
        return os.environ[PEER_HOST_ENV]
    from jax._src import distributed

    coordinator = distributed.global_state.coordinator_address or ""
    if coordinator.rpartition(":")[0] in _LOOPBACK or not coordinator:
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())
