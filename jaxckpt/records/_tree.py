"""The tree record (``tree.json``): written by a save, parsed and checked by every reader.

A tree record lists every leaf (path, kind, array name, shape, dtype, chunk
shape, sharding; a value leaf's value), the user's metadata, the writer's
versions and, since saves record it, ``structure`` (``_tree.structure_of``): the
saved tree's containers, empty ones included, so that a restore without a target gives back
``{'x': [{}, w], 'e': {}}`` and optax's ``EmptyState`` in their places. Records
without it restore as before (dicts and lists built from the leaf paths).

Everything in it is untrusted: :func:`parse_tree` checks every field's type and
every array name, and :func:`check_manifest` checks the leaves against the
step's manifest (each array's chunks lie on its chunk grid, have the size of a
whole chunk when the bytes are raw, and are all there when the marker covers
every process), so nothing is iterated or allocated from a shape no manifest
vouches for. A record that fails is corrupt (``CorruptCheckpointError`` naming
it); a newer version is refused (``UnsupportedFormatError``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxckpt.errors import CorruptCheckpointError
from jaxckpt.records._layouts import step_format
from jaxckpt.records._names import checked_name
from jaxckpt.records._step import TRAILER_BYTES, ChunkRecord, load_json_record, path_text

if TYPE_CHECKING:
    from jaxckpt.commit import CommitReader
    from jaxckpt.records._step import CommitMarker, ManifestPart

VALUE_TYPES = (bool, int, float, str, type(None))
"""Python values a tree saves as ``value`` leaves (JSON)."""
MAX_RANK = 32  # numpy's limit is 64; no saved leaf comes near either
_PATH_KINDS = ("d", "s", "a", "f")


@dataclass(frozen=True, kw_only=True)
class SavedLeaf:
    """One leaf of a saved tree, as recorded in ``tree.json``."""

    path: list[list[Any]]
    kind: str
    name: str | None = None
    shape: tuple[int, ...] = ()
    dtype: str | None = None
    chunk_shape: tuple[int, ...] = ()
    sharding: dict[str, Any] | None = None
    key_impl: str | None = None
    value: Any = None

    @property
    def path_text(self) -> str:
        return path_text(self.path)

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype of an array leaf (``bfloat16`` included)."""
        assert self.dtype is not None, f"{self.path_text} is not an array leaf"
        return np_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        if self.dtype is None:
            return 0
        return int(np.prod(self.shape, dtype=np.int64)) * self.numpy_dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "kind": self.kind}
        if self.kind == "value":
            out["value"] = self.value
        else:
            out.update(
                name=self.name,
                shape=list(self.shape),
                dtype=self.dtype,
                chunk_shape=list(self.chunk_shape),
                sharding=self.sharding,
            )
            if self.key_impl is not None:
                out["key_impl"] = self.key_impl
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SavedLeaf:
        return cls(
            path=obj["path"],
            kind=obj["kind"],
            name=obj.get("name"),
            shape=tuple(obj.get("shape", ())),
            dtype=obj.get("dtype"),
            chunk_shape=tuple(obj.get("chunk_shape", ())),
            sharding=obj.get("sharding"),
            key_impl=obj.get("key_impl"),
            value=obj.get("value"),
        )


@functools.cache
def np_dtype(name: str) -> np.dtype:
    """The numpy dtype for a saved dtype name (``bfloat16`` and ml_dtypes' others included).

    >>> np_dtype("bfloat16").itemsize, np_dtype("float32").name
    (2, 'float32')
    """
    import ml_dtypes

    extension = getattr(ml_dtypes, name, None) if isinstance(name, str) else None
    if isinstance(extension, type) and issubclass(extension, np.generic):
        return np.dtype(extension)
    return np.dtype(name)


@dataclass(frozen=True, kw_only=True)
class TreeRecord:
    """A parsed, checked tree record."""

    leaves: tuple[SavedLeaf, ...]
    metadata: Any = None
    versions: Mapping[str, str] = field(default_factory=dict)
    structure: Any = None
    """The saved containers (``_tree.structure_of``), or None in older records."""


# -- reading -------------------------------------------------------------------


def parse_tree(data: bytes, what: str, *, step: int | None = None) -> TreeRecord:
    """Parses and checks a tree record.

    Raises:
      CorruptCheckpointError: malformed (wrong types, missing fields, unsafe or
        repeated array names, a structure that does not match the leaves).
      UnsupportedFormatError: a newer format version.
    """
    obj = load_json_record(data, what)
    if step is not None and obj.get("step", step) != step:
        raise CorruptCheckpointError(f"{what}: records step {obj.get('step')!r:.40}, not {step}")
    raw_leaves = obj.get("leaves")
    if not isinstance(raw_leaves, list):
        raise CorruptCheckpointError(f"{what}: no list of leaves")
    leaves = tuple(_leaf(x, f"{what}: leaf {i}") for i, x in enumerate(raw_leaves))
    names = [x.name for x in leaves if x.name is not None]
    if len(set(names)) != len(names):
        raise CorruptCheckpointError(f"{what}: two leaves name the same array")
    versions = obj.get("versions") or {}
    if not isinstance(versions, dict):
        raise CorruptCheckpointError(f"{what}: versions is not a JSON object")
    structure = obj.get("structure")
    if structure is not None:
        _check_structure(structure, leaves, what)
    return TreeRecord(
        leaves=leaves, metadata=obj.get("metadata"), versions=versions, structure=structure
    )


def _leaf(obj: Any, what: str) -> SavedLeaf:
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{what} is not a JSON object")
    path = obj.get("path")
    if not isinstance(path, list) or not all(_path_entry(e) for e in path):
        raise CorruptCheckpointError(f"{what}: malformed path {path!r:.200}")
    kind = obj.get("kind")
    if kind == "value":
        if not isinstance(obj.get("value"), VALUE_TYPES):
            raise CorruptCheckpointError(f"{what}: a value leaf holds {obj.get('value')!r:.80}")
        return SavedLeaf(path=path, kind=kind, value=obj["value"])
    if kind not in ("array", "key"):
        raise CorruptCheckpointError(f"{what}: unknown kind {kind!r:.40}")
    where = f"{what} ({SavedLeaf(path=path, kind=kind).path_text})"
    checked_name(obj.get("name"), "array", where)
    shape, chunk = _dims(obj.get("shape"), where, 0), _dims(obj.get("chunk_shape"), where, 1)
    if len(chunk) != len(shape) or any(c > max(1, d) for c, d in zip(chunk, shape, strict=True)):
        raise CorruptCheckpointError(f"{where}: chunk shape {chunk} does not fit shape {shape}")
    try:
        if not isinstance(obj.get("dtype"), str) or np_dtype(obj["dtype"]).name != obj["dtype"]:
            raise TypeError("not a dtype's name")
        if np_dtype(obj["dtype"]).kind == "O":
            raise TypeError("an object dtype")
    except (TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: unknown dtype {obj.get('dtype')!r:.40}") from e
    impl, sharding = obj.get("key_impl"), obj.get("sharding")
    if not isinstance(impl, str | None) or not isinstance(sharding, dict | None):
        raise CorruptCheckpointError(f"{where}: malformed key_impl or sharding")
    return SavedLeaf.from_json(obj)


def _path_entry(entry: Any) -> bool:
    if not isinstance(entry, list) or len(entry) != 2 or entry[0] not in _PATH_KINDS:
        return False
    key = entry[1]
    if entry[0] in ("s", "f"):
        return isinstance(key, int) and not isinstance(key, bool) and key >= 0
    return isinstance(key, str) or (entry[0] == "d" and type(key) is int)


def _dims(value: Any, what: str, least: int) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or len(value) > MAX_RANK
        or not all(type(d) is int and least <= d < 1 << 62 for d in value)
    ):
        raise CorruptCheckpointError(f"{what}: malformed shape {value!r:.200}")
    return tuple(value)


def _check_structure(structure: Any, leaves: Sequence[SavedLeaf], what: str) -> None:
    """Every leaf of ``structure`` is the next saved leaf, at the same path."""
    found = iter(leaves)
    try:
        for path in _structure_paths(structure, []):
            leaf = next(found, None)
            if leaf is None or leaf.path != path:
                raise CorruptCheckpointError(f"{what}: the structure does not match the leaves")
    except (TypeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{what}: malformed structure ({e!r:.80})") from e
    if next(found, None) is not None:
        raise CorruptCheckpointError(f"{what}: the structure does not match the leaves")


def _structure_paths(node: Any, prefix: list[list[Any]]) -> Iterator[list[list[Any]]]:
    if node is None:
        yield prefix
        return
    kind, items = node
    if kind not in ("dict", "list", "tuple") or not isinstance(items, list):
        raise ValueError(f"unknown container {kind!r:.40}")
    for entry, child in items:
        if not _path_entry(entry):
            raise ValueError(f"malformed path entry {entry!r:.80}")
        yield from _structure_paths(child, [*prefix, entry])


def rebuild(structure: Any, values: Sequence[Any]) -> Any:
    """The saved tree from a checked ``structure`` and every leaf's value, in order."""
    it = iter(values)

    def build(node: Any) -> Any:
        if node is None:
            return next(it)
        kind, items = node
        children = [(entry[1], build(child)) for entry, child in items]
        if kind == "list":
            return [c for _, c in children]
        if kind == "tuple":
            return tuple(c for _, c in children)
        return dict(children)

    return build(structure)


def _check_once(path: str, records: Sequence[ChunkRecord], what: str) -> None:
    """Refuses a chunk that two records (two parts) list with different bytes: each
    chunk is written once, so a reader would take one of them at random."""
    seen: dict[str, tuple[int, int]] = {}
    for record in records:
        stored = seen.setdefault(record.key, (record.size, record.crc32c))
        if stored != (record.size, record.crc32c):
            raise CorruptCheckpointError(
                f"{what}: {path}: chunk {record.key} is listed twice with different bytes "
                f"({stored[0]} bytes with CRC32C {stored[1]:08x}, and {record.size} with "
                f"{record.crc32c:08x}): the manifest parts overlap"
            )


def check_manifest(
    leaves: Sequence[SavedLeaf],
    chunks: Mapping[str, Sequence[ChunkRecord]],
    *,
    raw: bool,
    complete: bool,
    what: str,
) -> None:
    """Checks the tree's array leaves against the step's chunk records, before any read.

    Args:
      leaves: the tree record's leaves.
      chunks: every manifest part's chunk records, by array name.
      raw: the chunks are stored raw (packed, or the parts say ``bytes+crc32c``):
        each must be exactly a whole chunk's bytes and its checksum.
      complete: the marker covers every process's part, so every chunk of the
        grid must be listed (a host's own local tier holds only its part).
      what: the step, for messages.

    Raises:
      CorruptCheckpointError: a manifest array the tree lacks, a chunk key off its
        leaf's grid or of the wrong rank, a chunk of the wrong size, or chunks missing.
    """
    arrays = {leaf.name: leaf for leaf in leaves if leaf.name is not None}
    for name, records in chunks.items():
        leaf = arrays.get(name)
        if leaf is None:
            if records:
                raise CorruptCheckpointError(
                    f"{what}: the manifest lists array {name!r:.200}, "
                    "which the tree record does not have"
                )
            continue
        grid = tuple(-(-d // c) for d, c in zip(leaf.shape, leaf.chunk_shape, strict=True))
        full = math.prod(leaf.chunk_shape) * leaf.numpy_dtype.itemsize + TRAILER_BYTES
        _check_once(leaf.path_text, records, what)
        for record in records:
            index = record.key.split("/")[1:]
            if len(index) != len(grid) or any(
                int(i) >= g for i, g in zip(index, grid, strict=True)
            ):
                raise CorruptCheckpointError(
                    f"{what}: {leaf.path_text}: chunk {record.key} is not on the chunk grid "
                    f"of shape {leaf.shape} in chunks of {leaf.chunk_shape}"
                )
            if raw and record.size != full:
                raise CorruptCheckpointError(
                    f"{what}: {leaf.path_text}: chunk {record.key} has {record.size} bytes, "
                    f"not the {full} of a chunk of {leaf.chunk_shape} {leaf.dtype}"
                )
    if not complete:
        return
    for name, leaf in arrays.items():
        expected = math.prod(-(-d // c) for d, c in zip(leaf.shape, leaf.chunk_shape, strict=True))
        if any(d == 0 for d in leaf.shape):
            expected = 0
        have = len({r.key for r in chunks.get(name, ())})
        if have != expected:
            raise CorruptCheckpointError(
                f"{what}: {leaf.path_text}: the manifest lists {have} chunks, but shape "
                f"{leaf.shape} in chunks of {leaf.chunk_shape} has {expected}"
            )


@dataclass(frozen=True, kw_only=True)
class CheckedStep:
    """A committed step's records, read and checked (see :func:`read_checked`)."""

    tree: TreeRecord
    chunks: Mapping[str, tuple[ChunkRecord, ...]]
    layout: str
    plain_codecs: bool
    process_states: Mapping[int, Any] = field(default_factory=dict)
    """The parts' ``process_state`` records, by process (see ``_procstate``)."""


def read_checked(
    protocol: CommitReader, marker: CommitMarker, parts: Sequence[str] | None = None
) -> CheckedStep:
    """Reads a committed step's tree record and manifest parts and checks them together.

    Imports no jax (``jaxckpt promote`` and ``cp`` check what they copy with it).

    Args:
      parts: the names of the manifest parts to read (None: every part the marker
        covers; only then can the chunk grids be checked complete).

    Raises:
      CorruptCheckpointError: a record is missing, altered or malformed, or the
        tree and the manifest disagree.
      UnsupportedFormatError: a record of a newer format version.
    """
    raw_tree, read = protocol.read_step(marker, parts=parts)
    assert raw_tree is not None
    tree = parse_tree(raw_tree, protocol.where(marker.location.tree_key), step=marker.step)
    return check_parts(protocol, marker, tree, read, complete=parts is None)


def check_parts(
    protocol: CommitReader,
    marker: CommitMarker,
    tree: TreeRecord,
    parts: Sequence[ManifestPart],
    *,
    complete: bool,
) -> CheckedStep:
    """A step's tree record and the manifest ``parts`` read of it, checked together.

    ``complete``: every part the marker covers was read (if they are every process's,
    every chunk of every grid must be listed).
    """
    chunks: dict[str, list[ChunkRecord]] = {}
    for part in parts:
        for name, records in part.arrays.items():
            chunks.setdefault(name, []).extend(records)
    data_format = step_format(p.layout for p in parts)
    plain_codecs = bool(parts) and all(p.plain_codecs for p in parts)
    check_manifest(
        tree.leaves,
        chunks,
        raw=data_format.raw_chunks or plain_codecs,
        complete=complete and marker.every_process,
        what=f"step {marker.step} ({protocol.where(marker.location.prefix)})",
    )
    return CheckedStep(
        tree=tree,
        chunks={k: tuple(v) for k, v in chunks.items()},
        layout=data_format.name,
        plain_codecs=plain_codecs,
        process_states={p.process: p.process_state for p in parts if p.process_state},
    )
