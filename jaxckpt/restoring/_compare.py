"""Comparing states leaf by leaf for the resume pre-flight
(:mod:`jaxckpt.workflows._preflight`): bit for bit, on each process's own shards, with
the largest absolute and relative differences of numeric leaves.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from jaxckpt.records import flatten, path_str
from jaxckpt.restoring._resumereport import LeafMismatch


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _host(x: Any) -> np.ndarray:
    """The values this process holds: the whole array, or its own unique shards."""
    if _is_key(x):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        shards = sorted(
            (str(s.index), np.asarray(s.data).ravel())
            for s in x.addressable_shards
            if s.replica_id == 0
        )
        return np.concatenate([d for _, d in shards]) if shards else np.empty(0, x.dtype)
    return np.asarray(x)


def _numeric_diff(a: np.ndarray, b: np.ndarray) -> tuple[float | None, float | None]:
    """Largest ``|a - b|`` and ``|a - b| / |a|`` (inf at NaNs); Nones if not numeric."""
    wide = np.complex128 if np.dtype(a.dtype).kind == "c" else np.float64
    try:
        da, db = a.astype(wide), b.astype(wide)
    except (TypeError, ValueError):
        return None, None
    if da.size == 0:
        return 0.0, 0.0
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        diff = np.abs(da - db)
        rel = diff / np.abs(da)
    finite = np.where(np.isnan(diff), np.inf, diff)
    return float(np.max(finite)), float(np.max(np.where(np.isnan(rel), np.inf, rel)))


def _compare_arrays(step: int, path: str, a: Any, b: Any) -> LeafMismatch | None:
    if _is_key(a) != _is_key(b) or (_is_key(a) and a.dtype != b.dtype):
        return LeafMismatch(
            step=step,
            path=path,
            kind="dtype",
            count=int(np.size(a)),
            size=int(np.size(a)),
            detail=f"{a.dtype} vs {b.dtype}",
        )
    ha, hb = _host(a), _host(b)
    if ha.shape != hb.shape:
        return LeafMismatch(
            step=step,
            path=path,
            kind="shape",
            count=ha.size,
            size=ha.size,
            detail=f"{ha.shape} vs {hb.shape}",
        )
    if ha.dtype != hb.dtype:
        return LeafMismatch(
            step=step,
            path=path,
            kind="dtype",
            count=ha.size,
            size=ha.size,
            max_abs_diff=_numeric_diff(ha, hb)[0],
            detail=f"{ha.dtype} vs {hb.dtype}",
        )
    if ha.dtype.itemsize == 0 or ha.size == 0:
        return None
    bytes_a = np.ascontiguousarray(ha).reshape(-1).view(np.uint8).reshape(ha.size, -1)
    bytes_b = np.ascontiguousarray(hb).reshape(-1).view(np.uint8).reshape(hb.size, -1)
    differ = np.any(bytes_a != bytes_b, axis=1)
    count = int(differ.sum())
    if not count:
        return None
    abs_diff, rel_diff = _numeric_diff(ha.reshape(-1)[differ], hb.reshape(-1)[differ])
    return LeafMismatch(
        step=step,
        path=path,
        kind="value",
        count=count,
        size=ha.size,
        max_abs_diff=abs_diff,
        max_rel_diff=rel_diff,
        detail=str(ha.dtype),
    )


def _same_value(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def _compare_leaf(step: int, path: str, a: Any, b: Any) -> LeafMismatch | None:
    if _is_array(a) and _is_array(b):
        return _compare_arrays(step, path, a, b)
    if _is_array(a) or _is_array(b):
        detail = f"{type(a).__name__} vs {type(b).__name__}"
        return LeafMismatch(step=step, path=path, kind="type", count=1, size=1, detail=detail)
    if _same_value(a, b):
        return None
    numeric = isinstance(a, int | float) and isinstance(b, int | float)
    return LeafMismatch(
        step=step,
        path=path,
        kind="value" if type(a) is type(b) else "type",
        count=1,
        size=1,
        max_abs_diff=abs(float(a) - float(b)) if numeric else None,
        detail=f"{a!r} vs {b!r}",
    )


def tree_structure(tree: Any) -> Any:
    """The treedef of ``tree``, with None as a leaf."""
    return jax.tree.structure(tree, is_leaf=lambda x: x is None)


def paths_of(tree: Any, prefix: str) -> dict[str, Any]:
    """The leaves of ``tree`` by path text, each path after ``prefix``."""
    flat, _ = flatten(tree)
    return {prefix + (path_str(p) if p or not prefix else ""): leaf for p, leaf in flat}


def compare_trees(step: int, reference: Any, other: Any, *, prefix: str = "") -> list[LeafMismatch]:
    """Every leaf of ``other`` that differs from ``reference`` (bits, dtype, shape, type)."""
    ref, got = paths_of(reference, prefix), paths_of(other, prefix)
    out: list[LeafMismatch] = []
    for path, a in ref.items():
        if path not in got:
            size = int(np.size(a)) if _is_array(a) else 1
            out.append(LeafMismatch(step=step, path=path, kind="lost", count=size, size=size))
            continue
        mismatch = _compare_leaf(step, path, a, got[path])
        if mismatch is not None:
            out.append(mismatch)
    for path in got.keys() - ref.keys():
        out.append(LeafMismatch(step=step, path=path, kind="extra", count=0, size=0))
    if not out and tree_structure(reference) != tree_structure(other):
        detail = f"{tree_structure(reference)} vs {tree_structure(other)}"
        out.append(
            LeafMismatch(
                step=step,
                path=prefix or "<root>",
                kind="structure",
                count=0,
                size=0,
                detail=detail[:300],
            )
        )
    return out


def restore_notes(original: Any, restored: Any) -> list[str]:
    """What a restore changed beyond the values: weak types and shardings, by path."""
    notes = []
    ref, got = paths_of(original, ""), paths_of(restored, "")
    for path, a in ref.items():
        b = got.get(path)
        if not isinstance(a, jax.Array) or not isinstance(b, jax.Array):
            continue
        if getattr(a, "weak_type", False) != getattr(b, "weak_type", False):
            notes.append(
                f"{path}: weakly typed when saved, not when restored (type "
                "promotion in step_fn may differ; make it a strongly typed array)"
            )
        if not a.sharding.is_equivalent_to(b.sharding, a.ndim):
            notes.append(f"{path}: sharding {a.sharding} saved, {b.sharding} restored")
    return notes
