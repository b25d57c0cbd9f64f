"""The peer-replicated local tier: each process's local part on ``local_replicas`` nodes.

With ``local_replicas=k > 1`` a tiered manager holds a :class:`Peers`: a
listener of its own (:mod:`jaxckpt.tiers._transport`) serving ``replicas/`` of this
process's local root, the addresses and nodes of every process, the job's
secret (all three through the coordination service, at open) and the
placement (:mod:`jaxckpt.tiers._placement`). It does two things:

* **replicate** (the background part of a save, after this process's part is
  durable on its own local root and before its local marker): every file of
  the part's attempt goes to each of the ``k - 1`` holders, who store it under
  ``replicas/<step>/<process>/<attempt>/`` of their own local root (checked
  against its CRC32C on arrival), then the replica's index (every file's size
  and CRC32C), which makes the replica complete. The local commit waits for
  every holder's acknowledgement or failure; a dead or stalled holder fails
  its transfer after ``peer_timeout_s``, and the step commits *not replicated*
  there (logged and counted, :attr:`Peers.not_replicated`; the copy is sent
  again before the next save's replication while the step is held), unless
  ``strict_replication`` makes it fail the save (then no marker is written).
* **heal** (before a restore picks its step, on every process together):
  every process reports the steps it holds on its own root and the replicas
  it holds; the newest step whose every part is somewhere (the union of the
  surviving local tiers), that not every process has itself, and that is not
  older than the newest durable step, is *healed*: each process lacking its
  part fetches it from a holder (every file checked against the replica's
  index, the next holder tried when a copy is corrupt) and commits it again on
  its own local root; holders that lost their replica get it again. When some
  process finds no intact copy of its part, every process goes on to the next
  newest complete step (:func:`~jaxckpt.tiers._placement.fallback` says which,
  and the log says it), so one corrupt replica costs one step, not every local
  step. The restore selection then finds the step on every process's local
  tier. Healing is :class:`~jaxckpt.tiers._heal.Healing`, the other half of
  :class:`Peers`.

It also keeps the replicas this process holds for others (``replicas/``):
a step's go with the step (:meth:`Peers.delete`), and those of steps this
root no longer holds go with garbage collection (:meth:`Peers.collect`).

:func:`open_replicas` decides, once, when the local tier is opened, whether
it has a :class:`Peers` or :class:`NoReplicas` (which does nothing): the
tier's ``peers``. ``_open.join_tiers`` joins them to the job once the
epochs are taken; the save session replicates through them, the restore
selection heals through them, and the session closes them with the manager.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any, Protocol

import jax

from jaxckpt import _pools
from jaxckpt._options import CheckpointOptions
from jaxckpt.commit import Agreement, list_attempt, reached
from jaxckpt.errors import CheckpointError, PeerError
from jaxckpt.records import (
    REPLICAS,
    FileDigest,
    ReplicaIndex,
    StepLocation,
    is_stale_temp_key,
    is_temp_key,
    parse_replica_step,
    replica_index_key,
    replica_prefix,
)
from jaxckpt.tiers._heal import Healing
from jaxckpt.tiers._peerclient import connect
from jaxckpt.tiers._placement import Placement, node_id, place
from jaxckpt.tiers._transport import PeerServer, new_secret

if TYPE_CHECKING:
    from jaxckpt.tiers._tier import Tier

log = logging.getLogger("jaxckpt")

PEER_HOST_ENV = "JAXCKPT_PEER_HOST"
MIN_FRAME_BYTES = 256 << 20
"""The least a peer accepts in one frame: a file of a part is at most ``max_object_bytes``
(a chunk or a pack), but a process's manifest part can be larger."""
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


class Replicas(Protocol):
    """A tier's copies on other nodes, and the copies it holds for them (``local_replicas``)."""

    def join(self, agreement: Agreement, durable: Tier) -> None:
        """Connects to the peers (collective; once, after the tiers' epochs are taken)."""

    def replicate(
        self,
        loc: StepLocation,
        *,
        metrics: dict[str, float] | None,
        keep: bool,
        request: bytes | None = None,
    ) -> None:
        """Sends this process's part of ``loc`` to its holders (before its local marker)."""

    def heal(self, step: int | None) -> None:
        """Brings back, before a restore, a step whose parts are spread over the peers."""

    def complete(self) -> int | None:
        """The newest step complete in the union of the local tiers and their replicas
        (collective), what a restore could heal; None: none."""

    def collect(self) -> list[int]:
        """Removes the replicas held here that are stale; returns their steps."""
        ...

    def delete(self, step: int) -> None:
        """Removes the replicas of ``step`` held here (the step is deleted)."""

    def withdraw(self, step: int) -> None:
        """``step``'s save failed: its replicas held here go, its owed copies are not sent."""

    def short_of_room(self, why: str | None) -> None:
        """While ``why`` (the own tier is full), others' replicas are refused here."""

    def close(self) -> None:
        """Stops serving this process's replicas."""


class NoReplicas:
    """The replicas of a tier that has none (``local_replicas=1``, read-only, durable)."""

    def join(self, agreement: Agreement, durable: Tier) -> None:
        return None

    def replicate(
        self,
        loc: StepLocation,
        *,
        metrics: dict[str, float] | None,
        keep: bool,
        request: bytes | None = None,
    ) -> None:
        return None

    def heal(self, step: int | None) -> None:
        return None

    def complete(self) -> int | None:
        return None

    def collect(self) -> list[int]:
        return []

    def delete(self, step: int) -> None:
        return None

    def withdraw(self, step: int) -> None:
        return None

    def short_of_room(self, why: str | None) -> None:
        return None

    def close(self) -> None:
        return None


def open_replicas(local: Tier, options: CheckpointOptions) -> Replicas:
    """The replicas of the own tier ``local``: :class:`Peers` with ``local_replicas > 1``
    on a writable manager, else :class:`NoReplicas` (writes nothing; see ``Peers.join``)."""
    if options.local_replicas > 1 and not options.read_only:
        return Peers(local, options)
    return NoReplicas()


class Peers(Healing):
    """This process's side of the peer-replicated local tier.

    Opened with its tier, it keeps the replicas held there (:meth:`collect`,
    :meth:`delete`); :meth:`join` (collective) connects it to the other processes
    before it replicates or heals.

    Args:
      local: the own tier whose parts are replicated and which holds others' replicas.
      options: ``local_replicas``, ``peer_timeout_s``, ``peer_host``, ``max_object_bytes``.
    """

    placement: Placement
    """Which processes hold whose parts (set by :meth:`join`)."""
    addresses: list[str]
    """Every process's listener (set by :meth:`join`)."""

    def __init__(self, local: Tier, options: CheckpointOptions) -> None:
        self._local = local
        self._options = options
        self._timeout_s = options.peer_timeout_s
        self._max_bytes = max(options.max_object_bytes, MIN_FRAME_BYTES)
        self.me = jax.process_index()
        self._server: PeerServer | None = None
        self.not_replicated = 0
        """Copies of this process's parts that could not be sent (the steps went on)."""
        self._owed: dict[int, tuple[StepLocation, set[int], dict[str, float], bool, Any]] = {}
        """Steps not replicated to some holders: sent again before the next replication."""

    def join(self, agreement: Agreement, durable: Tier) -> None:
        """Agrees on the nodes, the placement and the job's secret, opens this process's
        listener and gathers every process's address (collective).

        Raises:
          PlacementError: fewer nodes than ``local_replicas``.
        """
        self._durable, self._agreement = durable, agreement
        nodes = agreement.gather("peer-nodes", node_id())
        self.placement = place(nodes, self._options.local_replicas)
        primary = self.me == agreement.primary
        self._secret = bytes.fromhex(
            agreement.agree("peer-secret", new_secret().hex() if primary else None)
        )
        self._server = server = PeerServer(
            self._local.storage,
            self._secret,
            host=bind_host(self._options),
            timeout_s=self._timeout_s,
            max_bytes=self._max_bytes,
        )
        try:
            self.addresses = agreement.gather("peer-addresses", server.address)
        except BaseException:
            server.close()
            raise

    def close(self) -> None:
        """Closes the listener (the manager's ``close``)."""
        if self._server is not None:
            self._server.close()

    def collect(self) -> list[int]:
        """Removes the replicas of steps older than the tier's newest step that it does
        not hold itself (their save failed here, or retention deleted them before the
        replicas came), and the temp files of received frames left by a crash (older
        than ``TEMP_GRACE_S``); returns the steps. A replica of a newer step may be in
        flight."""
        storage = self._local.storage
        keys = storage.list(REPLICAS)
        now = time.time()
        for key in keys:  # a frame that a crash cut while it streamed in
            if is_stale_temp_key(key, now):
                log.info("removing %s/%s (a replica file whose receipt was cut)", storage.uri, key)
                storage.delete(key)
        steps = {s for k in keys if (s := parse_replica_step(k)) is not None}
        own = set(self._local.visible())
        stale = sorted(s for s in steps - own if s < max(own, default=-1))
        for step in stale:
            log.info("removing replicas of step %d under %s (not held here)", step, storage.uri)
            storage.delete_prefix(replica_prefix(step))
        return stale

    def delete(self, step: int) -> None:
        """Removes the replicas of other processes' parts of ``step`` held here."""
        self._local.storage.delete_prefix(replica_prefix(step))

    def withdraw(self, step: int) -> None:
        """The save of ``step`` failed (on every process alike): it never commits, so the
        replicas of it held here go now and the copies of it owed are never sent. Kept,
        they took the room a full disk's next save needed: a holder keeps replicas newer
        than its own newest step (:meth:`collect`), and owed copies go out before every
        replication. A failure to delete is logged (``collect`` finds them later)."""
        self._owed.pop(step, None)
        try:
            self.delete(step)
        except CheckpointError as e:
            log.warning("step %d failed; its replicas held here stay for now: %s", step, e)

    def short_of_room(self, why: str | None) -> None:
        """While ``why`` is set (this process's own tier is full: retention keeps one step
        there), the listener refuses others' replicas: on the game day each arriving replica
        took the room a deleted step had freed, and the own part's save failed again. The
        sender commits its step without that copy (logged, counted, sent again later)."""
        if self._server is not None:
            self._server.full = why

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

        A holder that fails (unreachable, refused, timed out) leaves the step not
        replicated there: logged and counted, unless ``strict_replication``.

        Raises:
          PeerError: with ``strict_replication``, a holder failed (named).
        """
        holders = self.placement.holders(self.me)
        reached("replicating", loc.step)
        self._send_owed()
        start = time.monotonic()
        with _pools.borrow("peers", len(holders)) as pool:
            promote = None if request is None else request.decode()
            copy = (dict(metrics or {}), keep, promote)
            futures = [pool.submit(self._push, h, loc, *copy) for h in holders]
            sent = [self._sent(loc, h, f, copy) for h, f in zip(holders, futures, strict=True)]
        log.info(
            "step %d: replicated this process's part (%d bytes) to %s in %.2fs",
            loc.step,
            sent[0] if sent else 0,
            ", ".join(f"process {h}" for h in holders),
            time.monotonic() - start,
        )

    def _sent(self, loc: StepLocation, holder: int, pushed: Any, copy: tuple[Any, ...]) -> int:
        """The bytes a push sent; a failed one is raised (strict), or counted, logged and
        owed (sent again before the next replication)."""
        try:
            return int(pushed.result())
        except PeerError as e:
            if self._options.strict_replication:
                raise
            self.not_replicated += 1
            self._owed.setdefault(loc.step, (loc, set(), *copy))[1].add(holder)
            log.warning(
                "step %d is not replicated to %s: %s; the step commits without that copy "
                "(%d not replicated so far; it is sent again with the next save, and a "
                "restore heals it; strict_replication=True fails the save instead)",
                loc.step,
                self._where(holder),
                e,
                self.not_replicated,
            )
            return 0

    def _send_owed(self) -> None:
        """Sends the copies earlier replications could not, of steps still held here; a
        failure leaves them owed (logged), never fails this save."""
        for step, (loc, holders, metrics, keep, promote) in sorted(self._owed.items()):
            if not list_attempt(self._local.storage, loc):  # deleted since (retention)
                del self._owed[step]
                continue
            for holder in sorted(holders):
                try:
                    self._push(holder, loc, metrics, keep, promote)
                except CheckpointError as e:  # PeerError, or the step vanished meanwhile
                    log.warning(
                        "step %d is still not replicated to %s: %s", step, self._where(holder), e
                    )
                    continue
                holders.discard(holder)
                log.info("step %d: replicated to %s late", step, self._where(holder))
            if not holders:
                del self._owed[step]

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
                for key in list_attempt(storage, loc):  # its part, hashed prefixes too
                    name = loc.name_of(key)
                    if is_temp_key(key) or name is None:
                        continue
                    data = storage.read(key)
                    if data is None:
                        raise CheckpointError(f"{self._local.uri}/{key} vanished while replicated")
                    if len(data) > self._max_bytes:
                        raise PeerError(
                            f"{self._local.uri}/{key} is {len(data)} bytes, over the peer "
                            f"transport's bound of {self._max_bytes} (max_object_bytes)"
                        )
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
