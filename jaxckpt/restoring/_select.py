"""The restore selection: which step, from which tier, on every host together.

One method, :meth:`Selection.restore`, for a plain and a tiered manager alike:

1. *Candidates*, newest first: without a ``step``, first only the newest,
   from each tier's newest marker (``CommitProtocol.latest``: usually one GET,
   no listing); only if it fails, the tiers' listings (no marker is read):
   an own tier contributes the steps every host holds there, a shared tier
   the primary's listing; with a ``step``, only that one.
   A replicated local tier first *heals* the newest step complete in the
   union of the local tiers onto every host's own root (``Peers.heal``).
2. For each candidate, each host reads from the *nearest* tier that holds it
   (its marker, then its data); a copy that is missing or corrupt falls back
   to the next tier, with one warning. The loop stops at the first step that
   restores, so restoring the newest of many steps lists nothing.
3. With one tier every host reads the same copy: the primary's marker is
   *agreed* (every host restores the same attempt, or raises the primary's
   error) and leaves several hosts need are read once and exchanged.
4. *Failure agreement*: whether any host failed, and how, is gathered, so
   every host raises the same class or falls back to the next older step
   together (one warning per fallback).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from typing import Any

import jax

from jaxckpt import errors
from jaxckpt.commit import Agreement, brief, failure
from jaxckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StepNotFoundError,
    UncommittedStepError,
)
from jaxckpt.records import CommitMarker, MarkerRef, RestoredStates
from jaxckpt.restoring._match import PathMap
from jaxckpt.restoring._stepreader import StepRecords, tier_reader
from jaxckpt.tiers import Tier

log = logging.getLogger("jaxckpt")

_MISSING = (StepNotFoundError, UncommittedStepError)


class Selection:
    """The questions about a manager's tiers that every host answers alike: which steps
    are there (:meth:`steps`, :meth:`latest`), where one is (:meth:`holder`), and
    restoring one (:meth:`restore`).

    Args:
      tiers: nearest first.
      agreement: the manager's (its primary lists the shared tiers for everyone).
      fallback: without a step, ``restore`` tries older steps after a corrupt one.
      guard: ``guard(step)`` protects a step from retention while it is read.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        agreement: Agreement,
        fallback: bool,
        guard: Callable[[int], AbstractContextManager[Any]],
    ) -> None:
        self.tiers = tuple(tiers)
        self._agreement = agreement
        self._primary = jax.process_index() == agreement.primary
        self._fallback = fallback
        self._guard = guard
        self.corrupt: set[int] = set()
        """Steps a restore found corrupt (agreed by every host), and own-tier steps newer
        than the step restored: a save may replace them."""
        self.restored_from: tuple[int, str, int | None, int] | None = None
        """The last restore on this host: its step, the tier read, the newest step the tiers
        offered (their newest markers, or their listings after a fallback), the step's bytes."""

    def restore(
        self,
        step: int | None,
        target: Any = None,
        partial: bool = False,
        rename: PathMap | None = None,
        allow_lossy_cast: bool = False,
        *,
        skip: Collection[int] = (),
        attempting: Callable[[int], None] | None = None,
    ) -> tuple[int, Any, RestoredStates]:
        """Restores ``step`` (None: the newest restorable one) on every host; returns
        ``(step, state, its process states)``. The other arguments: as
        ``CheckpointManager.restore``; without a step, steps in ``skip`` (bad ones) are
        never candidates, and ``attempting(s)`` is told before each candidate is read.

        Raises:
          StepNotFoundError, UncommittedStepError, CorruptCheckpointError: as
            ``CheckpointManager.restore`` (the same class on every host).
        """
        tiers, agreement = self.tiers, self._agreement
        with contextlib.ExitStack() as once:  # a durable root's newest marker: read once
            if not tiers[-1].own:
                once.enter_context(tiers[-1].protocol.latest_once())
            tiers[0].peers.heal(step)  # a part lost with its node comes back from its peers
            candidates = _Candidates(tiers, agreement, step, primary=self._primary, skip=skip)
        collective = len(tiers) == 1  # every host reads the same copy
        s = candidates.first
        while True:
            if attempting is not None:
                attempting(s)
            restored, error, states = None, None, RestoredStates()
            nearest = [
                (t, refs) for t, refs in zip(tiers, candidates.held, strict=True) if s in refs
            ]
            nearest = nearest or [(t, {}) for t in tiers]  # a step asked for: the errors say why
            for n, (tier, refs) in enumerate(nearest):
                marker: CommitMarker | None = None
                try:
                    ref = refs.get(s)
                    marker = _agreed_marker(tier, s, ref, agreement) if collective else None
                    marker = marker or tier.marker(s, ref)
                    with self._guard(s):
                        records = StepRecords(tier.protocol, marker)
                        restored = tier_reader(tier).restore(
                            records,
                            target,
                            partial=partial,
                            rename=rename,
                            allow_lossy_cast=allow_lossy_cast,
                            agreement=agreement if collective else None,
                        )
                    error = None
                    states = RestoredStates(s, marker.num_processes, records.loaded.process_states)
                    log.info("restored step %d from the %s copy (%s)", s, tier.name, tier.uri)
                    newest = max((max(h) for h in candidates.held if h), default=None)
                    self.restored_from = (s, tier.name, newest, marker.nbytes)
                    break
                except Exception as e:  # agreed below: every host raises or falls back
                    if not isinstance(e, (*_MISSING, CorruptCheckpointError)):
                        error = e
                        break  # a storage error, say: no other copy is tried
                    error = _deleted_meanwhile(tier, marker, e)
                    if n + 1 < len(nearest):
                        log.warning(
                            "the %s copy of step %d is corrupt or incomplete on this host (%s); "
                            "reading the %s copy",
                            tier.name,
                            s,
                            e,
                            nearest[n + 1][0].name,
                        )
            agreed = _agreed_failure(agreement, tiers, s, error)
            if agreed is None:
                self._supersede(s)
                return s, restored, states
            if not isinstance(agreed, (*_MISSING, CorruptCheckpointError)):
                raise agreed
            corrupt = isinstance(agreed, CorruptCheckpointError)
            if corrupt:
                self.corrupt.add(s)
            older = None if corrupt and not self._fallback else candidates.after(s)
            if older is None:
                raise agreed
            if corrupt:  # a missing step (deleted since the listing) is skipped silently
                log.warning("step %d is corrupt (%s); falling back to step %d", s, agreed, older)
            s = older

    def _supersede(self, step: int) -> None:
        """This host's own-tier steps newer than the restored ``step`` are an abandoned
        future (the others lost them, or they were never everywhere): the resumed run
        saves those steps again, replacing them (one listing of the own root; no
        collective: each host retracts only what it holds)."""
        for tier in self.tiers:
            if tier.own:
                self.corrupt.update(s for s in tier.visible() if s > step)

    def steps(self, tier: str | None = None) -> list[int]:
        """Committed steps of the named tier (None: all), ascending, the primary's view
        (collective): an own tier's count when every host has them."""
        self.catch_up()
        steps: set[int] = set()
        for t in self.named(tier):
            steps |= t.everywhere(self._agreement, t.committed())
        return list(self._agreement.agree("steps", sorted(steps)))

    def latest(self) -> int | None:
        """The newest committed step of any tier, or None (collective; newest markers only)."""
        self.catch_up()
        steps: list[int] = []
        for t in self.tiers:  # a durable root that does not answer yet: only if nothing else
            n = t.newest(self._agreement, primary=self._primary, wait=not steps)
            steps += [] if n is None else [n]
        return self._agreement.agree("latest", max(steps, default=None))

    def catch_up(self, *, closing: bool = False) -> None:
        """Every host adopts the durable root's epoch if the open went on without it and it
        has answered since (collective; see ``tiers._durablejoin``)."""
        self.tiers[-1].catch_up(self._agreement, closing=closing)

    def named(self, tier: str | None) -> tuple[Tier, ...]:
        """The tiers ``tier`` names (None: all), nearest first.

        Raises:
          ValueError: there is no such tier.
        """
        chosen = tuple(t for t in self.tiers if tier in (None, t.name))
        if not chosen:
            names = ", ".join(repr(t.name) for t in self.tiers)
            raise ValueError(f"tier must be None or one of {names}, got {tier!r}")
        return chosen

    def holder(self, step: int) -> Tier:
        """The nearest tier that has ``step`` committed (else the one saves go to)."""
        return next((t for t in self.tiers if t.holds(step)), self.tiers[0])


class _Candidates:
    """The steps a restore tries, newest first, and where each host may read them.

    Without a step, first only the newest: each tier's newest valid marker
    (usually one GET per tier, see ``CommitProtocol.latest``), so restoring the
    newest of many steps lists nothing; the tiers' listings are taken only
    when that step fails (or no tier's newest marker is valid).
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        agreement: Agreement,
        step: int | None,
        *,
        primary: bool,
        skip: Collection[int] = (),
    ) -> None:
        self._args = (tiers, agreement, step)
        self._primary = primary
        self._skip = frozenset(skip)
        self._listed = False
        self.held: list[dict[int, MarkerRef | None]] = []
        self._steps: list[int] = []
        steps: list[int] = []
        if step is None:
            with contextlib.suppress(StepNotFoundError):  # no valid newest marker: list
                self.held, steps = _candidates(*self._args, primary=primary, listed=_newest)
            steps = [s for s in steps if s not in self._skip]
        if not steps:
            self._list()
            steps = self._steps
        self._steps = steps
        if not steps:  # every committed step is marked bad
            where = " or ".join(t.uri for t in tiers)
            raise StepNotFoundError(
                f"no good committed step under {where}: every one is marked bad "
                f"({brief(sorted(self._skip))}; `jaxckpt ls` says why, "
                "`jaxckpt mark ROOT STEP --good` takes a mark back)"
            )
        self.first = steps[0]

    def _list(self) -> None:
        self.held, steps = _candidates(*self._args, primary=self._primary)
        self._steps = [s for s in steps if s not in self._skip]
        self._listed = True

    def after(self, step: int) -> int | None:
        """The next older candidate after ``step`` (listing the tiers the first time)."""
        if not self._listed:
            self._list()
        return next((s for s in self._steps if s < step), None)


def _newest(tier: Tier) -> dict[int, MarkerRef]:
    """The tier's newest valid marker as a listing of one step (usually one marker GET)."""
    marker = tier.latest()
    if marker is None:
        return {}
    return {marker.step: MarkerRef(step=marker.step, epoch=marker.epoch, key=marker.key)}


def _listing(tier: Tier) -> dict[int, MarkerRef]:
    """The tier's visible steps with their marker keys (listings only)."""
    return tier.refs()


def _candidates(
    tiers: Sequence[Tier],
    agreement: Agreement,
    step: int | None,
    *,
    primary: bool,
    listed: Callable[[Tier], dict[int, MarkerRef]] = _listing,
) -> tuple[list[dict[int, MarkerRef | None]], list[int]]:
    """Per tier, the steps this host may read there (with their marker keys where
    this host listed them); and the candidates, newest first.

    From ``listed`` (listings only, by default; :func:`_newest`: each tier's newest
    marker). An own tier holds, for this host, what its own root lists; a candidate
    from it must be on every host's. A shared tier holds what the primary lists. An own
    tier whose newest markers differ between hosts is listed even from ``_newest``
    (every host sees the same empty intersection, so every host lists): a step all hosts
    hold there, such as one just healed, must never lose to an older durable step.
    """
    held: list[dict[int, MarkerRef | None]] = []
    everywhere: set[int] = set()
    for tier in tiers:  # a durable root that does not answer yet: only if nothing else
        readable, common = tier.readable(agreement, listed, primary=primary, wait=not everywhere)
        if tier.own and not common and listed is _newest:
            # The hosts' newest markers here differ (one host's newest step was healed
            # from an older one, or lost): what they all hold is in their listings.
            readable, common = tier.readable(agreement, _listing, primary=primary)
        held.append(readable)
        everywhere |= common
    where = " or ".join(t.uri for t in tiers)
    if step is None:
        if not everywhere:
            raise StepNotFoundError(f"no committed steps under {where}")
        return held, sorted(everywhere, reverse=True)
    if step not in everywhere and len(tiers) > 1:
        here = sorted(next((h for t, h in zip(tiers, held, strict=True) if t.own), {}))
        raise StepNotFoundError(
            f"step {step} is neither under {tiers[-1].uri} nor committed on the local tier "
            f"of every host (local here: {brief(here)}; durable: {brief(sorted(held[-1]))})"
        )
    return held, [step]


def _agreed_marker(
    tier: Tier, step: int, ref: MarkerRef | None, agreement: Agreement
) -> CommitMarker | None:
    """The primary's marker of ``step`` (its attempt and checksums), on every process;
    None on one process (the caller reads it). The primary's error is raised everywhere."""
    if jax.process_count() == 1:
        return None
    kind, data = None, None
    if jax.process_index() == agreement.primary:
        try:
            data = tier.marker(step, ref).to_bytes().decode()
        except CheckpointError as e:
            kind, data = type(e).__name__, str(e)
    kind, data = agreement.agree("marker", [kind, data])
    if kind is not None:  # the primary's error, of the same class, on every process
        raise getattr(errors, kind, CheckpointError)(data)
    return CommitMarker.from_bytes(data.encode(), f"commit marker of step {step}")


def _deleted_meanwhile(
    tier: Tier, marker: CommitMarker | None, error: CheckpointError
) -> CheckpointError:
    """A corrupt read of a step deleted since its marker was read is a missing step."""
    deleted = isinstance(error, CorruptCheckpointError) and marker is not None
    if not deleted or marker is None or tier.protocol.still_committed(marker):
        return error
    missing = StepNotFoundError(
        f"step {marker.step} under {tier.uri} was deleted while it was being restored"
    )
    missing.__cause__ = error
    return missing


def _agreed_failure(
    agreement: Agreement, tiers: Sequence[Tier], step: int, error: Exception | None
) -> Exception | None:
    """None when every host restored ``step``; else the error every host raises: another
    failure (a storage error, say) as it is, naming the host; else corrupt if any host
    found it corrupt (from every copy it has), else missing. Only failing hosts report."""
    report = None
    if error is not None:
        kind = "corrupt" if isinstance(error, CorruptCheckpointError) else "missing"
        kind = kind if isinstance(error, (*_MISSING, CorruptCheckpointError)) else "other"
        report = [kind, type(error).__name__, str(error)]
    try:
        reports = agreement.reports("restore-failed", report)
    except CheckpointError as e:  # a process never came: this one's own error says more
        if error is not None:
            raise error from e
        raise
    if not reports:
        return None
    where = " or ".join(t.uri for t in tiers)
    others = {p: r[1:] for p, r in reports.items() if r[0] == "other"}
    if others:
        if error is not None and (
            jax.process_count() == 1 or not isinstance(error, CheckpointError)
        ):
            return error  # one process: its own error as it is; not ours: as it is
        agreed = failure(others, f"restore of step {step} under {where}", first=jax.process_index())
        agreed.__cause__ = error
        return agreed
    kinds = {r[0] for r in reports.values()}
    if "corrupt" in kinds:
        if isinstance(error, CorruptCheckpointError):
            return error
        return CorruptCheckpointError(
            f"step {step} under {where} is corrupt in a region another process read"
        )
    if isinstance(error, _MISSING):
        return error
    return StepNotFoundError(f"step {step} under {where} could not be found by another process")
