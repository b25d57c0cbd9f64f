"""Which checkpoints to keep: the retention policies of :mod:`jaxckpt.policy`.

Standard library only (no jax, numpy or tensorstore), like the save policies; import
them from :mod:`jaxckpt.policy`. Each :class:`RetentionPolicy` answers "which of these
steps does this rule keep, and why?"; :func:`decide_retention` turns that answer into a
deterministic keep/delete decision, always keeping the newest, pinned and in-use steps.

>>> keep = KeepLast(2) | KeepMilestones()
>>> steps = [StepInfo(step=s) for s in range(10, 101, 10)]
>>> decide_retention(keep, steps).delete
(30, 40, 60, 70, 80)
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

__all__ = [
    "AnyKeep",
    "ComposableRetention",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepMilestones",
    "RetentionDecision",
    "RetentionPolicy",
    "StepInfo",
    "decide_retention",
    "retention_from",
]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class StepInfo:
    """One committed step as retention policies see it.

    Attributes:
        step: The step number, >= 0.
        metrics: Metrics saved with the step (for :class:`KeepBest`), if any.
        pinned: True if a user pinned the step; :func:`decide_retention` never deletes it.
    """

    step: int
    metrics: Mapping[str, float] | None = None
    pinned: bool = False

    def __post_init__(self) -> None:
        _check_int("step", self.step, 0)


@runtime_checkable
class RetentionPolicy(Protocol):
    """Says which steps a rule keeps, mapping each to the rule's descriptions."""

    def keep(self, steps: Sequence[StepInfo]) -> dict[int, tuple[str, ...]]: ...


class ComposableRetention:
    """Mixin giving retention policies ``a | b`` (keep what either keeps)."""

    def __or__(self, other: RetentionPolicy) -> AnyKeep:
        return AnyKeep(policies=(*_keep_parts(self), *_keep_parts(other)))

    def __ror__(self, other: RetentionPolicy) -> AnyKeep:
        return AnyKeep(policies=(*_keep_parts(other), *_keep_parts(self)))


def _keep_parts(policy: object) -> tuple[RetentionPolicy, ...]:
    if isinstance(policy, AnyKeep):
        return policy.policies
    if not isinstance(policy, RetentionPolicy):
        raise TypeError(f"expected a retention policy (with keep), got {policy!r}")
    return (policy,)


def _merge(into: dict[int, tuple[str, ...]], step: int, reasons: Sequence[str]) -> None:
    old = into.get(step, ())
    into[step] = old + tuple(r for r in dict.fromkeys(reasons) if r not in old)


def _sorted_steps(steps: Sequence[StepInfo]) -> list[int]:
    return sorted(s.step for s in steps)


@dataclass(frozen=True, kw_only=True)
class AnyKeep(ComposableRetention):
    """Keeps the union of what ``policies`` keep, with their reasons merged."""

    policies: tuple[RetentionPolicy, ...]

    def __post_init__(self) -> None:
        parts = tuple(p for policy in self.policies for p in _keep_parts(policy))
        if not parts:
            raise ValueError("AnyKeep needs at least one policy")
        object.__setattr__(self, "policies", parts)

    def keep(self, steps: Sequence[StepInfo]) -> dict[int, tuple[str, ...]]:
        out: dict[int, tuple[str, ...]] = {}
        for policy in self.policies:
            for step, reasons in policy.keep(steps).items():
                _merge(out, step, reasons)
        return dict(sorted(out.items()))


@dataclass(frozen=True)
class KeepLast(ComposableRetention):
    """Keeps the ``k`` newest steps."""

    k: int

    def __post_init__(self) -> None:
        _check_int("k", self.k, 1)

    def keep(self, steps: Sequence[StepInfo]) -> dict[int, tuple[str, ...]]:
        return {s: (f"KeepLast({self.k})",) for s in _sorted_steps(steps)[-self.k :]}


@dataclass(frozen=True)
class KeepMilestones(ComposableRetention):
    """Keeps a logarithmic trail: the first step at or after each milestone.

    Milestones are ``s·10^j`` for ``s`` in ``series`` and ``j >= 0``, up to the largest
    step. With saves every 10 steps up to 20000 and the default series this keeps
    10, 20, 50, 100, …, 10000 and 20000. A step kept as a milestone stays kept as newer
    steps arrive, so at most ``len(series)`` steps per decade are ever kept.
    """

    series: Sequence[int] = (1, 2, 5)

    def __post_init__(self) -> None:
        for s in self.series:
            _check_int("every entry of series", s, 1)
        if not self.series:
            raise ValueError("series must not be empty")
        object.__setattr__(self, "series", tuple(sorted(set(self.series))))

    def keep(self, steps: Sequence[StepInfo]) -> dict[int, tuple[str, ...]]:
        ordered = _sorted_steps(steps)
        if not ordered:
            return {}
        milestones: set[int] = set()
        for s in self.series:
            m = s
            while m <= ordered[-1]:
                milestones.add(m)
                m *= 10
        out: dict[int, tuple[str, ...]] = {}
        for m in sorted(milestones):
            _merge(out, ordered[bisect.bisect_left(ordered, m)], [f"milestone {m}"])
        return out


@dataclass(frozen=True)
class KeepEvery(ComposableRetention):
    """Keeps every step that is a multiple of ``n`` (``step % n == 0``)."""

    n: int

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)

    def keep(self, steps: Sequence[StepInfo]) -> dict[int, tuple[str, ...]]:
        return {s: (f"KeepEvery({self.n})",) for s in _sorted_steps(steps) if s % self.n == 0}


@dataclass(frozen=True)
class KeepBest(ComposableRetention):
    """Keeps the ``n`` steps with the lowest (``mode="min"``) or highest ``metric``.

    Steps without that metric, or with a NaN value, are not kept by this rule. Ties go to
    the newer step.
    """

    n: int
    metric: str
    mode: Literal["min", "max"] = field(default="min", kw_only=True)

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        if not self.metric:
            raise ValueError("metric must be a non-empty string")
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}")

    def keep(self, steps: Sequence[StepInfo]) -> dict[int, tuple[str, ...]]:
        sign = 1.0 if self.mode == "min" else -1.0
        scored = [
            (sign * float(info.metrics[self.metric]), -info.step)
            for info in steps
            if info.metrics is not None
            and self.metric in info.metrics
            and not math.isnan(info.metrics[self.metric])
        ]
        reason = f"KeepBest({self.n}, {self.metric}, {self.mode})"
        return {-neg_step: (reason,) for _, neg_step in sorted(scored)[: self.n]}


# ----------------------------------------------------------------------------- decision


@dataclass(frozen=True, kw_only=True)
class RetentionDecision:
    """Outcome of :func:`decide_retention`.

    Attributes:
        keep: Each kept step, ascending, mapped to why it is kept.
        delete: Steps to delete, ascending.
    """

    keep: dict[int, tuple[str, ...]]
    delete: tuple[int, ...]

    def __post_init__(self) -> None:
        if set(self.keep) & set(self.delete):
            raise ValueError("a step cannot be both kept and deleted")


def decide_retention(
    policy: RetentionPolicy | None,
    steps: Sequence[StepInfo],
    *,
    protected: Collection[int] = (),
    bad: Collection[int] = (),
) -> RetentionDecision:
    """Decides which committed steps to keep and which to delete.

    Beyond what ``policy`` keeps, the newest step ("newest"), the newest step not in
    ``bad`` ("newest good"), pinned steps ("pinned") and ``protected`` steps ("in use",
    e.g. being restored or still being written) are always kept; with ``policy=None``
    everything is kept ("no retention policy"). Steps a policy
    names that are not in ``steps`` are ignored. The result depends only on the arguments,
    so every host computes the same decision.

    Args:
        policy: The retention rule, or None to keep everything.
        steps: The committed steps, in any order; step numbers must be unique.
        protected: Steps that must not be deleted now.
        bad: Steps marked bad (health marks): the newest step not among them is kept.

    Returns:
        The decision, with kept steps and deletions in ascending step order.

    Raises:
        ValueError: If ``steps`` lists a step twice.

    >>> d = decide_retention(KeepLast(1), [StepInfo(step=5, pinned=True), StepInfo(step=9),
    ...                                    StepInfo(step=7)], protected=[7])
    >>> d.keep
    {5: ('pinned',), 7: ('in use',), 9: ('KeepLast(1)', 'newest')}
    >>> d.delete
    ()
    >>> decide_retention(KeepLast(1), [StepInfo(step=s) for s in (1, 2, 3)], bad=[3]).keep
    {2: ('newest good',), 3: ('KeepLast(1)', 'newest')}
    """
    ordered = sorted(steps, key=lambda info: info.step)
    numbers = [info.step for info in ordered]
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"steps must be unique, got {numbers}")
    known = set(numbers)
    keep: dict[int, tuple[str, ...]] = {}
    if policy is None:
        for s in numbers:
            keep[s] = ("no retention policy",)
    else:
        for s, reasons in policy.keep(ordered).items():
            if s in known:
                _merge(keep, s, reasons)
    if numbers:
        _merge(keep, numbers[-1], ["newest"])
    bad = set(bad)
    good = [s for s in numbers if s not in bad]
    if good and bad:
        _merge(keep, good[-1], ["newest good"])
    for info in ordered:
        if info.pinned:
            _merge(keep, info.step, ["pinned"])
    for s in sorted(known.intersection(protected)):
        _merge(keep, s, ["in use"])
    return RetentionDecision(
        keep=dict(sorted(keep.items())),
        delete=tuple(s for s in numbers if s not in keep),
    )


def retention_from(
    *,
    keep_last: int | None = None,
    keep_milestones: Sequence[int] | None = None,
    keep_every: int | None = None,
) -> RetentionPolicy | None:
    """The union of the simple keep rules that are set; None when none is.

    This is what the ``jaxckpt prune`` flags and the absl flags build.

    >>> retention_from(keep_last=3, keep_milestones=(1, 2, 5)) == KeepLast(3) | KeepMilestones()
    True
    >>> retention_from() is None
    True
    """
    parts: list[RetentionPolicy] = []
    if keep_last is not None:
        parts.append(KeepLast(keep_last))
    if keep_milestones:
        parts.append(KeepMilestones(tuple(keep_milestones)))
    if keep_every is not None:
        parts.append(KeepEvery(keep_every))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else AnyKeep(policies=tuple(parts))
