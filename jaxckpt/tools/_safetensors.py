"""safetensors export and import, streamed with bounded memory.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian
header length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {str: str}}`` padded with spaces, then the
tensors' raw little-endian C-order bytes, back to back. The writer here emits
the header first (every offset is known from shapes and dtypes) and then streams
each tensor block by block from the checkpoint, so memory stays at about one
block (:data:`jaxckpt.restoring._lazy.DEFAULT_BLOCK_BYTES`, or one chunk row if larger)
whatever the checkpoint's size. Checkpoints larger than ``max_shard_bytes`` are
written as Hugging Face shards, ``model-00001-of-00003.safetensors`` ..., with
``model.safetensors.index.json`` = ``{"metadata": {"total_size": N},
"weight_map": {name: file}}``.

Tensor names are the dotted tree paths (``params.dense.kernel``); non-array
leaves (ints, strings, ...) go into ``__metadata__["jaxckpt.values"]`` as JSON.

Memory budgets (``max_memory_bytes``): :mod:`jaxckpt.tools._leafwrite`. Publishing uses this.
Object-store outputs: :mod:`jaxckpt.tools._storeexport`. Reading back:
:mod:`jaxckpt.tools._safetensorsread`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import struct
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jaxckpt.commit import reached as reached_phase
from jaxckpt.errors import CheckpointError, StorageError
from jaxckpt.restoring import DEFAULT_BLOCK_BYTES, LeafView, StepView, dotted_path, open_step
from jaxckpt.tools._leafwrite import budget_problem, fsync_dir, leaf_block_bytes, write_file
from jaxckpt.tools._storeexport import export_to_store, is_store_uri, split_store_uri

__all__ = ["ExportResult", "export_safetensors"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 * 10**9  # Hugging Face's default max_shard_size, "5GB"
_MAX_HEADER = 100 << 20  # safetensors refuses headers above 100 MB

# numpy / zarr dtype name -> safetensors dtype
_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "float16": "F16",
    "bfloat16": "BF16",
    "uint32": "U32",
    "int32": "I32",
    "float32": "F32",
    "uint64": "U64",
    "int64": "I64",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "complex64": "C64",
}
_NUMPY = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True, kw_only=True)
class ExportResult:
    """What :func:`export_safetensors` wrote.

    Attributes:
      files: the paths written (shards in order; the index file last if any).
      tensors: number of tensors.
      total_size: tensor bytes (the index's ``total_size``).
      step: the exported step.
    """

    files: tuple[str, ...]
    tensors: int
    total_size: int
    step: int


class ExportError(CheckpointError, ValueError):
    """A checkpoint cannot be exported as asked.

    The message names the leaf or file. Leave out unsupported leaves with
    ``leaves=`` (``--leaf`` on the command line), or pick another output path.
    """


@dataclass(frozen=True)
class _Tensor:
    name: str
    view: LeafView
    dtype: str
    nbytes: int


LeafFilter = Sequence[str] | Callable[[str], bool] | None
"""Which leaves to export: glob patterns on dotted paths, a predicate on them, or None (all)."""


def _wanted(name: str, patterns: LeafFilter) -> bool:
    if patterns is None:
        return True
    if callable(patterns):
        return bool(patterns(name))
    return not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _select(step: StepView, patterns: LeafFilter) -> list[_Tensor]:
    tensors = []
    seen: dict[str, str] = {}
    for view in step.arrays():
        name = view.path
        if not _wanted(name, patterns):
            continue
        dtype = _DTYPES.get(view.leaf.dtype or "")
        if dtype is None:
            raise ExportError(
                f"step {step.step}: {name} has dtype {view.leaf.dtype}, which safetensors "
                f"cannot store (supported: {', '.join(sorted(_DTYPES))})"
            )
        if name in seen:
            raise ExportError(
                f"step {step.step}: two leaves have the tensor name {name!r} "
                f"({seen[name]} and {view.leaf.path_text})"
            )
        seen[name] = view.leaf.path_text
        tensors.append(_Tensor(name=name, view=view, dtype=dtype, nbytes=view.nbytes))
    if not tensors:
        shown = () if patterns is None or callable(patterns) else patterns
        wanted = " or ".join(repr(p) for p in shown)  # a list would read as a path
        raise ExportError(f"step {step.step} of {step.root}: no array leaf matches {wanted or '*'}")
    return tensors


def _shards(tensors: list[_Tensor], max_bytes: int) -> list[list[_Tensor]]:
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _header(tensors: Sequence[_Tensor], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.view.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    if len(raw) > _MAX_HEADER:
        raise ExportError(f"safetensors header of {len(raw)} bytes exceeds 100 MB; use shards")
    return struct.pack("<Q", len(raw)) + raw


def _write_file(
    path: str,
    tensors: Sequence[_Tensor],
    metadata: dict[str, str],
    on_progress: Callable[[int], None] | None,
    block_bytes: int,
) -> None:
    views = [(t.name, t.view) for t in tensors]
    write_file(path, _header(tensors, metadata), views, block_bytes, on_progress)


def _planned(
    tensors: list[_Tensor], max_shard_bytes: int, index: bool
) -> tuple[list[tuple[str, list[_Tensor]]], bool]:
    """The files of a directory output: ``(name, tensors)`` each, and whether an index goes
    with them (shards, or ``index``)."""
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1 and not index:
        return [(SINGLE_FILE, tensors)], False
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    return list(zip(names, shards, strict=True)), True


def _index_body(tensors: list[_Tensor], plan: Sequence[tuple[str, Sequence[_Tensor]]]) -> bytes:
    body = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors)},
        "weight_map": {t.name: os.path.basename(path) for path, members in plan for t in members},
    }
    return (json.dumps(body, indent=2) + "\n").encode()


def _makedirs(path: str) -> None:
    """Creates the output directory (and its parents), or says why it cannot."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create the output directory {path}: {e.strerror or e}") from e


def export_safetensors(
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    leaves: LeafFilter = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    on_progress: Callable[[int], None] | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    max_memory_bytes: int | None = None,
    index: bool = False,
    out_options: Any = None,
    **storage_options: Any,
) -> ExportResult:
    """Writes a committed step's arrays as safetensors, sharded when large.

    Args:
      root: the checkpoint root (local, ``gs://``, ``s3://``).
      out: a local directory (created with its parents), which receives
        ``model.safetensors`` or shards plus ``model.safetensors.index.json``;
        or a path ending in ``.safetensors`` (its directory created), which
        receives one file whatever its size. ``s3://BUCKET/PREFIX`` and
        ``gs://BUCKET/PREFIX`` (or such a URI ending in ``.safetensors``) the same
        in an object store: each file written to a local spool file under the
        budget, uploaded in bounded parts and deleted; the index last
        (:mod:`jaxckpt.tools._storeexport`).
      step: the step to export; None exports the newest.
      leaves: glob patterns on dotted paths (``params.*``) or a predicate on them;
        None exports every array.
      max_shard_bytes: the most tensor bytes per shard (one larger tensor gets
        a shard of its own).
      on_progress: called with the number of bytes of each block written.
      block_bytes: the most bytes read into memory at once (at least a chunk row).
      max_memory_bytes: the most tensor bytes held at once (overrides ``block_bytes``:
        blocks of a third of it, wide leaves chunk by chunk; see ``_leafwrite``).
      index: write shards and the index even when one shard holds everything (the
        Hugging Face layout whatever the size; the index is written last).
      out_options: an object-store ``out``'s options (an :class:`~jaxckpt.storage.
        ObjectStoreOptions` or a mapping; ``storage_options`` are the checkpoint root's).

    Returns:
      An :class:`ExportResult`.

    Raises:
      ExportError: a leaf has a dtype safetensors lacks, two leaves share a
        name, nothing matches ``leaves``, ``out`` is neither a local path nor a valid
        ``s3://`` or ``gs://`` URI, or ``max_memory_bytes`` is below three chunks of a leaf.
      StorageError: the object store failed (naming the object).
      StepNotFoundError, CorruptCheckpointError: as :func:`jaxckpt.open_step`.
    """
    out = os.fspath(out)
    store = None
    if is_store_uri(out):
        try:
            store = split_store_uri(out)
        except StorageError as e:
            raise ExportError(f"invalid output {out!r}: {e.strerror}") from e
    elif "://" in out:
        raise ExportError(
            f"export writes to a local path, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX, got {out!r}"
        )
    if max_shard_bytes < 1:
        raise ExportError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    view = open_step(root, step, **storage_options)
    tensors = _select(view, leaves)
    if max_memory_bytes is not None:  # a chunk is read whole: below three is refused
        block_bytes = view.window_bytes = leaf_block_bytes(max_memory_bytes)
        if (problem := budget_problem([t.view for t in tensors], max_memory_bytes)) is not None:
            raise ExportError(problem)
    metadata = {
        "format": "flax",
        "jaxckpt.root": view.root,
        "jaxckpt.step": str(view.step),
        "jaxckpt.values": json.dumps(
            {dotted_path(x): x.value for x in view.leaves if x.kind == "value"}
        ),
    }
    if store is not None:
        files = _to_store(
            store,
            tensors,
            metadata,
            max_shard_bytes,
            index,
            on_progress,
            block_bytes,
            max_memory_bytes or 3 * block_bytes,
            out_options,
            view.step,
        )
        return ExportResult(
            files=files,
            tensors=len(tensors),
            total_size=sum(t.nbytes for t in tensors),
            step=view.step,
        )
    index_path = None
    if out.endswith(".safetensors"):
        plan = [(out, tensors)]
        _makedirs(os.path.dirname(out) or ".")
    else:
        _makedirs(out)
        named, with_index = _planned(tensors, max_shard_bytes, index)
        plan = [(os.path.join(out, nm), s) for nm, s in named]
        index_path = os.path.join(out, INDEX_FILE) if with_index else None
    temps: list[tuple[str, str]] = []
    path = plan[0][0]
    try:
        for path, members in plan:
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            temps.append((tmp, path))
            _write_file(tmp, members, metadata, on_progress, block_bytes)
            reached_phase("shard_written", view.step)
        if index_path is not None:
            tmp = f"{index_path}.tmp-{uuid.uuid4().hex[:8]}"
            temps.append((tmp, index_path))
            with open(tmp, "wb") as f:
                f.write(_index_body(tensors, plan))
                f.flush()
                os.fsync(f.fileno())
        for i, (tmp, path) in enumerate(temps):  # the output appears once every file is complete
            if index_path is not None and i == len(temps) - 1:
                fsync_dir(os.path.dirname(path))  # the shards are in place before the index
            os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")
    except BaseException as e:
        for tmp, _ in temps:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, OSError):  # name the output, not its temporary name
            raise ExportError(f"cannot write {path}: {e.strerror or e}") from e
        raise
    return ExportResult(
        files=tuple(path for _, path in temps),
        tensors=len(tensors),
        total_size=sum(t.nbytes for t in tensors),
        step=view.step,
    )


def _to_store(
    store: tuple[str, str | None],
    tensors: list[_Tensor],
    metadata: dict[str, str],
    max_shard_bytes: int,
    index: bool,
    on_progress: Callable[[int], None] | None,
    block_bytes: int,
    part_bytes: int,
    out_options: Any,
    step: int,
) -> tuple[str, ...]:
    """The files of :func:`export_safetensors` in an object store (``store``: the directory
    URI and the one file's name, if ``out`` named one); returns their URIs."""
    directory, single = store
    if single is not None:
        plan, with_index = [(single, tensors)], False
    else:
        plan, with_index = _planned(tensors, max_shard_bytes, index)

    def write(path: str, members: list[_Tensor]) -> None:
        try:
            _write_file(path, members, metadata, on_progress, block_bytes)
        except OSError as e:
            raise ExportError(f"cannot write the spool file {path}: {e.strerror or e}") from e
        reached_phase("shard_written", step)

    body = (INDEX_FILE, _index_body(tensors, plan)) if with_index else None
    return export_to_store(
        directory,
        plan,
        write,
        body,
        part_bytes=part_bytes,
        progress=on_progress,
        storage_options=out_options,
    )
