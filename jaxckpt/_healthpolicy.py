"""Whether a saved step is a good place to resume: the health policies of :mod:`jaxckpt.policy`.

Standard library only, like the other policies; import them from :mod:`jaxckpt.policy`.
A :class:`HealthPolicy` judges a step from the metrics saved with it
(``save(..., metrics=...)``) and the metrics of the steps saved before it; it returns
None when the step is good, or the reason it is bad. Policies combine with ``&`` (good
when both say good) and ``|`` (good when either says good); a plain function
``(step, metrics) -> bool`` is a policy too (:func:`health_from`).

>>> judge = FiniteMetrics() & MetricSpike("loss", factor=3.0, window=4)
>>> history = [{"loss": 2.0}, {"loss": 1.9}, {"loss": 2.1}]
>>> judge.check(30, {"loss": 1.8}, history) is None
True
>>> judge.check(30, {"loss": 9.0}, history)
'loss 9 is above 3 x the median 2 of the last 3 saves'
>>> judge.check(30, {"loss": float("nan")}, history)
'metric loss is nan'
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from jaxckpt._retentionpolicy import _check_int

__all__ = [
    "AllHealthy",
    "AnyHealthy",
    "ComposableHealth",
    "FiniteMetrics",
    "HealthPolicy",
    "Healthy",
    "MetricSpike",
    "health_from",
]

Metrics = Mapping[str, float]


@runtime_checkable
class HealthPolicy(Protocol):
    """Judges a step: None when it is good, else why it is bad (one line)."""

    def check(self, step: int, metrics: Metrics, history: Sequence[Metrics]) -> str | None: ...


class ComposableHealth:
    """Mixin giving health policies ``a & b`` (good when both are) and ``a | b``."""

    def __and__(self, other: HealthPolicy | Callable[[int, Metrics], bool]) -> AllHealthy:
        return AllHealthy(policies=(*_parts(self, AllHealthy), *_parts(other, AllHealthy)))

    def __rand__(self, other: HealthPolicy | Callable[[int, Metrics], bool]) -> AllHealthy:
        return AllHealthy(policies=(*_parts(other, AllHealthy), *_parts(self, AllHealthy)))

    def __or__(self, other: HealthPolicy | Callable[[int, Metrics], bool]) -> AnyHealthy:
        return AnyHealthy(policies=(*_parts(self, AnyHealthy), *_parts(other, AnyHealthy)))

    def __ror__(self, other: HealthPolicy | Callable[[int, Metrics], bool]) -> AnyHealthy:
        return AnyHealthy(policies=(*_parts(other, AnyHealthy), *_parts(self, AnyHealthy)))


def health_from(policy: object) -> HealthPolicy:
    """``policy`` as a :class:`HealthPolicy`: a policy as it is, a function
    ``(step, metrics) -> bool`` (True: good) wrapped in :class:`Healthy`.

    Raises:
      TypeError: neither.
    """
    if isinstance(policy, HealthPolicy):
        return policy
    if callable(policy):
        return Healthy(policy)
    raise TypeError(
        f"expected a health policy (with check) or a function (step, metrics) -> bool, "
        f"got {policy!r}"
    )


def _parts(policy: object, kind: type[AllHealthy] | type[AnyHealthy]) -> tuple[HealthPolicy, ...]:
    if isinstance(policy, kind):
        return policy.policies
    return (health_from(policy),)


@dataclass(frozen=True)
class Healthy(ComposableHealth):
    """A function ``(step, metrics) -> bool`` as a policy: True means good."""

    fn: Callable[[int, Metrics], bool]

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"Healthy needs a function (step, metrics) -> bool, got {self.fn!r}")

    def check(self, step: int, metrics: Metrics, history: Sequence[Metrics]) -> str | None:
        if self.fn(step, metrics):
            return None
        return f"{getattr(self.fn, '__name__', repr(self.fn))} said bad"


@dataclass(frozen=True, kw_only=True)
class AllHealthy(ComposableHealth):
    """Good when every one of ``policies`` says good (the first bad reason). Built with ``&``."""

    policies: tuple[HealthPolicy, ...]

    def __post_init__(self) -> None:
        parts = tuple(p for policy in self.policies for p in _parts(policy, AllHealthy))
        if not parts:
            raise ValueError("AllHealthy needs at least one policy")
        object.__setattr__(self, "policies", parts)

    def check(self, step: int, metrics: Metrics, history: Sequence[Metrics]) -> str | None:
        for policy in self.policies:
            reason = policy.check(step, metrics, history)
            if reason is not None:
                return reason
        return None


@dataclass(frozen=True, kw_only=True)
class AnyHealthy(ComposableHealth):
    """Good when any of ``policies`` says good (else every reason). Built with ``|``."""

    policies: tuple[HealthPolicy, ...]

    def __post_init__(self) -> None:
        parts = tuple(p for policy in self.policies for p in _parts(policy, AnyHealthy))
        if not parts:
            raise ValueError("AnyHealthy needs at least one policy")
        object.__setattr__(self, "policies", parts)

    def check(self, step: int, metrics: Metrics, history: Sequence[Metrics]) -> str | None:
        reasons = []
        for policy in self.policies:
            reason = policy.check(step, metrics, history)
            if reason is None:
                return None
            reasons.append(reason)
        return "; ".join(reasons)


@dataclass(frozen=True)
class FiniteMetrics(ComposableHealth):
    """Bad when any metric saved with the step is NaN or infinite (the default).

    A step saved without metrics is good.

    >>> FiniteMetrics().check(7, {"loss": float("inf"), "acc": 0.5}, [])
    'metric loss is inf'
    """

    def check(self, step: int, metrics: Metrics, history: Sequence[Metrics]) -> str | None:
        for name, value in sorted(metrics.items()):
            if not math.isfinite(value):
                return f"metric {name} is {value}"
        return None


@dataclass(frozen=True)
class MetricSpike(ComposableHealth):
    """Bad when metric ``name`` is above ``factor`` times the median of its values in the
    last ``window`` saves before this one (a loss spike).

    Good while fewer than ``min(window, 3)`` earlier values exist (nothing to compare
    with), when the step has no such metric, and when the median is not above zero. A NaN
    value is not judged here (``FiniteMetrics`` is); earlier NaN values are not counted.

    >>> MetricSpike("loss", factor=2.0, window=3).check(9, {"loss": 5.0},
    ...     [{"loss": 1.0}, {"loss": 2.0}, {"loss": 3.0}, {"loss": 2.0}])
    'loss 5 is above 2 x the median 2 of the last 3 saves'
    """

    name: str
    factor: float = 3.0
    window: int = 10

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        if not (
            isinstance(self.factor, int | float)
            and not isinstance(self.factor, bool)
            and math.isfinite(self.factor)
            and self.factor > 1
        ):
            raise ValueError(f"factor must be a finite number > 1, got {self.factor!r}")
        _check_int("window", self.window, 1)

    def check(self, step: int, metrics: Metrics, history: Sequence[Metrics]) -> str | None:
        value = metrics.get(self.name)
        if value is None or math.isnan(value):
            return None
        earlier = [float(m[self.name]) for m in history if self.name in m]
        earlier = [v for v in earlier if math.isfinite(v)][-self.window :]
        if len(earlier) < min(self.window, 3):
            return None
        median = statistics.median(earlier)
        if median <= 0 or value <= self.factor * median:
            return None
        return (
            f"{self.name} {value:g} is above {self.factor:g} x the median {median:g} "
            f"of the last {len(earlier)} saves"
        )
