"""Promotion of a tiered manager: which local steps become durable, and when.

A tiered manager saves to each host's local tier; the steps its
``promote_policy`` chooses get a promotion request, written with the save
before the local marker (:class:`~jaxckpt.saving._session.SaveSession`). A
:class:`~jaxckpt.lifecycle._promoter.Promoter` copies them to the durable tier: on a
background thread (``promotion="background"``) or in a ``jaxckpt promote``
sidecar (``promotion="external"``, where this component only writes the
requests). :class:`Promotion` owns the choice of steps, the requests, the
background promoter and ``wait_durable``; the tiers themselves (storage,
epochs, readers) are :class:`~jaxckpt.tiers._tier.Tier` objects, and durable
retention is the manager's one :class:`~jaxckpt.lifecycle._retention.Retention`.

A plain manager (one tier) has :class:`NoPromotion`, which requests nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future

import jax

from jaxckpt import _pools as pools
from jaxckpt import policy
from jaxckpt._options import CheckpointOptions
from jaxckpt._preemption import notices_alike
from jaxckpt.commit import Agreement
from jaxckpt.errors import (
    CheckpointError,
    PromotionError,
    PromotionTimeoutError,
    SaveFailedError,
)
from jaxckpt.lifecycle._nopromotion import NoPromotion
from jaxckpt.lifecycle._promoter import Promoter
from jaxckpt.lifecycle._waiting import lost_steps_error, within_backlog
from jaxckpt.records import (
    FAILED,
    FENCED,
    PROMOTED,
    UNSTAMPED,
    CommitMarker,
    PromotionRequest,
    PromotionResult,
    new_attempt,
    read_requests,
    request_promotion,
    withdraw,
)
from jaxckpt.saving import SaveRecorder
from jaxckpt.tiers import Tier

log = logging.getLogger("jaxckpt")

LOST_WAIT_S = 2.0
"""How long a save waits for the durable root to say whether a step whose promotion
request went is durable (promoted) or lost: a lookup that takes longer (an outage) is
told at a later save instead of holding up training."""


class Promotion:
    """Promotion from the ``local`` tier to the ``durable`` one.

    Args:
      local, durable: the tiers (their epochs already taken, unless ``read_only``).
      agreement: the manager's (the primary decides what is promoted and the
        durable attempt of a multi-host step).
      promotion: ``"background"`` or ``"external"``.
      promote_policy: which locally committed steps to promote (None: all).
      preempted: whether a preemption notice arrived (for the policy).
      primary_host: the process whose promoter commits multi-host steps.
      parts_timeout_s: how long the primary's promoter waits for other hosts' parts (a pass).
      read_only: promote nothing (``wait_durable`` still watches).
      interval_s: how often the background promoter looks for an earlier run's requests.
      backlog: how many waiting steps local retention keeps (:func:`within_backlog`).
    """

    def __init__(
        self,
        local: Tier,
        durable: Tier,
        agreement: Agreement,
        *,
        promotion: str,
        promote_policy: policy.SavePolicy | None,
        preempted: Callable[[int], bool],
        primary_host: int = 0,
        parts_timeout_s: float = 300.0,
        read_only: bool = False,
        interval_s: float = 5.0,
        backlog: int | None = None,
    ) -> None:
        self.local, self.durable = local.protocol, durable.protocol
        self._tier, self.uri = durable, durable.uri
        self._agreement = agreement
        self._mode = promotion
        self._policy = promote_policy
        self._alike = notices_alike(promote_policy)
        self._preempted = preempted
        self._primary_host = primary_host
        self._parts_timeout_s = parts_timeout_s
        self._interval_s, self._backlog = interval_s, backlog
        self._process, self._processes = jax.process_index(), jax.process_count()
        self._lock = threading.Lock()
        self._last_requested: int | None = None
        self._last_request_time: float | None = None
        self._errors: dict[int, tuple[str, str]] = {}  # step -> (outcome, message)
        self._asked: set[int] = set()  # requested with a save under way
        self._awaiting: set[int] = set()  # requested, committed locally, not known durable
        self._durable_checks: dict[int, Future[bool]] = {}  # of awaited steps whose request went
        self._durable_times: dict[int, float] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._promoter: Promoter | None = None
        self._writes = not read_only
        self.on_result: Callable[[PromotionResult], None] | None = None
        """Told each result of the background promoter (the ledger)."""
        if self._writes:  # now, or once every host adopts the epoch (see tiers._durablejoin)
            durable.on_adopt(lambda _: self._restamp())

    def _restamp(self) -> None:
        """Requests of an earlier run (its epoch is fenced now), and those written before
        this run learned its epoch (unstamped), are taken over by this one."""
        epoch = self.durable.epoch
        assert epoch is not None
        for request in read_requests(self.local).values():
            if request.epoch < epoch:
                request_promotion(self.local, request.restamped(epoch, time.time()))

    def start(self, on_promoted: Callable[[], None]) -> None:
        """Starts the background promoter (``promotion="background"``); ``on_promoted``
        is told after each step becomes durable (durable retention runs then)."""
        if not self._writes or self._mode != "background":
            return

        def result(r: PromotionResult) -> None:
            self._result(r)
            if r.outcome == PROMOTED:
                on_promoted()

        promoter = Promoter(
            self.local,
            self.durable,
            epoch=self.durable.epoch,
            on_result=result,
            parts_timeout_s=self._parts_timeout_s,
        )
        self._promoter = promoter
        self._thread = threading.Thread(
            target=promoter.watch,
            args=(self._stop,),
            kwargs={"interval_s": self._interval_s, "wake": self._wake},
            name="jaxckpt-promoter",
            daemon=True,
        )
        self._thread.start()

    # -- the trainer's side ---------------------------------------------------

    def request(self, step: int) -> PromotionRequest | None:
        """Whether ``step`` is to be promoted (the primary's answer), and its request.

        The request is written with the save, before the local marker, so a
        trainer killed right after its local commit loses nothing.
        """
        if not self._tier.deferred:  # every host answers a policy of steps alike
            chosen = self._chosen(step)
            chosen = chosen if self._alike else self._agreement.agree("promote", chosen)
        else:  # the primary says when the durable epoch is taken: every host adopts it here
            chosen, learned = self._agreement.agree(
                "promote", [self._chosen(step), self._tier.learned()]
            )
            if learned is not None:
                self._tier.adopt(learned)  # requests are restamped then (on_adopt)
        if not chosen:
            return None
        epoch = UNSTAMPED if self.durable.epoch is None else self.durable.epoch
        attempt = None
        if self._processes > 1:  # every host uploads its part into this durable attempt
            attempt = self._agreement.agree("durable-attempt", new_attempt(epoch))
        with self._lock:
            self._last_requested = step
            self._last_request_time = time.monotonic()
            self._errors.pop(step, None)
            self._asked.add(step)
        return PromotionRequest(
            step=step,
            epoch=epoch,
            requested=time.time(),
            saved=time.time(),
            attempt=attempt,
            process=self._process,
            processes=self._processes,
            primary=self._primary_host,
        )

    def _chosen(self, step: int) -> bool:
        """Whether ``promote_policy`` promotes the locally committed ``step``."""
        if self._policy is None:
            return True
        with self._lock:
            last_step, last_time = self._last_requested, self._last_request_time
        ctx = policy.SaveContext(
            step=step,
            now=time.monotonic(),
            last_saved_step=last_step,
            last_save_time=last_time,
            preempted=self._preempted(step),
        )
        return bool(self._policy.should_save(ctx))

    def committed(self, marker: CommitMarker | None = None) -> None:
        """A local commit happened: the background promoter looks for requests now."""
        if marker is not None:
            with self._lock:
                if marker.step in self._asked:
                    self._asked.discard(marker.step)
                    self._awaiting.add(marker.step)
        self._wake.set()

    def check_lost(self) -> None:
        """Raises once for the steps this manager asked to promote that can no longer
        become durable: their request is gone (its local copy vanished, was damaged, or
        the local root was removed under the job) and neither they nor a newer step are.

        A few small reads while steps await promotion: a listing of the local ``promote/``
        and, per step whose request went without a receipt, its durable marker keys.

        Raises:
          SaveFailedError: such steps (named), on every host of the job.
        """
        lost = self._lost_here()
        if self._processes > 1:
            reported = self._agreement.reports("lost", lost or None).values()  # only losers
            lost = sorted({s for host in reported for s in host})
        if lost:
            raise lost_steps_error(self.local, self.uri, lost)

    def lost_error(self) -> SaveFailedError | None:
        """This host's part of :meth:`check_lost`, without meeting the others (a save
        tells it at its own checks, which every host meets anyway). A step whose request
        went without a receipt from its promoter is looked up on the durable root, waited
        for at most ``LOST_WAIT_S`` once: unanswered (an outage), it is told later."""
        lost = self._lost_here(within_s=LOST_WAIT_S)
        return lost_steps_error(self.local, self.uri, lost) if lost else None

    def _lost_here(self, *, within_s: float | None = None) -> list[int]:
        deadline = None if within_s is None else time.monotonic() + within_s
        with self._lock:
            awaiting = sorted(self._awaiting)
        lost: list[int] = []
        if awaiting:
            receipts: set[int] = set()  # steps their promoter said are durable: no lookup
            requested = read_requests(self.local, receipts=receipts)
            with self._lock:
                self._awaiting -= receipts
            for step in receipts:  # a lookup begun before its receipt came is not read
                self._durable_checks.pop(step, None)
            for step in awaiting:
                if step in requested or step in receipts or step not in self._awaiting:
                    continue  # asked for, durable, or withdrawn meanwhile (superseded, deleted)
                check = self._durable_checks.get(step)
                if check is None:  # durable, now that its request went? (exit never waits)
                    check = pools.detached("lost-check", self._durable_has, step)
                    self._durable_checks[step] = check
                    if deadline is not None:  # waited for once: a later save only looks
                        futures.wait([check], timeout=max(0.0, deadline - time.monotonic()))
                if deadline is not None and not check.done():
                    continue
                del self._durable_checks[step]
                if deadline is not None and check.exception() is not None:  # asked again later
                    log.info("step %d: durable root not read: %s", step, check.exception())
                    continue
                if not check.result():
                    lost.append(step)
                with self._lock:
                    self._awaiting.discard(step)
        return lost

    def _durable_has(self, step: int) -> bool:
        """Whether ``step`` or a newer one is durable (superseded: its request withdrawn)."""
        if step in self.durable.step_listing(step).visible():  # the usual answer: promoted
            return True
        newest = self.durable.latest()
        return newest is not None and newest.step > step

    def pending_steps(self) -> set[int]:
        """Requested steps, not known durable: a promoter withdraws a step's request once it
        is (local retention keeps them, see :meth:`kept_waiting`; it reads nothing on the
        durable root, so it goes on in an outage)."""
        return set(read_requests(self.local))

    def kept_waiting(self, full: int | None = None) -> set[int]:
        """The waiting steps local retention keeps (:func:`within_backlog`, ``full`` too)."""
        return within_backlog(self, self._backlog, full)

    def withdraw(self, step: int) -> None:
        """Never promotes ``step`` (it is being deleted)."""
        with self._lock:
            self._asked.discard(step)
            self._awaiting.discard(step)
        withdraw(self.local, step)

    def _result(self, result: PromotionResult) -> None:
        with self._lock:
            if result.outcome in (FAILED, FENCED):
                self._errors[result.step] = (result.outcome, result.error or result.outcome)
            else:
                self._errors.pop(result.step, None)
            if result.outcome == PROMOTED and result.durable_time is not None:
                self._durable_times[result.step] = result.durable_time
        if self.on_result is not None:
            self.on_result(result)

    def record_durable(self, recorder: SaveRecorder) -> None:
        """Fills in ``durable_s`` of the recorded saves that have become durable."""
        for stats in recorder.history():
            if stats.durable_s is None and stats.started:
                when = self._durable_time(stats.step)
                if when is not None:
                    recorder.durable(stats.step, when)

    def _durable_time(self, step: int) -> float | None:
        with self._lock:
            when = self._durable_times.get(step)
        marker = self.durable.read_marker(step) if when is None else None
        return marker.time if marker is not None else when

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
            marker = self.durable.latest()
            return None if marker is None else marker.step
        deadline, delay = time.monotonic() + timeout_s, 0.02
        while True:
            if self._processes == 1 and (learned := self._tier.learned()) is not None:
                self._tier.adopt(learned)  # taken since the last save: needs no save here
            if target in self.durable.visible_refs():
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
                raise _late(target, self.uri, timeout_s, error, self._tier.learned())
            time.sleep(delay)  # the promoter keeps its own pace (a failing step backs off)
            delay = min(delay * 2, 0.5)

    def close(self, timeout_s: float) -> None:
        """Background: waits up to ``timeout_s`` for requested steps, then stops (not for a
        durable root that has not answered since the open: they stay requested)."""
        self._tier.stop_joining()
        if self._thread is None:
            return
        deadline, delay = time.monotonic() + timeout_s, 0.05
        deferred = self._tier.deferred
        try:
            while (left := self.pending_steps()) and not deferred and time.monotonic() < deadline:
                with self._lock:
                    fenced = any(self._errors.get(s, ("",))[0] == FENCED for s in left)
                if fenced:
                    break  # this job may no longer write there: nothing left to wait for
                # The promoter keeps its own pace (a failing step backs off); this only looks.
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 1.0)
            try:  # drops the requests of durable steps (another host's promoter committed)
                if self._promoter is not None and not deferred:
                    self._promoter.pending()
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
            try:
                self.check_lost()  # a step lost while promotion finished: said, not raised
            except SaveFailedError as e:
                log.error("%s", e)
        finally:
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout=max(1.0, deadline - time.monotonic()) + 30.0)


def _late(
    step: int, uri: str, timeout_s: float, error: str | None, learned: int | None
) -> PromotionTimeoutError:
    why = f"step {step} did not become durable under {uri} within {timeout_s:.0f}s"
    if learned is not None:  # several processes: adopting an epoch is collective
        why += (
            f" (the durable root answered after the open: every process adopts its epoch "
            f"{learned} at the next save or close, and the step is promoted then)"
        )
    return PromotionTimeoutError(why + (f" (last error: {error})" if error else ""))


def open_promotion(
    tiers: Sequence[Tier],
    agreement: Agreement,
    options: CheckpointOptions,
    preempted: Callable[[int], bool],
) -> Promotion | NoPromotion:
    """The promotion from the first of ``tiers`` to the last (none for one tier)."""
    if len(tiers) == 1:
        return NoPromotion(tiers[0].uri)
    return Promotion(
        tiers[0],
        tiers[-1],
        agreement,
        promotion=options.promotion,
        promote_policy=options.promote_policy,
        preempted=preempted,
        primary_host=options.primary_host,
        parts_timeout_s=options.save_timeout_s,
        read_only=options.read_only,
        backlog=options.promote_backlog,
    )
