"""Statistics of leaves across committed steps: the training trajectory over milestones.

For each kept step and each selected array leaf: the L2 norm, mean, standard
deviation and largest absolute value, computed in float64 while the leaf is
read block by block (bounded memory, every chunk checked). With more than one
leaf selected, an ``(all selected)`` row treats them as one vector (e.g. the
global parameter norm).
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxckpt.restoring import LeafView, StepView, open_step

__all__ = ["LeafStats", "StepStats", "leaf_stats", "trajectory"]

ALL = "(all selected)"
_SLICE = 1 << 22  # elements widened to float64 at a time


@dataclass(frozen=True, kw_only=True)
class LeafStats:
    """Summary statistics of one leaf (or of all selected leaves) at one step."""

    path: str
    count: int
    norm: float
    mean: float
    std: float
    max_abs: float


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """Every selected leaf's statistics at one step, plus the combined row."""

    step: int
    leaves: tuple[LeafStats, ...]
    combined: LeafStats | None


@dataclass
class _Acc:
    """Count, mean and M2 merged by Chan's formula (stable), sum of squares, max-abs."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    squares: float = 0.0
    max_abs: float = 0.0

    def add(self, block: np.ndarray) -> None:
        flat = block.reshape(-1)
        for start in range(0, flat.size, _SLICE):  # float64 copies of at most 32 MiB
            self._add(flat[start : start + _SLICE].astype(np.float64))

    def _add(self, x: np.ndarray) -> None:
        if not x.size:
            return
        mean = float(x.mean())
        centred = x - mean
        part = _Acc(
            count=x.size,
            mean=mean,
            m2=float(np.dot(centred, centred)),
            squares=float(np.dot(x, x)),
            max_abs=float(np.abs(x).max()),
        )
        self.merge(part)

    def merge(self, other: _Acc) -> None:
        if not other.count:
            return
        n = self.count + other.count
        delta = other.mean - self.mean
        self.m2 += other.m2 + delta * delta * self.count * other.count / n
        self.mean += delta * other.count / n
        self.count = n
        self.squares += other.squares
        self.max_abs = max(self.max_abs, other.max_abs)

    def result(self, path: str) -> LeafStats:
        n = self.count
        return LeafStats(
            path=path,
            count=n,
            norm=math.sqrt(self.squares),
            mean=self.mean if n else math.nan,
            std=math.sqrt(self.m2 / n) if n else math.nan,
            max_abs=self.max_abs if n else math.nan,
        )


def _accumulate(view: LeafView) -> _Acc:
    acc = _Acc()
    if view.dtype.kind == "c":
        for block in view.blocks():
            acc.add(np.abs(block))
    else:
        for block in view.blocks():
            acc.add(block)
    return acc


def leaf_stats(view: LeafView) -> LeafStats:
    """Norm, mean, std and max-abs of one leaf, read block by block.

    >>> import tempfile, numpy as np, jaxckpt
    >>> root = tempfile.mkdtemp()
    >>> with jaxckpt.CheckpointManager(root) as mgr:
    ...     mgr.save(1, {"w": np.array([3.0, -4.0])})
    True
    >>> s = leaf_stats(jaxckpt.open_step(root)["w"])
    >>> s.norm, s.mean, s.std, s.max_abs
    (5.0, -0.5, 3.5, 4.0)
    """
    return _accumulate(view).result(view.path)


def select(step: StepView, patterns: Sequence[str] | None) -> list[LeafView]:
    """Array leaves (not PRNG keys) whose dotted path matches any glob in ``patterns``."""
    return [
        v
        for v in step.arrays()
        if v.leaf.kind == "array"
        and (not patterns or any(fnmatch.fnmatchcase(v.path, p) for p in patterns))
    ]


def trajectory(
    root: str | os.PathLike[str],
    *,
    leaves: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
    on_step: Callable[[int], None] | None = None,
    **storage_options: Any,
) -> list[StepStats]:
    """Statistics of the selected leaves at every committed step (or ``steps``).

    Args:
      root: the checkpoint root.
      leaves: glob patterns on dotted paths (``params.*.kernel``); None selects
        every array leaf.
      steps: the steps to read; None reads every committed step.
      on_step: called with each step before it is read.

    Returns:
      One :class:`StepStats` per step, ascending.
    """
    from jaxckpt.commit import CommitReader
    from jaxckpt.storage import open_storage

    if steps is None:
        protocol = CommitReader(open_storage(root, **storage_options))
        protocol.check_root()
        steps = sorted(protocol.committed())
    out = []
    for step in sorted(steps):
        if on_step is not None:
            on_step(step)
        view = open_step(root, step, **storage_options)
        chosen = select(view, leaves)
        accs = [(v.path, _accumulate(v)) for v in chosen]
        combined = None
        if len(accs) > 1:
            total = _Acc()
            for _, acc in accs:
                total.merge(acc)
            combined = total.result(ALL)
        out.append(
            StepStats(
                step=step,
                leaves=tuple(acc.result(path) for path, acc in accs),
                combined=combined,
            )
        )
    return out


def plot(stats: Sequence[StepStats], path: str, *, title: str = "", max_lines: int = 8) -> None:
    """Draws norm, mean, std and max-abs against the step into a PNG (matplotlib).

    One line per leaf while there are at most ``max_lines`` leaves, else only
    the combined line. The step axis is logarithmic when the steps span more
    than two decades (milestones 1, 2, 5, 10, ...).

    Raises:
      ImportError: matplotlib is not installed (``pip install jaxckpt[plot]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s.step for s in stats]
    series: dict[str, list[LeafStats | None]] = {}
    names = [x.path for s in stats for x in s.leaves]
    paths = list(dict.fromkeys(names))
    if len(paths) > max_lines and all(s.combined is not None for s in stats):
        paths = []
    for p in paths:
        series[p] = [next((x for x in s.leaves if x.path == p), None) for s in stats]
    if any(s.combined is not None for s in stats):
        series[ALL] = [s.combined for s in stats]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for ax, field in zip(axes.flat, ("norm", "mean", "std", "max_abs"), strict=True):
        for name, values in series.items():
            ys = [getattr(v, field) if v is not None else math.nan for v in values]
            ax.plot(xs, ys, marker="o", markersize=3, label=name)
        ax.set_title(field.replace("_", "-"))
        ax.grid(True, alpha=0.3)
        if xs and min(xs) > 0 and max(xs) / min(xs) > 100:
            ax.set_xscale("log")
    for ax in axes[1]:
        ax.set_xlabel("step")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, max(1, len(labels))), fontsize=8)
    fig.suptitle(title or "leaf statistics across steps")
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)
