"""When to save, which checkpoints to keep and which are good: pure policies.

This module imports only the standard library (no jax, numpy or tensorstore), so the CLI
and any host can evaluate policies cheaply. Every policy is a small frozen dataclass behind
one of two Protocols:

* :class:`SavePolicy` answers "save at this step?" from a :class:`SaveContext` that the
  checkpoint manager fills in.
* :class:`RetentionPolicy` answers "which of these steps does this rule keep, and why?".
  :func:`decide_retention` turns that answer into a deterministic keep/delete decision,
  always keeping the newest, pinned and in-use steps.

Policies of one kind combine with ``|``:

>>> save = EveryNSteps(1000) | OnPreemption()
>>> save.should_save(SaveContext(step=1500, now=0.0, last_saved_step=1000,
...                              last_save_time=None, preempted=True))
True
>>> keep = KeepLast(2) | KeepMilestones()
>>> steps = [StepInfo(step=s) for s in range(10, 101, 10)]
>>> decide_retention(keep, steps).delete
(30, 40, 60, 70, 80)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from jaxckpt._healthpolicy import AllHealthy as AllHealthy
from jaxckpt._healthpolicy import AnyHealthy as AnyHealthy
from jaxckpt._healthpolicy import ComposableHealth as ComposableHealth
from jaxckpt._healthpolicy import FiniteMetrics as FiniteMetrics
from jaxckpt._healthpolicy import HealthPolicy as HealthPolicy
from jaxckpt._healthpolicy import Healthy as Healthy
from jaxckpt._healthpolicy import MetricSpike as MetricSpike
from jaxckpt._healthpolicy import health_from as health_from
from jaxckpt._retentionpolicy import AnyKeep as AnyKeep
from jaxckpt._retentionpolicy import ComposableRetention as ComposableRetention
from jaxckpt._retentionpolicy import KeepBest as KeepBest
from jaxckpt._retentionpolicy import KeepEvery as KeepEvery
from jaxckpt._retentionpolicy import KeepLast as KeepLast
from jaxckpt._retentionpolicy import KeepMilestones as KeepMilestones
from jaxckpt._retentionpolicy import RetentionDecision as RetentionDecision
from jaxckpt._retentionpolicy import RetentionPolicy as RetentionPolicy
from jaxckpt._retentionpolicy import StepInfo as StepInfo
from jaxckpt._retentionpolicy import _check_int
from jaxckpt._retentionpolicy import decide_retention as decide_retention
from jaxckpt._retentionpolicy import retention_from as retention_from

__all__ = [
    "Adaptive",
    "AllHealthy",
    "AnyHealthy",
    "AnyKeep",
    "AnySave",
    "AtSteps",
    "ComposableHealth",
    "ComposableRetention",
    "ComposableSave",
    "EveryNSeconds",
    "EveryNSteps",
    "FiniteMetrics",
    "HealthPolicy",
    "Healthy",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepMilestones",
    "MetricSpike",
    "OnPreemption",
    "RetentionDecision",
    "RetentionPolicy",
    "SaveContext",
    "SavePolicy",
    "StepInfo",
    "daly_interval",
    "decide_retention",
    "health_from",
    "retention_from",
]


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


# --------------------------------------------------------------------------- save policies


@dataclass(frozen=True, kw_only=True)
class SaveContext:
    """What a save policy may look at. The checkpoint manager builds one per step.

    Attributes:
        step: The training step about to be (or not be) saved.
        now: Current time in seconds on any monotonic clock; only differences matter.
        last_saved_step: Step of the newest committed save, or None if there is none.
        last_save_time: ``now``-clock time of the newest save, or None if this run has not
            saved yet.
        preempted: True once the manager has received a preemption notice (e.g. SIGTERM).
        blocking_seconds: Measured blocking time of recent saves, oldest first.
    """

    step: int
    now: float
    last_saved_step: int | None
    last_save_time: float | None
    preempted: bool = False
    blocking_seconds: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        _check_int("step", self.step, 0)
        if self.last_saved_step is not None:
            _check_int("last_saved_step", self.last_saved_step, 0)
        blocking = tuple(float(b) for b in self.blocking_seconds)
        if any(not (math.isfinite(b) and b >= 0) for b in blocking):
            raise ValueError(f"blocking_seconds must be finite and >= 0, got {blocking}")
        object.__setattr__(self, "blocking_seconds", blocking)


@runtime_checkable
class SavePolicy(Protocol):
    """Decides whether the manager should save at ``ctx.step``."""

    def should_save(self, ctx: SaveContext) -> bool: ...


class ComposableSave:
    """Mixin giving save policies ``a | b`` (save when either says so)."""

    def __or__(self, other: SavePolicy) -> AnySave:
        return AnySave(policies=(*_save_parts(self), *_save_parts(other)))

    def __ror__(self, other: SavePolicy) -> AnySave:
        return AnySave(policies=(*_save_parts(other), *_save_parts(self)))


def _save_parts(policy: object) -> tuple[SavePolicy, ...]:
    if isinstance(policy, AnySave):
        return policy.policies
    if not isinstance(policy, SavePolicy):
        raise TypeError(f"expected a save policy (with should_save), got {policy!r}")
    return (policy,)


@dataclass(frozen=True, kw_only=True)
class AnySave(ComposableSave):
    """Saves when any of ``policies`` says so. Usually built with ``a | b``."""

    policies: tuple[SavePolicy, ...]

    def __post_init__(self) -> None:
        parts = tuple(p for policy in self.policies for p in _save_parts(policy))
        if not parts:
            raise ValueError("AnySave needs at least one policy")
        object.__setattr__(self, "policies", parts)

    def should_save(self, ctx: SaveContext) -> bool:
        return any(p.should_save(ctx) for p in self.policies)


@dataclass(frozen=True)
class EveryNSteps(ComposableSave):
    """Saves at every step that is a multiple of ``n`` (``step % n == 0``), including step 0.

    The schedule is aligned to multiples of ``n``, not counted from the last save: a run
    resumed at step 1234 with ``n=1000`` next saves at 2000. A step that is already the
    newest saved step is not saved again.

    >>> EveryNSteps(100).should_save(SaveContext(step=300, now=0.0, last_saved_step=200,
    ...                                          last_save_time=0.0))
    True
    """

    n: int

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.n == 0 and ctx.step != ctx.last_saved_step


@dataclass(frozen=True)
class EveryNSeconds(ComposableSave):
    """Saves when at least ``seconds`` have passed since the last save of this run.

    Saves at the first call when this run has not saved yet (``last_save_time is None``).
    """

    seconds: float

    def __post_init__(self) -> None:
        _check_positive("seconds", self.seconds)

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.last_save_time is None or ctx.now - ctx.last_save_time >= self.seconds


@dataclass(frozen=True)
class AtSteps(ComposableSave):
    """Saves exactly at the given steps (unless that step is already saved)."""

    steps: Collection[int]

    def __post_init__(self) -> None:
        for s in self.steps:
            _check_int("every step in AtSteps", s, 0)
        object.__setattr__(self, "steps", tuple(sorted(set(self.steps))))

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step in self.steps and ctx.step != ctx.last_saved_step


@dataclass(frozen=True)
class OnPreemption(ComposableSave):
    """Saves once the manager has set ``ctx.preempted`` (it handles SIGTERM, not this)."""

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.preempted


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    """Daly's optimal compute time between checkpoints, in seconds.

    ``τ = √(2δM)·[1 + ⅓·√(δ/2M) + ⅑·(δ/2M)] − δ`` for ``δ < 2M``, else ``τ = M``
    (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
    dumps", FGCS 2006).

    Args:
        delta_s: Time one checkpoint costs the run (its blocking time), seconds, >= 0.
        mtbf_s: Mean time between failures of the whole job, seconds, > 0.

    Returns:
        The interval in seconds.

    >>> round(daly_interval(2.0, 100.0), 4)  # √400·(1 + 1/30 + 1/900) − 2 = 841/45
    18.6889
    """
    if not (math.isfinite(delta_s) and delta_s >= 0):
        raise ValueError(f"delta_s must be finite and >= 0, got {delta_s!r}")
    _check_positive("mtbf_s", mtbf_s)
    if delta_s >= 2 * mtbf_s:
        return mtbf_s
    x = delta_s / (2 * mtbf_s)
    return math.sqrt(2 * delta_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - delta_s


@dataclass(frozen=True)
class Adaptive(ComposableSave):
    """Saves at Daly's optimal interval, never spending more than ``max_overhead`` blocked.

    δ is the **median** of ``ctx.blocking_seconds`` (robust to a slow first save that
    includes compilation). The interval in seconds is
    ``max(daly_interval(δ, M), δ / max_overhead)`` with ``M = mtbf_hours * 3600``, measured
    since ``ctx.last_save_time``. While no measurement exists (``blocking_seconds`` empty)
    or this run has not saved yet, it saves, so that a measurement exists.

    >>> round(Adaptive(24.0).interval_seconds(50.0))  # Daly's τ; the 2 % cap is 2500 s
    2906
    >>> Adaptive(1.0).interval_seconds(50.0)  # Daly's τ is 567 s; the cap wins
    2500.0
    >>> policy = Adaptive(24.0)
    >>> policy.should_save(SaveContext(step=7, now=1000.0, last_saved_step=5,
    ...                                last_save_time=0.0, blocking_seconds=(50.0,)))
    False
    """

    mtbf_hours: float
    max_overhead: float = field(default=0.02, kw_only=True)

    def __post_init__(self) -> None:
        _check_positive("mtbf_hours", self.mtbf_hours)
        _check_positive("max_overhead", self.max_overhead)
        if self.max_overhead > 1:
            raise ValueError(f"max_overhead is a fraction in (0, 1], got {self.max_overhead}")

    def interval_seconds(self, delta_s: float) -> float:
        """Seconds between saves for a blocking time of ``delta_s`` seconds per save."""
        return max(daly_interval(delta_s, self.mtbf_hours * 3600), delta_s / self.max_overhead)

    def should_save(self, ctx: SaveContext) -> bool:
        if not ctx.blocking_seconds or ctx.last_save_time is None:
            return True
        delta = statistics.median(ctx.blocking_seconds)
        return ctx.now - ctx.last_save_time >= self.interval_seconds(delta)
