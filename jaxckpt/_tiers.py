"""The durable tier of a tiered :class:`~jaxckpt.CheckpointManager`.

A tiered manager saves to a fast local root (its ordinary save path) and
holds one :class:`DurableTier` for the durable root: its storage, protocol,
reader and retention, and the promotion that moves chosen local steps there —
a :class:`~jaxckpt._promote.Promoter` on a background thread
(``promotion="background"``) or nothing but the requests, left to a
``jaxckpt promote`` sidecar (``promotion="external"``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import tensorstore as ts

from jaxckpt import _gc, policy
from jaxckpt._agree import Agreement
from jaxckpt._commit import CommitProtocol, brief
from jaxckpt._layout import new_attempt
from jaxckpt._promote import (
    FAILED,
    FENCED,
    PROMOTED,
    Promoter,
    PromotionRequest,
    PromotionResult,
    read_requests,
    request_promotion,
)
from jaxckpt._records import CommitMarker
from jaxckpt._restore import StepReader
from jaxckpt._storage import open_storage
from jaxckpt._tsio import ArrayWriter
from jaxckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    PromotionError,
    PromotionTimeoutError,
    StepNotFoundError,
    UncommittedStepError,
)

log = logging.getLogger("jaxckpt")

PROMOTION_MODES = ("background", "external")


class DurableTier:
    """The durable root of a tiered manager and the promotion into it.

    Args:
      root: the durable root's URI.
      local: the local tier's protocol (where saves commit and requests live).
      storage_options: backend options of the durable root.
      max_inflight_bytes: for reads of the durable root.
      read_only: take no epoch and promote nothing.
      promotion: ``"background"`` or ``"external"``.
      promote_policy: which locally committed steps to promote (None: all).
      retention: retention of the durable root.
      gc_grace_s: collect the durable root's garbage on open (attempts of
        fenced writers, e.g. a killed promoter of an earlier run, and stale
        ones) with this grace period; None: do not.
      interval_s: how often the background promoter looks for requests it
        was not woken for (requests of an earlier run).
      agreement: shares the durable epoch among the job's processes (the
        primary takes it; every host's promoter writes in it).
      primary_host: the process that takes the epoch, collects garbage,
        commits promoted steps and applies the durable retention.
      parts_timeout_s: multi-host: how long the primary's promoter waits for
        the other hosts' parts of a step (per pass).
    """

    def __init__(
        self,
        root: str,
        local: CommitProtocol,
        *,
        storage_options: Any,
        max_inflight_bytes: int,
        read_only: bool,
        promotion: str,
        promote_policy: policy.SavePolicy | None,
        retention: policy.RetentionPolicy | None,
        gc_grace_s: float | None = None,
        interval_s: float = 5.0,
        agreement: Agreement | None = None,
        primary_host: int = 0,
        parts_timeout_s: float = 300.0,
    ) -> None:
        storage = open_storage(root, **dict(storage_options))
        if storage.uri == local.storage.uri:
            raise CheckpointError(f"local_root and root are the same root: {storage.uri}")
        self.protocol = CommitProtocol(storage)
        self.context = ts.Context(storage.context_spec())
        arrays = ArrayWriter(storage, self.context, max_inflight_bytes=max_inflight_bytes)
        self.reader = StepReader(self.protocol, arrays, self.context)
        self.local = local
        self.promotion = promotion
        self.promote_policy = promote_policy
        self.retention = retention
        self._lock = threading.Lock()
        self._last_requested: int | None = None
        self._last_request_time: float | None = None
        self._errors: dict[int, tuple[str, str]] = {}  # step -> (outcome, message)
        self._durable_times: dict[int, float] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.promoter: Promoter | None = None
        self._process, self._processes = jax.process_index(), jax.process_count()
        self._primary_host = primary_host
        self.primary = self._process == primary_host
        if read_only:
            self.protocol.ensure_root(create=False)
            return
        epoch = None
        if self.primary:  # the job's one durable epoch
            self.protocol.ensure_root(create=True)
            epoch = self.protocol.take_epoch().epoch
            if gc_grace_s is not None:
                try:
                    found = _gc.scan(self.protocol, full=False)
                    _gc.collect(self.protocol, found, grace_s=gc_grace_s)
                except CheckpointError as e:
                    log.warning("garbage collection on open of %s failed: %s", self.uri, e)
        if agreement is not None:
            epoch = agreement.agree("durable-epoch", epoch)
        assert epoch is not None
        self.protocol.epoch = epoch
        self._restamp(epoch)
        if promotion == "background":
            self.promoter = Promoter(
                local,
                self.protocol,
                epoch=epoch,
                retention=retention if self.primary else None,
                on_result=self._result,
                parts_timeout_s=parts_timeout_s,
            )
            self._thread = threading.Thread(
                target=self.promoter.watch,
                args=(self._stop,),
                kwargs={"interval_s": interval_s, "wake": self._wake},
                name="jaxckpt-promoter",
                daemon=True,
            )
            self._thread.start()

    @property
    def uri(self) -> str:
        return self.protocol.storage.uri

    def _restamp(self, epoch: int) -> None:
        """Requests of an earlier run (its epoch is fenced now) are taken over by this one."""
        for request in read_requests(self.local).values():
            if request.epoch < epoch:
                request_promotion(self.local, request.restamped(epoch, time.time()))

    # -- the trainer's side ---------------------------------------------------

    def chosen(self, step: int, *, preempted: bool) -> bool:
        """Whether ``promote_policy`` promotes the locally committed ``step``."""
        if self.promote_policy is None:
            return True
        with self._lock:
            last_step, last_time = self._last_requested, self._last_request_time
        ctx = policy.SaveContext(
            step=step,
            now=time.monotonic(),
            last_saved_step=last_step,
            last_save_time=last_time,
            preempted=preempted,
        )
        return bool(self.promote_policy.should_save(ctx))

    def new_attempt(self) -> str:
        """A fresh durable attempt id in the job's epoch (multi-host: the primary's is agreed)."""
        assert self.protocol.epoch is not None
        return new_attempt(self.protocol.epoch)

    def new_request(self, step: int, *, saved: float, attempt: str | None) -> PromotionRequest:
        """The promotion request of ``step``, which the save writes before its local marker."""
        assert self.protocol.epoch is not None
        with self._lock:
            self._last_requested = step
            self._last_request_time = time.monotonic()
            self._errors.pop(step, None)
        return PromotionRequest(
            step=step,
            epoch=self.protocol.epoch,
            requested=time.time(),
            saved=saved,
            attempt=attempt,
            process=self._process,
            processes=self._processes,
            primary=self._primary_host,
        )

    def wake(self) -> None:
        """A local commit happened: the background promoter looks for requests now."""
        self._wake.set()

    def pending_steps(self) -> set[int]:
        """Requested steps not durable yet (local retention must keep them)."""
        durable = self.protocol.visible_refs()
        return {s for s in read_requests(self.local) if s not in durable}

    def _result(self, result: PromotionResult) -> None:
        with self._lock:
            if result.outcome in (FAILED, FENCED):
                self._errors[result.step] = (result.outcome, result.error or result.outcome)
            else:
                self._errors.pop(result.step, None)
            if result.outcome == PROMOTED and result.durable_time is not None:
                self._durable_times[result.step] = result.durable_time

    def durable_time(self, step: int) -> float | None:
        """Wall-clock time ``step`` was committed on the durable root, if it was."""
        with self._lock:
            if step in self._durable_times:
                return self._durable_times[step]
        marker = self.protocol.read_marker(step)
        return None if marker is None else marker.time

    def wait_durable(self, step: int | None, timeout_s: float) -> int | None:
        """Blocks until ``step`` (default: the newest requested) is durable; returns it.

        Raises:
          PromotionError: the background promoter failed on that step for good
            (a damaged local copy) or was fenced.
          PromotionTimeoutError: not durable within ``timeout_s``.
        """
        with self._lock:
            target = self._last_requested if step is None else step
        if target is None:
            marker = self.protocol.latest()
            return None if marker is None else marker.step
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while True:
            if target in self.protocol.visible_refs():
                return target
            with self._lock:
                outcome, error = self._errors.get(target, (None, None))
            requested = target in read_requests(self.local)
            if error is not None and (not requested or outcome == FENCED):
                raise PromotionError(
                    f"step {target} was not promoted from {self.local.where()} to {self.uri}: "
                    f"{error}"
                )
            if not requested and self.local.read_marker(target) is None:
                raise PromotionError(
                    f"step {target} is neither durable under {self.uri} nor committed "
                    f"under {self.local.where()}"
                )
            if time.monotonic() > deadline:
                raise PromotionTimeoutError(
                    f"step {target} did not become durable under {self.uri} within "
                    f"{timeout_s:.0f}s" + (f" (last error: {error})" if error else "")
                )
            self._wake.set()
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def apply_retention(self) -> None:
        """Applies the durable root's retention in this job's epoch (fence-checked; primary)."""
        if self.retention is None or self.protocol.epoch is None or not self.primary:
            return
        if self.promoter is not None:
            self.promoter.apply_retention(self.protocol)
        else:
            Promoter(self.local, self.protocol, retention=self.retention).apply_retention(
                self.protocol
            )

    def close(self, timeout_s: float) -> None:
        """Background: waits up to ``timeout_s`` for requested steps, then stops."""
        if self._thread is None:
            return
        deadline = time.monotonic() + timeout_s
        try:
            while (left := self.pending_steps()) and time.monotonic() < deadline:
                with self._lock:
                    fenced = any(self._errors.get(s, ("",))[0] == FENCED for s in left)
                if fenced:
                    break  # this job may no longer write there: nothing left to wait for
                self._wake.set()
                time.sleep(0.05)
            if self.promoter is not None:
                try:  # drops the requests of durable steps (another host's promoter committed)
                    self.promoter.pending()
                except CheckpointError as e:
                    log.warning("promotion requests under %s kept: %s", self.local.where(), e)
            if left:
                log.warning(
                    "closing with steps %s not yet promoted to %s; they stay requested under "
                    "%s: run `jaxckpt promote %s %s` to finish",
                    sorted(left),
                    self.uri,
                    self.local.where(),
                    self.local.storage.uri,
                    self.uri,
                )
        finally:
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout=max(1.0, deadline - time.monotonic()) + 30.0)


def local_everywhere(agreement: Agreement, steps: Iterable[int]) -> set[int]:
    """The steps committed on the local tier of every host (collective)."""
    common = set(steps)
    for other in agreement.gather("local-steps", sorted(common)):
        common &= set(other)
    return common


def require_own_local_roots(agreement: Agreement, local_uri: str) -> None:
    """Refuses a local tier that two processes of this job on one machine would share
    (collective; nothing is written before it passes).

    Every host is the only writer of its local root: two processes on one
    machine given the same ``local_root`` (say, one process per GPU with
    ``local_root="/mnt/nvme/run1"``) would fence each other's epochs there.
    A path on storage that several machines mount is not detected.

    Raises:
      CheckpointError: two processes have the same host name and local root.
    """
    if jax.process_count() == 1:
        return
    path = local_uri if "://" in local_uri else os.path.realpath(local_uri)
    first: dict[tuple[str, str], int] = {}
    for process, (host, where) in enumerate(
        agreement.gather("local-roots", [socket.gethostname(), path])
    ):
        other = first.setdefault((host, where), process)
        if other != process:
            raise CheckpointError(
                f"local_root {where!r} on host {host}: processes {other} and {process} of this "
                "job share it; each process needs a local tier of its own, e.g. "
                f'local_root=f"{where}/{{jax.process_index()}}"'
            )


class TieredRestore:
    """``restore()`` of a tiered manager: each host reads the nearest intact copy.

    A step is restorable when it is durable or committed on the local tier of
    every host. Each host reads its regions from its own local copy when it
    has one that reads back intact, else from the durable copy; a step fails
    (and, without a step asked for, the next older one is tried, on every
    host together) only when some host could read it from neither.

    Args:
      local, local_reader: this host's local tier.
      durable: the durable tier.
      agreement: the manager's (candidates and failures are shared).
      primary: this process lists the durable root for everyone.
      fallback_on_corrupt: without a step, try older steps after a corrupt one.
      read: reads one step of one tier (the manager's, which guards the step
        against its retention while reading).
    """

    def __init__(
        self,
        local: CommitProtocol,
        local_reader: StepReader,
        durable: DurableTier,
        agreement: Agreement,
        *,
        primary: bool,
        fallback_on_corrupt: bool,
        read: Callable[[CommitMarker, CommitProtocol, StepReader], Any],
    ) -> None:
        self._local = local
        self._local_reader = local_reader
        self._durable = durable
        self._agreement = agreement
        self._primary = primary
        self._fallback = fallback_on_corrupt
        self._read = read

    def _where(self) -> str:
        return f"{self._local.storage.uri} or {self._durable.uri}"

    def restore(self, step: int | None) -> Any:
        """Restores ``step`` (None: the newest restorable one) on every host."""
        durable = self._durable.protocol
        local = set(self._local.committed())
        common = local_everywhere(self._agreement, local)
        on_durable = set(durable.committed()) if self._primary else set()
        on_durable = set(self._agreement.agree("restore-durable", sorted(on_durable)))
        if step is not None:
            if step not in common | on_durable:
                raise StepNotFoundError(
                    f"step {step} is neither under {durable.storage.uri} nor committed on the "
                    f"local tier of every host (local here: {brief(sorted(local))}; durable: "
                    f"{brief(sorted(on_durable))})"
                )
            candidates = [step]
        else:
            candidates = sorted(common | on_durable, reverse=True)
        if not candidates:
            raise StepNotFoundError(f"no committed steps under {self._where()}")
        for i, s in enumerate(candidates):
            last = i == len(candidates) - 1
            try:
                return self._nearest(s, s in local, s in on_durable)
            except StepNotFoundError:
                if last:
                    raise
            except CorruptCheckpointError as error:
                if not self._fallback or last:
                    raise
                log.warning(
                    "step %d is corrupt (%s); falling back to step %d", s, error, candidates[i + 1]
                )
        raise AssertionError("unreachable")

    def _nearest(self, step: int, local: bool, durable: bool) -> Any:
        """This host's regions of ``step`` from its local copy, else the durable one."""
        tiers = [("local", self._local, self._local_reader)] if local else []
        if durable:
            tiers.append(("durable", self._durable.protocol, self._durable.reader))
        restored, error, ok = None, None, False
        for name, protocol, reader in tiers:
            try:
                restored = self._read(protocol.require_marker(step), protocol, reader)
            except (StepNotFoundError, UncommittedStepError, CorruptCheckpointError) as e:
                error = e
                if name == "local" and durable:
                    log.warning(
                        "the local copy of step %d is corrupt or incomplete on this host (%s); "
                        "reading the durable copy",
                        step,
                        e,
                    )
                continue
            log.info("restored step %d from the %s copy (%s)", step, name, protocol.storage.uri)
            ok = True
            break
        failed = None
        if not ok:
            failed = "corrupt" if isinstance(error, CorruptCheckpointError) else "missing"
        kinds = self._agreement.gather("restore-failed", failed)
        if not any(kinds):
            return restored
        if "corrupt" in kinds:  # every host raises the same class: they move on together
            if isinstance(error, CorruptCheckpointError):
                raise error
            raise CorruptCheckpointError(
                f"step {step} under {self._where()} is corrupt in a region another process "
                "read (from every copy it has)"
            )
        if isinstance(error, StepNotFoundError):
            raise error
        raise StepNotFoundError(f"step {step} could not be found by another process")
