"""Pytree bookkeeping: flatten a state into described leaves and rebuild it.

A saved tree is a list of leaves, each with its path (a list of typed path
components), its kind (``array``, ``key`` for PRNG key arrays, or ``value``
for JSON-serialisable Python values) and, for arrays, the zarr array name,
shape, dtype, chunk shape and a description of the sharding.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxckpt.errors import UnsupportedLeafError
from jaxckpt.records._step import path_text
from jaxckpt.records._tree import VALUE_TYPES as VALUE_TYPES
from jaxckpt.records._tree import SavedLeaf as SavedLeaf
from jaxckpt.records._tree import np_dtype as np_dtype


def _is_leaf(x: Any) -> bool:
    return x is None


def flatten(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """``(path, leaf)`` pairs and the treedef; ``None`` counts as a leaf."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)


def path_str(path: Sequence[Any]) -> str:
    """A readable path such as ``params['dense']['kernel']``."""
    return jax.tree_util.keystr(tuple(path)) or "<root>"


def encode_path(path: Sequence[Any]) -> list[list[Any]]:
    """JSON form of a key path: ``[[kind, key], ...]``."""
    out: list[list[Any]] = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            key = k.key
            if not isinstance(key, str | int):
                key = str(key)
            out.append(["d", key])
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(["s", k.idx])
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(["a", k.name])
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(["f", k.key])
        else:
            out.append(["d", str(k)])
    return out


_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
MAX_NAME_CHARS = 200
"""The longest zarr array name (a directory name on a local disk: at most 255 bytes there)."""
_LONG_NAME = 180  # longer names are cut and keep a digest of the whole (room for "~<n>")
_RESERVED_NAMES = frozenset({"zarr.json"})  # beside the arrays: the group's metadata


def array_names(paths: Sequence[list[list[Any]]]) -> list[str]:
    """Unique zarr array names for the given encoded paths, valid on every backend.

    A name is one path segment of ``[A-Za-z0-9_.-]`` (other characters become
    ``_``; no leading or trailing dot), at most :data:`MAX_NAME_CHARS` long. A
    name a tree uses twice, or one the layout reserves (``zarr.json``), gets
    ``~<n>``; a name over 180 characters keeps its first 160 and ``~`` and 16 hex
    digits of its SHA-256. ``~`` never survives the first step, so these never
    collide with a plain name. Readers take names from ``tree.json``, never from
    this function, so steps written with other names still read.

    >>> array_names([[["d", "params"], ["d", "w"]], [["d", "zarr.json"]], [["d", "a b"]]])
    ['params.w', 'zarr.json~2', 'a_b']
    >>> [len(n) for n in array_names([[["d", "k" * 300]]])]
    [177]
    """
    names: list[str] = []
    seen: set[str] = set(_RESERVED_NAMES)
    for parts in paths:
        base = ".".join(_NAME_UNSAFE.sub("_", str(key)) for _, key in parts) or "root"
        base = base.strip(".") or "root"
        if len(base) > _LONG_NAME:
            digest = hashlib.sha256(base.encode()).hexdigest()[:16]
            base = f"{base[:160].rstrip('.')}~{digest}"
        name, n = base, 1
        while name in seen:
            n += 1
            name = f"{base}~{n}"
        seen.add(name)
        names.append(name)
    return names


@functools.cache
def storage_problem(dtype: np.dtype) -> str | None:
    """Why TensorStore's zarr v3 driver cannot store ``dtype``, or None if it can.

    Asks TensorStore itself (parsing a spec sends no I/O), so the answer follows
    the installed version: e.g. ``uint4``, strings and structured dtypes are refused.

    >>> storage_problem(np.dtype("float32")) is None
    True
    >>> print(storage_problem(np.dtype("U3")))  # doctest: +ELLIPSIS
    dtype <U3 cannot be stored as zarr v3 by TensorStore (str96 data type is not one of ...)
    """
    import tensorstore as ts

    if dtype.kind == "O":
        return "dtype object cannot be stored as zarr v3"
    spec = {"driver": "zarr3", "kvstore": {"driver": "memory"}}
    try:
        ts.Spec({**spec, "metadata": {"data_type": dtype.name}})
    except ValueError as e:
        reason = str(e).rsplit(": ", 1)[0].rsplit('"data_type": ', 1)[-1]
        shown = dtype.str if dtype.kind in "US" else dtype.name
        return f"dtype {shown} cannot be stored as zarr v3 by TensorStore ({reason})"
    return None


def leaf_kind(leaf: Any) -> str:
    """``array``, ``key`` or ``value``.

    Raises:
      UnsupportedLeafError: anything else, including arrays of a dtype that
        TensorStore's zarr v3 driver cannot store (the caller adds the path).
    """
    if isinstance(leaf, jax.Array):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return "key"
        _check_storable(np.dtype(leaf.dtype))
        return "array"
    if isinstance(leaf, np.ndarray | np.generic):
        _check_storable(leaf.dtype)
        return "array"
    if isinstance(leaf, VALUE_TYPES):
        return "value"
    hint = ""
    if isinstance(leaf, bytes | bytearray):  # e.g. a grain DataLoader iterator's get_state()
        hint = "; a process's own state (a data iterator's) goes in save(process_state=...)"
    raise UnsupportedLeafError(f"leaves of type {type(leaf).__name__} are not supported{hint}")


def _check_storable(dtype: np.dtype) -> None:
    problem = storage_problem(dtype)
    if problem is not None:
        raise UnsupportedLeafError(problem)


def describe_sharding(sharding: Any) -> dict[str, Any]:
    """A JSON description of a sharding, for metadata and ``inspect``."""
    if sharding is None:
        return {"type": "host"}
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
        return {
            "type": "NamedSharding",
            "mesh": dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape, strict=True)),
            "spec": spec,
        }
    return {"type": type(sharding).__name__, "devices": len(sharding.device_set)}


def structure_of(state: Any, leaves: Sequence[SavedLeaf] | None = None) -> Any:
    """The containers of ``state`` as JSON: ``None`` for a leaf (``None`` values included),
    ``[kind, [[path entry, child], ...]]`` for a container, in flatten order.

    ``kind`` is ``list`` or ``tuple`` for those exact types, ``dict`` for every
    other container (dicts, named tuples, dataclasses, optax states: a restore
    without a target gives them back as dicts, keyed by key or attribute name).
    ``leaves``: ``describe_state(state)``'s, whose paths are reused (a save's
    blocking time: ~30 ms for 9,000 leaves, a walk of the treedef).

    >>> structure_of([{}, (), None])
    ['list', [[['s', 0], ['dict', []]], [['s', 1], ['tuple', []]], [['s', 2], None]]]
    """
    treedef = jax.tree_util.tree_structure(state, is_leaf=_is_leaf)
    if leaves is None:
        paths = [encode_path(p) for p, _ in flatten(state)[0]]
    else:
        paths = [leaf.path for leaf in leaves]
    seen = [0]

    def walk(node: Any, depth: int) -> Any:
        if node.num_nodes == 1 and node.num_leaves == 1:
            seen[0] += 1
            return None
        kind, aux = node.node_data()
        items = []
        for i, child in enumerate(node.children()):
            entry = paths[seen[0]][depth] if child.num_leaves else _empty_entry(kind, aux, i)
            items.append([entry, walk(child, depth + 1)])
        name = "list" if kind is list else "tuple" if kind is tuple else "dict"
        if name == "dict" and items and all(entry[0] in ("s", "f") for entry, _ in items):
            name = "list"  # a custom sequence node: a list, as restores always gave
        return [name, items]

    structure = walk(treedef, 0)
    return structure if seen[0] == len(paths) else None  # never a record that misleads


def _empty_entry(kind: type, aux: Any, i: int) -> list[Any]:
    """The path entry of child ``i`` of a node of type ``kind``, when it holds no leaf."""
    if kind in (list, tuple):
        return ["s", i]
    if issubclass(kind, dict):
        keys = aux[1] if isinstance(aux, tuple) and len(aux) == 2 and callable(aux[0]) else aux
        key = list(keys)[i]
        return ["d", key if isinstance(key, str | int) else str(key)]
    if hasattr(kind, "_fields"):  # a named tuple
        return ["a", kind._fields[i]]
    return ["f", i]


def unflatten_saved(leaves: Sequence[SavedLeaf], values: Sequence[Any]) -> Any:
    """Rebuilds the saved nesting as dicts (dict keys, attributes) and lists."""
    if len(leaves) == 1 and not leaves[0].path:
        return values[0]
    root: Any = None
    for leaf, value in zip(leaves, values, strict=True):
        root = _insert(root, leaf.path, value)
    return _finish(root)


class _Seq(dict):
    """Marks a node built from sequence indices, converted to a list at the end."""


def _insert(node: Any, parts: Sequence[Sequence[Any]], value: Any) -> Any:
    if not parts:
        return value
    kind, key = parts[0]
    if node is None:
        node = _Seq() if kind in ("s", "f") else {}
    node[key] = _insert(node.get(key), parts[1:], value)
    return node


def _finish(node: Any) -> Any:
    if isinstance(node, _Seq):
        return [_finish(node[k]) for k in sorted(node)]
    if isinstance(node, dict):
        return {k: _finish(v) for k, v in node.items()}
    return node


def chunk_shape_for(
    shard_shape: Sequence[int],
    itemsize: int,
    target_bytes: int,
    shape: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """A chunk shape that tiles ``shard_shape`` and fits ``target_bytes``, in few chunks.

    Axes are split from the outermost in, by their smallest divisors, so a
    chunk is a contiguous run of rows whenever possible. An axis the shard
    holds whole (``shard_shape[i] == shape[i]``: one writer per chunk whatever
    the split) may instead be split evenly with a partial edge chunk, which
    zarr allows, when the divisors would take more than twice as many chunks: a
    long axis of prime length becomes a few chunks, not one per row. An axis
    split across shards whose divisors would give far more chunks than needed
    is kept whole and an inner axis split instead, when that takes fewer.

    >>> chunk_shape_for((1024, 1024), 4, 1 << 20)
    (256, 1024)
    >>> chunk_shape_for((0, 3), 4, 1 << 20)
    (1, 3)
    >>> chunk_shape_for((8209, 2048), 4, 64 << 20, shape=(8209, 2048))  # prime: 2 chunks
    (4105, 2048)
    >>> chunk_shape_for((8209, 2048), 4, 64 << 20, shape=(16418, 2048))  # sharded rows
    (8209, 1024)
    """
    shard = [max(1, int(d)) for d in shard_shape]
    full = shard_shape if shape is None else shape
    whole = [shape is not None and int(s) == int(d) for s, d in zip(shard_shape, full, strict=True)]
    return tuple(_split(shard, shard, 0, itemsize, target_bytes, whole))


def _count(chunk: Sequence[int], shard: Sequence[int]) -> int:
    return math.prod(-(-s // c) for s, c in zip(shard, chunk, strict=True))


def _split(
    chunk: list[int],
    shard: Sequence[int],
    axis: int,
    itemsize: int,
    target: int,
    whole: Sequence[bool],
) -> list[int]:
    """``chunk`` with ``axis`` and the axes inside it split until it fits ``target``."""
    if axis == len(chunk) or math.prod(chunk) * itemsize <= target:
        return chunk
    n = chunk[axis]
    split = list(chunk)
    while split[axis] > 1 and math.prod(split) * itemsize > target:
        split[axis] //= _smallest_divisor(split[axis])
    if whole[axis]:  # even pieces, the last one partial, if the divisors take far more
        rows = max(1, target // (math.prod(chunk) // n * itemsize))
        pieces = -(-n // min(n, rows))
        if 2 * pieces < -(-n // split[axis]):
            split[axis] = -(-n // pieces)
    best = _split(split, shard, axis + 1, itemsize, target, whole)
    ideal = -(-math.prod(shard) * itemsize // target)
    if axis + 1 < len(chunk) and _count(best, shard) > 2 * ideal:
        kept = _split(list(chunk), shard, axis + 1, itemsize, target, whole)
        if math.prod(kept) * itemsize <= target and _count(kept, shard) < _count(best, shard):
            best = kept
    return best


def _smallest_divisor(n: int) -> int:
    for d in range(2, math.isqrt(n) + 1):
        if n % d == 0:
            return d
    return n


def describe_state(state: Any, *, chunk_bytes: int) -> tuple[list[SavedLeaf], list[Any]]:
    """Describes every leaf of ``state``; returns the leaves and their values.

    Raises:
      UnsupportedLeafError: naming the path of the first unsupported leaf.
    """
    flat, _ = flatten(state)
    paths = [encode_path(p) for p, _ in flat]
    kinds = []
    for path, value in flat:
        try:
            kinds.append(leaf_kind(value))
        except UnsupportedLeafError as e:
            raise UnsupportedLeafError(f"cannot save leaf {path_str(path)}: {e}") from None
    names = iter(array_names([p for p, k in zip(paths, kinds, strict=True) if k != "value"]))
    leaves = []
    for parts, kind, (_, value) in zip(paths, kinds, flat, strict=True):
        if kind == "value":
            leaves.append(SavedLeaf(path=parts, kind=kind, value=value))
            continue
        leaves.append(_describe_array(parts, kind, next(names), value, chunk_bytes))
    return leaves, [v for _, v in flat]


def _describe_array(
    parts: list[list[Any]], kind: str, name: str, value: Any, chunk_bytes: int
) -> SavedLeaf:
    key_impl = None
    if kind == "key":
        key_impl = str(jax.random.key_impl(value))
        value = jax.random.key_data(value)
    sharding = getattr(value, "sharding", None)
    shape = tuple(int(d) for d in np.shape(value))
    dtype = np.dtype(value.dtype)
    shard_shape = sharding.shard_shape(shape) if sharding is not None else shape
    chunk = chunk_shape_for(shard_shape, dtype.itemsize, chunk_bytes, shape)
    count = _count(chunk, shard_shape)
    ideal = -(-math.prod(shard_shape) * dtype.itemsize // chunk_bytes)
    if count > max(TOO_MANY_CHUNKS, 16 * ideal):  # e.g. a long prime axis split across devices
        raise UnsupportedLeafError(
            f"cannot save leaf {path_text(parts)}: its shards {tuple(shard_shape)} split into "
            f"{count:,} chunks of {chunk} to fit chunk_bytes={chunk_bytes:,} ({ideal:,} would "
            "do if an axis had smaller divisors); shard it along an axis whose length has "
            "small divisors, or raise chunk_bytes"
        )
    return SavedLeaf(
        path=parts,
        kind=kind,
        name=name,
        shape=shape,
        dtype=dtype.name,
        chunk_shape=chunk,
        sharding=describe_sharding(sharding),
        key_impl=key_impl,
    )


TOO_MANY_CHUNKS = 1024
"""A shard split into more chunks than this and 16 times what its bytes need is refused
(only an axis split across devices with no small divisor, and no other axis to split,
gets there: an axis a shard holds whole is split evenly, see :func:`chunk_shape_for`)."""
