"""Comparing two committed steps leaf by leaf, from their manifests' checksums.

Two array leaves with the same shape, dtype, chunk grid and codecs are
*identical* when every chunk's recorded CRC32C matches and *changed* when one
does not (stored chunk = raw bytes + trailer, so equal data gives equal
records). When the chunk grids or the encodings differ (another
``chunk_bytes``, sharding, or a zstd archive made by ``jaxckpt cp
--compress``), checksums cannot decide and the leaf is *unknown* unless
``values=True`` compares the data. ``values=True`` also reports the largest
absolute difference of every changed leaf.

Matching records say nothing about the stored bytes, so by default (``check``)
every array leaf of both steps is read, block by block (bounded memory), and
each chunk checked against its manifest record: a leaf whose data fails its
check is *damaged*, never identical.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxckpt.errors import CorruptCheckpointError
from jaxckpt.formats import Region
from jaxckpt.records import SavedLeaf
from jaxckpt.restoring import LeafView, StepView, dotted_path

__all__ = ["LeafDiff", "StepDiff", "diff_steps"]

_SLICE = 1 << 22  # elements widened at a time
IDENTICAL, CHANGED, ADDED, REMOVED = "identical", "changed", "added", "removed"
UNKNOWN, DAMAGED = "unknown", "damaged"
_STATUSES = (IDENTICAL, CHANGED, ADDED, REMOVED, UNKNOWN, DAMAGED)


@dataclass(frozen=True, kw_only=True)
class LeafDiff:
    """How one leaf differs between step A and step B.

    Attributes:
      path: the dotted path.
      status: ``identical``, ``changed``, ``added`` (only in B), ``removed``
        (only in A), ``unknown`` (checksums cannot decide; pass ``values``) or
        ``damaged`` (its stored data fails its check in A or B).
      a, b: a short description of the leaf in each step (None if absent).
      detail: why it is changed, unknown or damaged.
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

    @property
    def damaged(self) -> tuple[LeafDiff, ...]:
        """The leaves whose stored data failed its check, in either step."""
        return tuple(d for d in self.leaves if d.status == DAMAGED)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(_STATUSES, 0)
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


class _Worst:
    """``max |a - b|`` in float64 over blocks, and whether every byte was equal."""

    def __init__(self) -> None:
        self.value = 0.0
        self.same = True

    def add(self, ra: np.ndarray, rb: np.ndarray) -> None:
        ra, rb = ra.reshape(-1), rb.reshape(-1)
        self.same = self.same and np.array_equal(_raw(ra), _raw(rb))
        for start in range(0, ra.size, _SLICE):  # widened copies of at most 32-64 MiB
            xa, xb = _wide(ra[start : start + _SLICE]), _wide(rb[start : start + _SLICE])
            diff = np.abs(xa - xb)
            if np.isnan(diff).any():
                nan_a, nan_b = np.isnan(xa), np.isnan(xb)
                if (nan_a != nan_b).any():
                    self.value = math.nan
                diff = np.where(nan_a & nan_b, 0.0, diff)
            if not math.isnan(self.value) and diff.size:
                self.value = max(self.value, float(np.nanmax(diff)))


def _read_checked(view: LeafView, region: Region) -> tuple[np.ndarray | None, str | None]:
    """A region of a leaf, or the problem its chunks have (data failing its check)."""
    try:
        return view.read_region(region), None
    except CorruptCheckpointError as e:  # the path is the row's; keep the step and chunk
        return None, str(e).replace(f" {view.leaf.path_text}: ", " ", 1)


def _damage(view: LeafView) -> str | None:
    """What is wrong with a leaf's stored data, read block by block, or None."""
    for region in view.block_regions():
        _, problem = _read_checked(view, region)
        if problem is not None:
            return problem
    return None


def _read_pair(va: LeafView, vb: LeafView, *, values: bool) -> tuple[_Worst | None, str | None]:
    """Reads both leaves block by block: the comparison (``values``) or the first damage."""
    worst = _Worst() if values else None
    for region in va.block_regions():
        ra, problem_a = _read_checked(va, region)
        rb, problem_b = _read_checked(vb, region)
        problem = problem_a or problem_b
        if problem is not None:
            return None, problem
        if worst is not None:
            assert ra is not None and rb is not None
            worst.add(ra, rb)
    return worst, None


def _one_side(
    path: str, la: SavedLeaf | None, lb: SavedLeaf | None, a: StepView, b: StepView, check: bool
) -> LeafDiff:
    """A leaf only one step has (added or removed), its data checked with ``check``."""
    leaf, step = (lb, b) if la is None else (la, a)
    assert leaf is not None
    status = ADDED if la is None else REMOVED
    problem = _damage(LeafView(step, leaf)) if check and leaf.kind != "value" else None
    return LeafDiff(
        path=path,
        status=DAMAGED if problem else status,
        a=None if la is None else _describe(la),
        b=None if lb is None else _describe(lb),
        detail=problem or "",
    )


def diff_steps(
    a: StepView,
    b: StepView,
    *,
    values: bool = False,
    check: bool = True,
    on_leaf: Callable[[str], None] | None = None,
) -> StepDiff:
    """Compares two committed steps (of one root or of two).

    Args:
      a, b: steps opened with :func:`jaxckpt.open_step`.
      values: compare the data of changed and unknown leaves to report
        ``max_abs_diff`` (and settle unknown ones).
      check: read every array leaf of both steps and check each chunk against
        its manifest record, so a step whose stored data is damaged is never
        reported identical (its leaves are ``damaged``). False compares the
        manifests' records only and reads no data (except with ``values``).
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
            if check and on_leaf is not None:
                on_leaf(path)
            out.append(_one_side(path, la, lb, a, b, check))
            continue
        desc_a, desc_b = _describe(la), _describe(lb)
        if la.kind == "value" or lb.kind == "value":
            same = la.kind == lb.kind and la.value == lb.value and type(la.value) is type(lb.value)
            status = IDENTICAL if same else CHANGED
            problem = None
            if check and la.kind != "value":
                problem = _damage(LeafView(a, la))
            if check and lb.kind != "value":
                problem = problem or _damage(LeafView(b, lb))
            if problem is not None:
                status = DAMAGED
            out.append(LeafDiff(path=path, status=status, a=desc_a, b=desc_b, detail=problem or ""))
            continue
        if la.kind != lb.kind or la.shape != lb.shape or la.dtype != lb.dtype:
            problem = (_damage(LeafView(a, la)) or _damage(LeafView(b, lb))) if check else None
            out.append(
                LeafDiff(
                    path=path,
                    status=DAMAGED if problem else CHANGED,
                    a=desc_a,
                    b=desc_b,
                    detail=problem or "shape or dtype differ",
                )
            )
            continue
        status, detail = _compare_records(a, b, la, lb)
        compare = values and status != IDENTICAL
        max_diff: float | None = 0.0 if status == IDENTICAL else None
        if compare or check:
            if on_leaf is not None:
                on_leaf(path)
            worst, problem = _read_pair(LeafView(a, la), LeafView(b, lb), values=compare)
            if problem is not None:
                status, detail, max_diff = DAMAGED, problem, None
            elif worst is not None:
                max_diff = worst.value
                if worst.same:
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
    out.extend(_process_states(a, b))
    return StepDiff(a_root=a.root, a_step=a.step, b_root=b.root, b_step=b.step, leaves=tuple(out))


def _process_states(a: StepView, b: StepView) -> list[LeafDiff]:
    """One row per process that saved a ``process_state`` in either step (kind, size and
    CRC32C compared; a record failing its own check is damaged)."""
    from jaxckpt.records import process_state_summaries as summaries

    sa = {s.process: s for s in summaries(a.loaded.process_states, a.step)}
    sb = {s.process: s for s in summaries(b.loaded.process_states, b.step)}
    out = []
    for process in sorted(sa.keys() | sb.keys()):
        x, y = sa.get(process), sb.get(process)
        damage = next((s.damaged for s in (x, y) if s is not None and s.damaged), None)
        if damage is not None:
            status = DAMAGED
        elif x is None or y is None:
            status = ADDED if x is None else REMOVED
        else:
            status = IDENTICAL if x.same_as(y) else CHANGED
        out.append(
            LeafDiff(
                path=f"process_state[{process}]",
                status=status,
                a=None if x is None else x.describe(),
                b=None if y is None else y.describe(),
                detail=damage or "",
            )
        )
    return out
