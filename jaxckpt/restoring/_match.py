"""A restore target matched against the saved tree: which saved leaf each target leaf
restores (under ``rename=``, ``partial=``), with a diagnosing error when they do not
match (:mod:`jaxckpt.restoring._mismatch`), and which dtype conversions are lossy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxckpt.errors import TreeMismatchError
from jaxckpt.records import SavedLeaf
from jaxckpt.restoring._mismatch import SHOWN, Mismatch, mismatch_message

__all__ = ["PathMap", "check_casts", "lossy_cast", "match_target", "rename_path"]

#: How saved tree paths map to a restore target's paths: ``{saved prefix: new prefix}``
#: or a function from a saved path to its new path (``None`` drops the leaf).
PathMap = Mapping[str, str] | Callable[[str], str | None]


def rename_path(path: str, rename: PathMap) -> str | None:
    """``path`` (a saved tree path, as ``jax.tree_util.keystr`` writes it) under ``rename``.

    A mapping renames the longest prefix that ends at a path component boundary; a
    path no prefix matches keeps its name. A callable gets the whole path.

    >>> m = {"['params']['encoder']": "['params']['enc']", "['ema']": "['params_ema']"}
    >>> rename_path("['params']['encoder']['kernel']", m)
    "['params']['enc']['kernel']"
    >>> rename_path("['params']['encoder_2']['kernel']", m)  # not a component boundary
    "['params']['encoder_2']['kernel']"
    >>> rename_path("['opt'][0].mu", lambda p: None if p.startswith("['opt']") else p) is None
    True
    """
    if callable(rename):
        return rename(path)
    for prefix in sorted(rename, key=len, reverse=True):
        rest = path[len(prefix) :]
        if path.startswith(prefix) and (not rest or rest[0] in "[."):
            return rename[prefix] + rest
    return path


_PYTHON_SCALARS = (bool, int, float, complex, str, bytes)
"""Target leaves that can only receive a saved Python value, never an array."""


def match_target(
    saved: Sequence[SavedLeaf],
    target_paths: Sequence[str],
    target_leaves: Sequence[Any],
    *,
    partial: bool = False,
    rename: PathMap | None = None,
) -> list[SavedLeaf]:
    """The saved leaf for every target leaf, in target order.

    Args:
      saved: the leaves of the saved tree.
      target_paths: the target's leaf paths (``keystr`` text), in order.
      target_leaves: the target's leaves, in the same order.
      partial: the target may be a subset of the saved tree: saved leaves it lacks
        are not an error (and are never read).
      rename: maps saved paths to target paths first (see :func:`rename_path`).

    Raises:
      TreeMismatchError: naming every missing, extra or mismatched path, and any
        target path two saved leaves were renamed to.
    """
    by_path: dict[str, SavedLeaf] = {}
    duplicates: list[str] = []
    missing: list[tuple[str, str]] = []
    shapes: list[str] = []
    for saved_leaf in saved:
        old = saved_leaf.path_text
        new = old if rename is None else rename_path(old, rename)
        if new is None:
            continue
        if new in by_path:
            duplicates.append(f"two saved paths map to {new}: {by_path[new].path_text} and {old}")
        by_path[new] = saved_leaf
    matched: list[SavedLeaf] = []
    for path, target in zip(target_paths, target_leaves, strict=True):
        leaf = by_path.get(path)
        if leaf is None:
            missing.append((path, _describe(target)))
            continue
        matched.append(leaf)
        if leaf.kind != "value" and isinstance(target, _PYTHON_SCALARS):
            shapes.append(  # no shape or dtype to restore into: never a silent numpy array
                f"type mismatch at {path}: saved {leaf.shape} {leaf.dtype} array, target a "
                f"Python {type(target).__name__} (pass an array or a jax.ShapeDtypeStruct)"
            )
            continue
        if leaf.kind == "value" or not hasattr(target, "shape"):
            continue
        shape = tuple(target.shape)
        if leaf.kind == "key" and jax.dtypes.issubdtype(target.dtype, jax.dtypes.prng_key):
            shape = jax.eval_shape(jax.random.key_data, target).shape
        if shape != leaf.shape:
            saved_as = "" if leaf.path_text == path else f" (saved as {leaf.path_text})"
            shapes.append(
                f"shape mismatch at {path}{saved_as}: saved {leaf.shape} {leaf.dtype}, "
                f"target {_describe(target)}{key_data_hint(leaf, target)}"
            )
    extra = [] if partial else sorted(set(by_path) - set(target_paths))
    if missing or shapes or duplicates or extra:
        mismatch = Mismatch(
            missing=missing,
            extra=[(p, _describe_saved(by_path[p])) for p in extra],
            shapes=shapes,
            duplicates=duplicates,
            matched=len(matched),
            targets=len(target_paths),
            partial=partial,
            renamed=rename is not None,
            unused=sorted(set(by_path) - set(target_paths)) if partial else (),
        )
        raise TreeMismatchError(mismatch_message(mismatch))
    return matched


def lossy_cast(saved: np.dtype, target: np.dtype) -> bool:
    """Whether converting ``saved`` to ``target`` can change a value.

    Decided by the pair alone. An integer (or bool) becomes a float exactly when
    the float's significand and range hold every value of the integer type
    (int8/uint8 -> float16 or bfloat16, int16/uint16 -> float32, int32/uint32 ->
    float64; but int32 -> float32, int64 -> float64 and int8 -> float8 are
    lossy); every other pair follows numpy's ``can_cast(..., "safe")`` (with
    ml_dtypes' rules for bfloat16 and float8): widening within a kind
    (float16 -> float32, bfloat16 -> float32, int8 -> int32), unsigned to a
    wider signed int and bool to anything are lossless; narrowing, float ->
    int and float16 <-> bfloat16 are lossy.

    >>> lossy_cast(np.dtype("float32"), np.dtype("float16"))
    True
    >>> f32, f64 = np.dtype("float32"), np.dtype("float64")
    >>> lossy_cast(np.dtype("int16"), f32), lossy_cast(np.dtype("int64"), f64)
    (False, True)
    """
    if saved == target or saved == np.bool_:
        return False
    if jnp.issubdtype(saved, jnp.integer) and jnp.issubdtype(target, jnp.inexact):
        import ml_dtypes

        ints, floats = ml_dtypes.iinfo(saved), ml_dtypes.finfo(target)
        largest = max(-int(ints.min), int(ints.max))
        return largest > min(2 ** (floats.nmant + 1), float(floats.max))
    return not np.can_cast(saved, target, "safe")


def check_casts(
    leaves: Sequence[SavedLeaf], target_paths: Sequence[str], targets: Sequence[Any]
) -> None:
    """Refuses lossy dtype conversions from saved array leaves to their targets.

    Args:
      leaves: the saved leaf of every target leaf, in target order (``match_target``).
      target_paths: the target's leaf paths, in the same order.
      targets: the target's leaves.

    Raises:
      TreeMismatchError: naming every path whose conversion is lossy, with both dtypes.
    """
    problems = []
    for leaf, path, target in zip(leaves, target_paths, targets, strict=True):
        dtype = getattr(target, "dtype", None)
        if leaf.kind != "array" or dtype is None:
            continue
        if lossy_cast(leaf.numpy_dtype, np.dtype(dtype)):
            problems.append(f"  {path}: saved {leaf.dtype}, target {np.dtype(dtype).name}")
    if problems:
        more = [f"  ... and {len(problems) - SHOWN} more"] if len(problems) > SHOWN else []
        raise TreeMismatchError(
            f"restore target converts {len(problems)} saved arrays to dtypes that cannot hold "
            "every value (pass allow_lossy_cast=True to convert anyway):\n"
            + "\n".join(problems[:SHOWN] + more)
        )


def key_data_hint(leaf: SavedLeaf, target: Any) -> str:
    """A typed-key target for a leaf saved as a key's raw data (an Orbax import without
    a target keeps ``jax.random.key_data``): how to get the key back."""
    dtype = getattr(target, "dtype", None)
    if dtype is None or not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return ""
    if leaf.kind != "array" or leaf.dtype != "uint32":
        return ""
    if tuple(leaf.shape) != jax.eval_shape(jax.random.key_data, target).shape:
        return ""
    return (
        " (saved as the key's raw data: restore it as a uint32 array, e.g. with partial "
        "restores or rename=lambda p: None for it, and wrap it with "
        "jax.random.wrap_key_data; or import with target= so it is saved as a key)"
    )


def _describe(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{tuple(x.shape)} {x.dtype}"
    return type(x).__name__


def _describe_saved(leaf: SavedLeaf) -> str:
    if leaf.kind == "value":
        return f"value {leaf.value!r}"
    return f"{leaf.shape} {leaf.dtype}"
