"""Comparing two committed steps leaf by leaf, from their manifests' checksums.

Two array leaves with the same shape, dtype, chunk grid and codecs are
*identical* when every chunk's recorded CRC32C matches and *changed* when one
does not (stored chunk = raw bytes + trailer, so equal data gives equal
records). No array data is read for that. When the chunk grids or the
encodings differ (another ``chunk_bytes``, sharding, or a zstd archive made
by ``jaxckpt cp --compress``), checksums cannot decide and the leaf is
*unknown* unless ``values=True`` compares the data. ``values=True`` also
reports the largest absolute difference of every changed leaf, reading both
leaves block by block (bounded memory).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxckpt._reader import LeafView, StepView, dotted_path
from jaxckpt._tree import SavedLeaf

__all__ = ["LeafDiff", "StepDiff", "diff_steps"]

_SLICE = 1 << 22  # elements widened at a time
IDENTICAL, CHANGED, ADDED, REMOVED, UNKNOWN = "identical", "changed", "added", "removed", "unknown"


@dataclass(frozen=True, kw_only=True)
class LeafDiff:
    """How one leaf differs between step A and step B.

    Attributes:
      path: the dotted path.
      status: ``identical``, ``changed``, ``added`` (only in B), ``removed``
        (only in A) or ``unknown`` (checksums cannot decide; pass ``values``).
      a, b: a short description of the leaf in each step (None if absent).
      detail: why it is changed or unknown.
      max_abs_diff: with ``values``, the largest ``|a - b|`` (0.0 when identical,
        None when shapes differ or a side is missing).
    """

    path: str
    status: str
    a: str | None
    b: str | None
    detail: str = ""
    max_abs_diff: float | None = None


@dataclass(frozen=True, kw_only=True)
class StepDiff:
    """The result of :func:`diff_steps`."""

    a_root: str
    a_step: int
    b_root: str
    b_step: int
    leaves: tuple[LeafDiff, ...]

    @property
    def identical(self) -> bool:
        """Every leaf is identical (an ``unknown`` leaf is not)."""
        return all(d.status == IDENTICAL for d in self.leaves)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys((IDENTICAL, CHANGED, ADDED, REMOVED, UNKNOWN), 0)
        for d in self.leaves:
            out[d.status] += 1
        return out


def _describe(leaf: SavedLeaf) -> str:
    if leaf.kind == "value":
        return f"value {leaf.value!r}"
    dims = ", ".join(map(str, leaf.shape)) + ("," if len(leaf.shape) == 1 else "")
    return f"{leaf.kind} ({dims}) {leaf.dtype}"


def _by_path(step: StepView) -> dict[str, SavedLeaf]:
    return {dotted_path(leaf): leaf for leaf in step.leaves}


def _compare_records(a: StepView, b: StepView, la: SavedLeaf, lb: SavedLeaf) -> tuple[str, str]:
    """Status and detail of two arrays with equal shape and dtype, from the manifests."""
    if math.prod(la.shape) == 0:
        return IDENTICAL, ""
    ca = {c.key: (c.size, c.crc32c) for c in a.loaded.chunks.get(la.name or "", ())}
    cb = {c.key: (c.size, c.crc32c) for c in b.loaded.chunks.get(lb.name or "", ())}
    if la.chunk_shape != lb.chunk_shape:
        return UNKNOWN, f"chunk shapes differ ({la.chunk_shape} vs {lb.chunk_shape})"
    plain_a, plain_b = a.codecs_plain(la), b.codecs_plain(lb)
    if ca == cb and plain_a == plain_b:
        return IDENTICAL, ""
    if not (plain_a and plain_b):
        return UNKNOWN, "compressed chunks: checksums of encoded bytes cannot decide"
    differing = sum(1 for k in ca.keys() | cb.keys() if ca.get(k) != cb.get(k))
    return CHANGED, f"{differing} of {max(len(ca), len(cb))} chunks differ"


def _wide(x: np.ndarray) -> np.ndarray:
    """``x`` as float64 (complex128 for complex data), for exact-enough arithmetic."""
    return x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)


def _raw(x: np.ndarray) -> np.ndarray:
    """The bytes of a contiguous 1-d array, as uint8 (a view, no copy)."""
    return np.ascontiguousarray(x).view(np.uint8)


def _max_abs_diff(va: LeafView, vb: LeafView) -> tuple[float, bool]:
    """``max |a - b|`` in float64 and whether the bytes are equal, block by block."""
    worst = 0.0
    same = True
    for region in va.block_regions():
        ra, rb = va.read_region(region).reshape(-1), vb.read_region(region).reshape(-1)
        same = same and np.array_equal(_raw(ra), _raw(rb))
        for start in range(0, ra.size, _SLICE):  # widened copies of at most 32-64 MiB
            xa, xb = _wide(ra[start : start + _SLICE]), _wide(rb[start : start + _SLICE])
            diff = np.abs(xa - xb)
            if np.isnan(diff).any():
                nan_a, nan_b = np.isnan(xa), np.isnan(xb)
                if (nan_a != nan_b).any():
                    worst = math.nan
                diff = np.where(nan_a & nan_b, 0.0, diff)
            if not math.isnan(worst) and diff.size:
                worst = max(worst, float(np.nanmax(diff)))
    return worst, same


def diff_steps(
    a: StepView,
    b: StepView,
    *,
    values: bool = False,
    on_leaf: Callable[[str], None] | None = None,
) -> StepDiff:
    """Compares two committed steps (of one root or of two).

    Args:
      a, b: steps opened with :func:`jaxckpt.open_step`.
      values: read the data of changed and unknown leaves to report
        ``max_abs_diff`` (and settle unknown ones).
      on_leaf: called with the dotted path of each leaf whose data is read.

    Returns:
      A :class:`StepDiff` with one :class:`LeafDiff` per path in either step,
      in A's tree order, then the paths only B has.
    """
    pa, pb = _by_path(a), _by_path(b)
    out: list[LeafDiff] = []
    for path in [*pa, *(p for p in pb if p not in pa)]:
        la, lb = pa.get(path), pb.get(path)
        if la is None or lb is None:
            status = ADDED if la is None else REMOVED
            out.append(
                LeafDiff(
                    path=path,
                    status=status,
                    a=None if la is None else _describe(la),
                    b=None if lb is None else _describe(lb),
                )
            )
            continue
        desc_a, desc_b = _describe(la), _describe(lb)
        if la.kind == "value" or lb.kind == "value":
            same = la.kind == lb.kind and la.value == lb.value and type(la.value) is type(lb.value)
            status = IDENTICAL if same else CHANGED
            out.append(LeafDiff(path=path, status=status, a=desc_a, b=desc_b))
            continue
        if la.kind != lb.kind or la.shape != lb.shape or la.dtype != lb.dtype:
            out.append(
                LeafDiff(
                    path=path, status=CHANGED, a=desc_a, b=desc_b, detail="shape or dtype differ"
                )
            )
            continue
        status, detail = _compare_records(a, b, la, lb)
        max_diff: float | None = 0.0 if status == IDENTICAL else None
        if values and status != IDENTICAL:
            if on_leaf is not None:
                on_leaf(path)
            max_diff, same = _max_abs_diff(LeafView(a, la), LeafView(b, lb))
            if same:
                status, detail = IDENTICAL, ""
            elif status == UNKNOWN:
                status = CHANGED
        out.append(
            LeafDiff(
                path=path,
                status=status,
                a=desc_a,
                b=desc_b,
                detail=detail,
                max_abs_diff=max_diff if values else None,
            )
        )
    return StepDiff(a_root=a.root, a_step=a.step, b_root=b.root, b_step=b.step, leaves=tuple(out))
