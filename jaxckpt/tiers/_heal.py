"""Healing the peer-replicated local tier: a lost process's part of a step fetched
back from the peers that hold its replicas (the half of :class:`~jaxckpt.tiers._peers.Peers`
that runs before a restore picks its step; the module docstring of
:mod:`jaxckpt.tiers._peers` describes both halves).

Every process reports the steps it holds on its own root and the replicas it holds;
the newest step whose every part is somewhere, that not every process has itself,
and that is not older than the newest durable step, is healed: each process lacking
its part fetches it from a holder (every file checked against the replica's index,
the next holder tried when a copy is corrupt) and commits it again on its own local
root; holders that lost their replica get it again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax

from jaxckpt.commit import Agreement
from jaxckpt.errors import CheckpointError, CorruptCheckpointError, PeerError
from jaxckpt.records import (
    REPLICAS,
    FileDigest,
    PromotionRequest,
    ReplicaIndex,
    StepLocation,
    is_held_manifest_name,
    new_attempt,
    replica_holdings,
    replica_index_key,
    replica_prefix,
    request_promotion,
)
from jaxckpt.tiers._peerclient import PeerClient
from jaxckpt.tiers._placement import Held, Placement, coverage, fallback, heal_target

if TYPE_CHECKING:
    from jaxckpt.tiers._tier import Tier

__all__ = ["Healing"]

log = logging.getLogger("jaxckpt")


class Healing:
    """The healing half of :class:`~jaxckpt.tiers._peers.Peers`, which supplies the
    state (set by its ``join``) and the connections to the other processes."""

    _local: Tier
    _durable: Tier
    _agreement: Agreement
    me: int
    placement: Placement

    if TYPE_CHECKING:  # supplied by Peers

        def _connect(self, process: int) -> Any: ...
        def _where(self, process: int) -> str: ...
        def _push(
            self,
            holder: int,
            loc: StepLocation,
            metrics: dict[str, float],
            keep: bool,
            promote: str | None,
        ) -> int: ...

    def held(self) -> list[Held]:
        """The complete replicas this process holds (listed; their indexes are read on use)."""
        return replica_holdings(self._local.storage.list(REPLICAS))

    def _reports(self, name: str, own: list[int]) -> list[tuple[list[int], list[Held]]]:
        """Every process's (own steps, replicas held), this one's ``own`` (collective: one
        gather)."""
        gathered = self._agreement.gather(name, [own, self.held()])
        return [(list(o), [(int(s), int(p), str(a)) for s, p, a in hs]) for o, hs in gathered]

    def complete(self) -> int | None:
        """The newest step complete in the union of the local tiers (collective: one gather
        of every process's steps and replicas, as :meth:`heal` starts)."""
        reports = self._reports("peer-complete", self._local.visible())
        return max(coverage(reports)[0], default=None)

    def heal(self, step: int | None) -> None:
        """Brings the newest step complete in the union of the local tiers (or ``step``)
        back onto every process's own local root (collective; see the module docstring).

        When a process finds no intact copy of its part of that step, every process
        goes on to the next newest complete step (never older than the newest durable
        one); the log says which step the restore gets instead.
        """
        own = self._local.visible()
        reports = self._reports("peer-coverage", own)
        reads = self.me == self._agreement.primary and self._durable.answers()  # not in an outage
        marker = self._durable.latest() if reads else None
        durable = self._agreement.agree("peer-durable", None if marker is None else marker.step)
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
