"""Promotion: copying steps committed on a fast local tier to the durable root.

A tiered :class:`~jaxckpt.CheckpointManager` saves to a local root (one per
host). For each save its ``promote_policy`` chooses, every host writes a
*promotion request* ``promote/<step>.json`` into its local root *before* its
local commit marker, naming the durable root's writer epoch of the job (and,
on several hosts, the durable attempt agreed at the save). A
:class:`Promoter` — a thread of the manager (``promotion="background"``) or
the ``jaxckpt promote`` command / sidecar (``promotion="external"``), one per
host — copies each requested step (every chunk checked against the local
manifest) into an attempt of that epoch on the durable root, and the marker
is written with the same protocol: by the single host's promoter, or on
several hosts by the primary's once every host's manifest part is there.

The promoter never takes an epoch of its own (that would fence the job): it
writes as the job, and checks the fence before it begins and before the
marker, so the promoter of a fenced job stops. A promoter killed mid-upload
leaves an attempt without a marker (never listed; garbage collection removes
it) and the request, so the next pass starts the step again.

Requests are promoted newest first; a newer request never cancels an older
one. The requests and the outcomes of a pass are records of their own
(:mod:`jaxckpt.records._requests`); re-encoding durable steps into an archive root is
:func:`~jaxckpt.lifecycle._archive.archive_once`. Imports no jax.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from jaxckpt import policy
from jaxckpt.commit import TIDY_S, CommitProtocol, list_attempt
from jaxckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StepAlreadyExistsError,
    StepNotFoundError,
    WriterFencedError,
)
from jaxckpt.lifecycle._backoff import Backoff
from jaxckpt.lifecycle._keep import retention_decision
from jaxckpt.lifecycle._watch import PARTS_POLL_S, watch
from jaxckpt.records import (
    ALREADY_DURABLE,
    FAILED,
    FENCED,
    GONE,
    PARTS_WAITING,
    PENDING,
    PROMOTED,
    SUPERSEDED,
    UNSTAMPED,
    UPLOADED,
    WAITING,
    CommitMarker,
    PromotionRequest,
    PromotionResult,
    StepLocation,
    health_records,
    manifest_name,
    promote_key,
    prune_receipts,
    read_requests,
    withdraw,
    withdraw_durable,
)

log = logging.getLogger("jaxckpt")

RETRY_BACKOFF_S = (1.0, 60.0)
"""The wait before retrying a step whose promotion failed: the first, and the longest (it
doubles with each failure in a row, with jitter; see ``_backoff``)."""


class Promoter:
    """Promotes requested local steps to a durable root; one pass at a time.

    Args:
      local: the local tier (read; its requests are removed when done).
      durable: the durable root (an operator protocol: the promoter never
        takes an epoch; each copy is written in its request's epoch).
      epoch: write in this epoch instead of each request's (the manager's own
        background promoter passes the job's epoch).
      retention: applied to the durable root after each promoted step, in the
        request's epoch (fence-checked before each deletion).
      on_result: called with every result (telemetry, metrics).
      parts_timeout_s: multi-host, the primary's promoter: how long a step may
        wait for the other hosts' parts, counted from the pass that first began
        it, in any attempt (a restart restamps a request into its new epoch).
        A pass never waits: a step whose parts are missing is looked at again
        by the next pass, so newer steps are not held up behind it. Past the
        bound it fails (retried after a back-off), or, once a newer step is
        durable, its request is dropped (a host lost its copy: it never comes).
        A step that a newer durable one supersedes is dropped at once when its
        request was restamped since it was begun: the other hosts uploaded their
        parts into the old attempt and withdrew their requests.
      backoff_s: a step whose promotion failed (the store failed; its request
        stays) is left alone for ``backoff_s[0]`` seconds, doubling with each
        failure in a row up to ``backoff_s[1]``, with jitter: passes in between
        skip it, and each failure is logged once.
    """

    def __init__(
        self,
        local: CommitProtocol,
        durable: CommitProtocol,
        *,
        epoch: int | None = None,
        retention: policy.RetentionPolicy | None = None,
        on_result: Callable[[PromotionResult], None] | None = None,
        parts_timeout_s: float = 300.0,
        backoff_s: tuple[float, float] = RETRY_BACKOFF_S,
    ) -> None:
        self.local = local
        self.durable = durable
        self.epoch = epoch
        self.retention = retention
        self.parts_timeout_s = parts_timeout_s
        self._on_result = on_result
        self._warned_fenced: set[int] = set()
        self._stop: threading.Event | None = None
        self._waiting: dict[int, tuple[StepLocation, float]] = {}
        """The primary's steps waiting for parts: the attempt begun last, and since when
        the step waits (its first attempt)."""
        self._newest_durable: int | None = None  # as of this pass's listing
        self.backoff = Backoff(first_s=backoff_s[0], longest_s=backoff_s[1])
        """The steps left alone after a failure (and, as ``None``, failed passes)."""
        self.busy_since: float | None = None  # the pass under way began (a failed one: stays)

    def writer(self, epoch: int) -> CommitProtocol:
        """A protocol of the durable root that writes (and fence-checks) as ``epoch``."""
        protocol = CommitProtocol(self.durable.storage)
        protocol.epoch = epoch
        return protocol

    def pending(self) -> list[PromotionRequest]:
        """Requests whose step is not durable yet, newest first (the durable root is
        listed only when a request is there: an idle sidecar sends it nothing).

        Requests of durable steps are removed (a multi-host part whose step
        another host's promoter committed, a promoter killed after the marker).
        Unstamped ones (their job has no durable epoch yet) wait for their stamp.
        """
        stamped = self.epoch is not None
        receipts: set[int] = set()
        requests = read_requests(self.local, receipts=receipts)
        prune_receipts(self.local, receipts)
        asked = [r for r in requests.values() if stamped or r.epoch != UNSTAMPED]
        durable = self.durable.visible_refs() if asked else set()
        self._newest_durable = max(durable, default=None)
        todo = []
        for request in asked:
            if request.step in durable:
                withdraw_durable(self.local, request.step)
            else:
                todo.append(request)
        waiting = {r.step for r in todo}
        self._waiting = {step: w for step, w in self._waiting.items() if step in waiting}
        return sorted(todo, key=lambda r: r.step, reverse=True)

    def promote_once(self, *, stop: threading.Event | None = None) -> list[PromotionResult]:
        """Promotes every requested step that is not durable yet, newest first.

        A step that cannot be copied because the store failed keeps its request
        and is retried after a back-off (passes before then skip it; the failure
        is logged once); one whose local copy is corrupt or gone loses it
        (logged). ``stop`` ends the pass between steps.
        """
        results = []
        self._stop, self.busy_since = stop, time.monotonic()
        for request in self.pending():
            if stop is not None and stop.is_set():
                break
            if not self.backoff.due(request.step):
                continue
            try:
                result = self.promote(request)
            except CheckpointError as e:  # this step only: the pass goes on with the rest
                result = PromotionResult(
                    step=request.step, outcome=FAILED, request=request, error=str(e)
                )
            self._note(result)
            results.append(result)
            if self._on_result is not None and result.outcome != PARTS_WAITING:
                self._on_result(result)  # told once the step is decided
        self.busy_since = None
        return results

    def promote_all(self, *, stop: threading.Event | None = None) -> list[PromotionResult]:
        """Passes of :meth:`promote_once` until no step waits for other hosts' parts
        (each bounded by ``parts_timeout_s``): a one-shot run; the last result of each
        step, newest first."""
        final: dict[int, PromotionResult] = {}
        while True:
            results = self.promote_once(stop=stop)
            final.update({r.step: r for r in results})
            waiting = any(r.outcome == PARTS_WAITING for r in results)
            if not waiting or (stop is not None and stop.is_set()):
                return sorted(final.values(), key=lambda r: r.step, reverse=True)
            time.sleep(PARTS_POLL_S)

    def _note(self, result: PromotionResult) -> None:
        """Backs off from a step that failed or was fenced (its request stays), logged once
        per failure; forgets a step that is done."""
        step = result.step
        if result.outcome not in (FAILED, FENCED):
            self.backoff.succeeded(step)
            return
        if (
            self.local.storage.read(promote_key(step)) is None
        ):  # its local copy is damaged or gone: said where it was dropped
            self.backoff.succeeded(step)
            return
        delay = self.backoff.failed(step)
        if result.outcome == FAILED:
            log.error(
                "promotion of step %d failed (%d in a row; retried in %.1fs): %s",
                step,
                self.backoff.failures(step),
                delay,
                result.error,
            )

    def promote(self, request: PromotionRequest) -> PromotionResult:
        """Copies one requested step (multi-host: this host's part) to the durable root."""
        step, start = request.step, time.monotonic()
        epoch = self.epoch if self.epoch is not None else request.epoch
        marker = self.local.read_marker(step)
        if marker is None:
            return self._not_committed(request)
        writer = self.writer(epoch)
        try:
            if request.processes > 1:
                nbytes, committed = self._promote_part(
                    request.restamped(epoch, 0.0), marker, writer
                )
                if not committed:
                    return self._part_result(request, nbytes, time.monotonic() - start)
            else:
                from jaxckpt.tools import copy_step

                nbytes = copy_step(self.local, writer, marker)
        except StepAlreadyExistsError:
            withdraw_durable(self.local, step)
            return PromotionResult(step=step, outcome=ALREADY_DURABLE, request=request)
        except _PartsMissing as e:
            if self._superseded(request):
                log.warning("promotion of step %d dropped: %s; %s", step, e, SUPERSEDED)
                withdraw(self.local, step)
                return PromotionResult(step=step, outcome=SUPERSEDED, request=request)
            return PromotionResult(step=step, outcome=FAILED, request=request, error=str(e))
        except WriterFencedError as e:
            if step not in self._warned_fenced:
                self._warned_fenced.add(step)
                log.error("promotion of step %d stopped: %s", step, e)
            return PromotionResult(step=step, outcome=FENCED, request=request, error=str(e))
        except (CheckpointError, OSError) as e:
            if not self._still_local(marker):  # deleted meanwhile (local retention): benign
                log.info("promotion of step %d skipped: deleted from %s", step, self.local.where())
                withdraw(self.local, step)
                return PromotionResult(step=step, outcome=GONE, request=request)
            if not isinstance(e, CorruptCheckpointError):  # retried after a back-off (logged)
                return PromotionResult(step=step, outcome=FAILED, request=request, error=str(e))
            log.error("promotion of step %d failed; its local copy is damaged: %s", step, e)
            withdraw(self.local, step)
            return PromotionResult(step=step, outcome=FAILED, request=request, error=str(e))
        durable_marker = writer.read_marker(step)
        writer.tidying.settle(TIDY_S)  # its pending record goes before a one-shot run ends
        withdraw_durable(self.local, step)
        self._newest_durable = max(step, self._newest_durable or step)
        seconds = time.monotonic() - start
        log.info(
            "promoted step %d to %s: %d bytes in %.2fs", step, self.durable.where(), nbytes, seconds
        )
        if self.retention is not None:
            self.apply_retention(writer)
        return PromotionResult(
            step=step,
            outcome=PROMOTED,
            nbytes=nbytes,
            seconds=seconds,
            durable_time=durable_marker.time if durable_marker is not None else time.time(),
            request=request,
        )

    def _superseded(self, request: PromotionRequest) -> bool:
        """Whether a newer step than ``request``'s is durable (as of this pass)."""
        return self._newest_durable is not None and self._newest_durable > request.step

    def _part_result(
        self, request: PromotionRequest, nbytes: int, seconds: float
    ) -> PromotionResult:
        """A multi-host step not committed by this call: the primary's waits for parts;
        another host's part is uploaded, and its request stays until the step is
        durable, or goes once a newer step is (the primary's promoter has all it needs
        from this host, or dropped the step: a request kept forever would pin the step
        in the local tier)."""
        step = request.step
        if request.process == request.primary:
            outcome = PARTS_WAITING
        elif self._superseded(request):
            log.info("step %d: part uploaded; %s (request withdrawn)", step, SUPERSEDED)
            withdraw(self.local, step)
            outcome = SUPERSEDED
        else:
            outcome = UPLOADED
        return PromotionResult(
            step=step, outcome=outcome, nbytes=nbytes, seconds=seconds, request=request
        )

    def _still_local(self, marker: CommitMarker) -> bool:
        """Whether ``marker`` is still the local step's commit (True if that cannot be told)."""
        try:
            return self.local.still_committed(marker)
        except CheckpointError:
            return True

    def _not_committed(self, request: PromotionRequest) -> PromotionResult:
        """A request without a local marker: its save is under way (the request is
        written before the marker), or it never committed (a killed trainer whose
        attempt was collected since) or was deleted: then the request goes."""
        step = request.step
        under_way = bool(self.local.storage.list(f"{PENDING}{step}/"))
        if self.local.read_marker(step) is not None:  # committed between the two reads
            return self.promote(request)
        if under_way:
            return PromotionResult(step=step, outcome=WAITING, request=request)
        log.warning(
            "promotion of step %d skipped: not committed under %s", step, self.local.where()
        )
        withdraw(self.local, step)
        return PromotionResult(step=step, outcome=GONE, request=request)

    def _promote_part(
        self, request: PromotionRequest, marker: CommitMarker, writer: CommitProtocol
    ) -> tuple[int, bool]:
        """Multi-host: uploads this host's part into the agreed attempt; the primary's
        promoter also writes the tree record, waits (bounded) for every part, and
        commits. Returns the chunk bytes copied and whether this call committed.

        A part is uploaded once: its manifest part is written after its chunks,
        so a present manifest part means the part is complete.
        """
        from jaxckpt.tools import copy_part

        assert request.attempt is not None
        step = request.step
        loc = StepLocation(step, request.attempt)
        primary = request.process == request.primary
        begun = self._waiting.get(step)
        if primary and (begun is None or begun[0] != loc):
            if begun is not None and self._superseded(request):
                del self._waiting[step]
                raise _PartsMissing(
                    f"step {step} was restamped into {loc.attempt} since it was begun: the "
                    "other hosts' parts went to the old attempt"
                )
            writer.begin_save(loc)  # raises if durable already or fenced
            self._waiting[step] = (loc, time.monotonic() if begun is None else begun[1])
        elif primary:
            writer.check_fence(f"promote step {step}")
        else:
            if step in writer.visible_refs():
                raise StepAlreadyExistsError(f"step {step} is durable under {writer.where()}")
            writer.check_fence(f"promote step {step}")
        nbytes = 0
        if writer.storage.read(loc.key(manifest_name(request.process))) is None:
            nbytes = copy_part(
                self.local, writer, marker, loc, process=request.process, records=primary
            )
        if not primary:
            return nbytes, False
        if not self._parts_present(writer, loc, request.processes):
            return nbytes, False  # the next pass looks again
        writer.commit(
            loc, num_processes=request.processes, metrics=dict(marker.metrics), keep=marker.keep
        )
        self._waiting.pop(step, None)
        return nbytes, True

    def _parts_present(self, writer: CommitProtocol, loc: StepLocation, processes: int) -> bool:
        """Whether every process's manifest part is in the durable attempt (one listing
        of the prefixes of the parts); raises :class:`_PartsMissing` once the step has
        waited ``parts_timeout_s`` since its pass began it."""
        missing = {loc.key(manifest_name(p)): manifest_name(p) for p in range(processes)}
        for key in list_attempt(writer.storage, loc, names=missing.values()):
            missing.pop(key, None)
        if not missing:
            return True
        _, since = self._waiting.get(loc.step, (loc, time.monotonic()))
        if time.monotonic() - since <= self.parts_timeout_s:
            return False
        self._waiting.pop(loc.step, None)  # begun again (a new pending record) if retried
        raise _PartsMissing(
            f"cannot commit {loc} under {writer.where()}: the parts {sorted(missing)} of "
            f"other hosts are not uploaded within {self.parts_timeout_s:.0f}s"
        )

    def apply_retention(self, writer: CommitProtocol) -> list[int]:
        """Deletes the durable steps ``retention`` does not keep (never the newest good
        one); returns them."""
        bad = health_records.bad_steps(writer.storage)
        decision = retention_decision(writer.committed(), self.retention, bad=bad)
        deleted = []
        for step in decision.delete:
            log.info("durable retention: deleting step %d under %s", step, writer.where())
            try:
                writer.delete(step)
            except StepNotFoundError:  # another pruner deleted it meanwhile: benign
                log.info("durable retention: step %d was already deleted", step)
                continue
            deleted.append(step)
        return deleted

    def watch(
        self,
        stop: threading.Event,
        *,
        interval_s: float = 5.0,
        wake: threading.Event | None = None,
        on_pass: Callable[[list[PromotionResult]], None] | None = None,
    ) -> None:
        """Runs :meth:`promote_once` until ``stop`` is set (see :func:`watch`)."""
        watch(self, stop, interval_s=interval_s, wake=wake, on_pass=on_pass)


class _PartsMissing(CheckpointError):
    """The primary's promoter waited ``parts_timeout_s`` for other hosts' parts."""
