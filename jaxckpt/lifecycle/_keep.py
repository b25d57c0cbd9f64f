"""Which committed steps a retention rule keeps, from their markers."""

from __future__ import annotations

from collections.abc import Iterable

from jaxckpt import policy
from jaxckpt.records import CommitMarker


def retention_decision(
    committed: dict[int, CommitMarker],
    retention: policy.RetentionPolicy | None,
    *,
    protected: Iterable[int] = (),
    bad: Iterable[int] = (),
) -> policy.RetentionDecision:
    """What ``retention`` keeps and deletes among committed steps (metrics, pins from markers;
    the newest step not in ``bad`` is always kept)."""
    infos = [
        policy.StepInfo(step=s, metrics=dict(m.metrics) or None, pinned=m.keep)
        for s, m in committed.items()
    ]
    return policy.decide_retention(retention, infos, protected=set(protected), bad=set(bad))
