"""Copying committed steps between roots (``jaxckpt cp``), optionally recompressed.

The destination gets the same commit protocol as a save, in a fresh attempt of
the destination's current epoch: pending record, data, manifest and tree, then
the marker last. A failed copy removes its own attempt and nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxckpt import _pools as pools
from jaxckpt.commit import CommitProtocol
from jaxckpt.errors import CheckpointError, CorruptCheckpointError
from jaxckpt.records import (
    FORMAT_VERSION,
    TRAILER_BYTES,
    TREE_FILE,
    ChunkRecord,
    CommitMarker,
    ManifestPart,
    StepLocation,
    chunk_problem,
    crc32c,
    joined_key,
    manifest_name,
    new_attempt,
    parse_tree,
    read_checked,
)
from jaxckpt.storage import Storage, tensorstore_backed

COPY_BYTES_IN_FLIGHT = 17 << 26
"""The known bytes of the objects a raw copy holds at once: 1,088 MiB, a packed save's bound
with the default options (16 objects of 64 MiB); fewer copies at once when objects are larger."""


def copy_step(
    src: CommitProtocol,
    dst: CommitProtocol,
    marker: CommitMarker,
    *,
    compress: str | None = None,
    level: int = 3,
) -> int:
    """Copies one committed step and commits it on ``dst``; returns the chunk bytes written.

    Args:
      compress: None copies chunks byte for byte (each checked against the
        manifest); ``"zstd"`` re-encodes them with a zstd codec for archival.
    """
    read_checked(src, marker)  # every record checked (names, shapes, grids) before any write
    loc = StepLocation(marker.step, new_attempt(dst.write_epoch()))
    dst.begin_save(loc)
    try:
        if compress == "zstd":
            nbytes, num_processes = _copy_step_compressed(src, dst, marker, loc, level)
        else:
            nbytes = _copy_step_raw(src, dst, marker, loc)
            num_processes = marker.num_processes
        group = src.storage.read(marker.location.key("zarr.json"))  # zarr group, if written
        if group is not None:
            dst.storage.write(loc.key("zarr.json"), group)
        dst.write_tree(loc, src.read_step_file(marker, TREE_FILE))
        dst.commit(loc, num_processes=num_processes, metrics=dict(marker.metrics), keep=marker.keep)
    except BaseException:
        with contextlib.suppress(Exception):  # leave no partial attempt behind
            dst.abandon(loc)
        raise
    return nbytes


def _copy_objects(
    src: Storage,
    dst: Storage,
    keys: Sequence[str],
    chunks: dict[str, ChunkRecord],
    rename: tuple[StepLocation, StepLocation],
    packed: dict[str, list[ChunkRecord]] | None = None,
) -> None:
    """Copies ``keys`` (``rename``: from the source attempt to the destination attempt,
    each object under its name there: a format-4 destination spreads packs and parts
    over hashed prefixes whatever the source's format); those in ``chunks`` must match
    their manifest record, and every chunk ``packed`` lists inside a pack object must
    match its record."""
    old, new = rename

    def problem_of(data: Any, key: str) -> str | None:
        record = chunks.get(key)
        problem = chunk_problem(data, record) if record is not None else None
        for c in (packed or {}).get(key, ()):
            problem = problem or chunk_problem(data[c.offset : c.offset + c.size], c)
            if problem is not None:
                return f"chunk {c.key} at byte {c.offset}: {problem}"
        return problem

    def one(key: str) -> None:
        data: bytes | np.ndarray | None = src.read(key)
        problem = None if data is None else problem_of(data, key)
        if problem is not None:  # a byte flipped in transit fails once: read it the other way
            record = chunks.get(key)
            data = src.read_buffer(key, record.size if record is not None else None)
            problem = None if data is None else problem_of(data, key)
        if data is None:
            raise CorruptCheckpointError(f"{src.uri}/{key} is missing; not copied")
        if problem is not None:
            raise CorruptCheckpointError(
                f"{src.uri}/{key} does not match its manifest record ({problem}, read twice); "
                "not copied"
            )
        dst.write(target(key), bytes(data) if not isinstance(data, bytes) else data)

    def target(key: str) -> str:  # never outside the destination attempt, whatever was listed
        name = old.name_of(key)
        if name is None:
            raise CorruptCheckpointError(f"{src.uri}/{key} is not in {old}; not copied")
        joined_key(new.prefix, name, f"{src.uri}/{key}")  # a safe name, or CorruptCheckpointError
        return new.key(name)

    for key in keys:  # every name checked before anything is written
        target(key)

    # Objects a copy holds at once (each read, then written): 16, fewer for large packs (a
    # large job's write budget merges them), so they hold about what a save's uploads do.
    largest = max(
        [c.size for c in chunks.values()]
        + [max(c.offset + c.size for c in cs) for cs in (packed or {}).values() if cs]
        + [1]
    )
    with pools.borrow("copy", max(1, min(16, COPY_BYTES_IN_FLIGHT // largest))) as pool:
        list(pool.map(one, keys))


def _copy_step_raw(
    src: CommitProtocol,
    dst: CommitProtocol,
    marker: CommitMarker,
    loc: StepLocation,
    part_name: str | None = None,
) -> int:
    """Copies a step's arrays byte for byte (chunks checked), then its manifest parts.

    The manifest parts go last, so a part present in ``loc`` means its chunks are.
    ``part_name``: only that manifest part, its chunks and the arrays' metadata.
    Returns the bytes of the chunks copied, as the manifest counts them.
    """
    here = marker.location
    chunks: dict[str, ChunkRecord] = {}
    packed: dict[str, list[ChunkRecord]] = {}  # a larger object's key -> the chunks inside it
    names = marker.manifest_names()
    if part_name is not None:
        names = [part_name]
    parts = [ManifestPart.from_bytes(src.read_step_file(marker, n), src.where(n)) for n in names]
    for part in parts:
        for name, records in part.arrays.items():
            for c in records:
                address = c.address(here, name)
                if address.whole:
                    chunks[address.key] = c
                else:
                    packed.setdefault(address.key, []).append(c)
    listed = set(src.storage.list(here.arrays_prefix))
    if part_name is not None:  # not the chunks of another part (a local tier's held one)
        listed = {k for k in listed if k.endswith("zarr.json")}
    keys = sorted(listed | set(chunks) | set(packed))
    manifests = [here.key(n) for n in names]
    rename = (here, loc)
    _copy_objects(src.storage, dst.storage, keys, chunks, rename, packed)
    trimmed = _without_held_packs(parts[0]) if part_name is not None else None
    if trimmed is not None and part_name is not None:
        dst.storage.write(loc.key(part_name), trimmed.to_bytes())
    else:
        _copy_objects(src.storage, dst.storage, manifests, {}, rename)
    return sum(c.size for c in chunks.values()) + sum(c.size for cs in packed.values() for c in cs)


def _without_held_packs(part: ManifestPart) -> ManifestPart | None:
    """``part`` naming only the packs its own chunks lie in, or None if it does already.

    On a local tier a process's pack holds its held copies of other processes' chunks
    too, and its own part names that pack even when none of its own chunks is in it
    (a data-parallel job's non-primary host owns no chunk). A part copied alone leaves
    the held chunks behind, so such a pack is not copied, and the part must not name it.
    """
    used = {c.pack for cs in part.arrays.values() for c in cs if c.pack is not None}
    if set(part.packs) <= used or part.version != FORMAT_VERSION:
        return None
    return dataclasses.replace(part, packs={k: v for k, v in part.packs.items() if k in used})


def copy_part(
    src: CommitProtocol,
    dst: CommitProtocol,
    marker: CommitMarker,
    loc: StepLocation,
    *,
    process: int,
    records: bool,
) -> int:
    """Multi-host promotion: copies one host's local commit of a step into the
    durable attempt ``loc`` (its part ``process`` only, chunks checked, the manifest
    part last; not the chunks it holds of other hosts' replicas); with
    ``records``, also the tree record and the zarr group (the primary's part).
    Writes no pending record or marker. Returns the chunk bytes copied.
    """
    if records:  # first: the part's manifest, written last, says the whole part is there
        group = src.storage.read(marker.location.key("zarr.json"))
        if group is not None:
            dst.storage.write(loc.key("zarr.json"), group)
        tree = src.read_step_file(marker, TREE_FILE)
        parse_tree(tree, src.where(marker.location.tree_key), step=marker.step)
        dst.write_tree(loc, tree)
    return _copy_step_raw(src, dst, marker, loc, manifest_name(process))


def _zstd_metadata(leaf: Any, level: int) -> dict[str, Any]:
    from jaxckpt.formats import zarr_metadata

    meta = zarr_metadata(leaf)
    meta["codecs"] = [
        meta["codecs"][0],
        {"name": "zstd", "configuration": {"level": level, "checksum": False}},
        *meta["codecs"][1:],
    ]
    return meta


def _copy_step_compressed(
    src: CommitProtocol, dst: CommitProtocol, marker: CommitMarker, loc: StepLocation, level: int
) -> tuple[int, int]:
    """Re-encodes a step's arrays with zstd and writes one manifest of the stored chunks;
    returns the chunk bytes and the number of manifest parts written. A step with
    process states keeps one part per saving process, the others with no chunks."""
    import tensorstore as ts

    from jaxckpt.restoring import load_step

    step = marker.step
    loaded = load_step(src, marker)
    src_specs, dst_specs = tensorstore_backed(src.storage), tensorstore_backed(dst.storage)
    src_ctx = ts.Context(src_specs.context_spec())
    dst_ctx = ts.Context(dst_specs.context_spec())
    here = marker.location
    group = src.storage.read(here.arrays_prefix + "zarr.json")
    if group is not None:
        dst.storage.write(loc.arrays_prefix + "zarr.json", group)
    records: dict[str, tuple[ChunkRecord, ...]] = {}
    for leaf in loaded.leaves:
        if leaf.kind == "value" or leaf.name is None:
            continue
        prefix = here.array_prefix(leaf.name)
        out = loc.array_prefix(leaf.name)
        try:
            target_spec: dict[str, Any] = {
                "driver": "zarr3",
                "kvstore": dst_specs.kvstore_spec(out),
            }
            target_spec["metadata"] = _zstd_metadata(leaf, level)
            target_spec["store_data_equal_to_fill_value"] = True  # every chunk is an object
            target = ts.open(target_spec, create=True, open=True, context=dst_ctx).result()
            keys = [c.key for c in loaded.chunks.get(leaf.name, ())]
            if not loaded.format.zarr_arrays:  # chunks are byte ranges: read them checked
                _transcode_packed(src, loaded, leaf, target, keys)
            else:
                source_spec: dict[str, Any] = {
                    "driver": "zarr3",
                    "kvstore": src_specs.kvstore_spec(prefix),
                    "fill_missing_data_reads": False,
                }
                source = ts.open(source_spec, open=True, read=True, context=src_ctx).result()
                _transcode(source, target, keys, leaf.shape, leaf.chunk_shape)
            kv = ts.KvStore.open(dst_specs.kvstore_spec(out), context=dst_ctx).result()
            records[leaf.name] = tuple(_stored_chunks(kv, keys))
        except ValueError as e:  # TensorStore reports failures as ValueError
            raise CheckpointError(
                f"step {step}: cannot copy {leaf.path_text} ({src.where(prefix)}): {e}"
            ) from e
    states = loaded.process_states
    count = marker.num_processes if states else 1
    part = ManifestPart(
        step=step, process=0, num_processes=count, arrays=records, process_state=states.get(0)
    )
    dst.write_manifest_part(loc, part)
    for p in range(1, count):  # each process's state, in a part of its own as saved
        state = states.get(p)
        dst.write_manifest_part(
            loc,
            ManifestPart(step=step, process=p, num_processes=count, arrays={}, process_state=state),
        )
    return part.nbytes, count


def _stored_chunks(kv: Any, keys: Sequence[str]) -> list[ChunkRecord]:
    """The manifest records of stored chunks: size, and CRC32C of the bytes before the trailer."""
    records = []
    for key, fut in [(k, kv.read(k)) for k in keys]:
        result = fut.result()
        if result.state != "value":
            raise CheckpointError(f"chunk {key} was not stored under {kv.url}")
        data = result.value
        record = ChunkRecord(key=key, size=len(data), crc32c=crc32c(data[:-TRAILER_BYTES]))
        problem = chunk_problem(data, record)
        if problem is not None:
            raise CheckpointError(f"chunk {key} under {kv.url} reads back wrong: {problem}")
        records.append(record)
    return records


def _chunk_region(key: str, shape: Sequence[int], chunk: Sequence[int]) -> tuple[slice, ...]:
    idx = [int(i) for i in key.split("/")[1:]]
    return tuple(
        slice(i * c, min((i + 1) * c, d)) for i, c, d in zip(idx, chunk, shape, strict=True)
    )


def _transcode_packed(
    src: CommitProtocol, loaded: Any, leaf: Any, target: Any, keys: Sequence[str]
) -> None:
    """Writes each chunk of a packed leaf to ``target``, 16 at a time, every one read by
    range and checked against its record (``_chunkread``)."""
    from jaxckpt.formats import RegionRequest, read_regions

    loc = loaded.marker.location
    for lo in range(0, len(keys), 16):
        regions = [_chunk_region(k, leaf.shape, leaf.chunk_shape) for k in keys[lo : lo + 16]]
        requests = [
            RegionRequest(leaf, tuple((r.start, r.stop) for r in region)) for region in regions
        ]
        values = read_regions(src.storage, loc, requests, loaded.chunks)
        writes = [target[r].write(v) for r, v in zip(regions, values, strict=True)]
        for w in writes:
            w.result()


def _transcode(
    source: Any, target: Any, keys: Sequence[str], shape: Sequence[int], chunk: Sequence[int]
) -> None:
    """Reads each chunk of ``source`` and writes it to ``target``, a window at a time."""
    reads: deque[tuple[tuple[slice, ...], Any]] = deque()
    writes: deque[Any] = deque()
    todo = iter(keys)
    while True:
        while len(reads) < 16 and (key := next(todo, None)) is not None:
            region = _chunk_region(key, shape, chunk)
            reads.append((region, source[region].read()))
        if not reads:
            break
        region, fut = reads.popleft()
        writes.append(target[region].write(fut.result()))
        while len(writes) > 16:
            writes.popleft().result()
    for w in writes:
        w.result()
