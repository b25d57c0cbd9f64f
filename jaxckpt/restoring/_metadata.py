"""What :meth:`jaxckpt.CheckpointManager.metadata` reports about a committed step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jaxckpt.commit import CommitProtocol
from jaxckpt.restoring._stepreader import load_step


@dataclass(frozen=True, kw_only=True)
class LeafInfo:
    """One leaf of a saved tree, as :meth:`CheckpointManager.metadata` reports it."""

    path: str
    kind: str
    shape: tuple[int, ...] | None
    dtype: str | None
    sharding: dict[str, Any] | None
    nbytes: int
    value: Any = None


@dataclass(frozen=True, kw_only=True)
class StepMetadata:
    """A committed step: when, how big, the user's metadata and the tree."""

    step: int
    commit_time: float
    nbytes: int
    metrics: dict[str, float]
    keep: bool
    user_metadata: Any
    tree: tuple[LeafInfo, ...]
    versions: Mapping[str, str] = field(default_factory=dict)
    """Versions of jaxckpt, jax, orbax-checkpoint, tensorstore, numpy that wrote the step
    (empty for steps written before they were recorded)."""


def step_metadata(protocol: CommitProtocol, step: int) -> StepMetadata:
    """Reads the records of the committed ``step`` (not its data).

    Raises:
      StepNotFoundError / UncommittedStepError: no committed ``step``.
    """
    marker = protocol.require_marker(step)
    loaded = load_step(protocol, marker)
    tree = tuple(
        LeafInfo(
            path=leaf.path_text,
            kind=leaf.kind,
            shape=leaf.shape if leaf.kind != "value" else None,
            dtype=leaf.dtype,
            sharding=leaf.sharding,
            nbytes=leaf.nbytes,
            value=leaf.value,
        )
        for leaf in loaded.leaves
    )
    return StepMetadata(
        step=step,
        commit_time=marker.time,
        nbytes=marker.nbytes,
        metrics=dict(marker.metrics),
        keep=marker.keep,
        user_metadata=loaded.user_metadata,
        tree=tree,
        versions=dict(loaded.versions),
    )
