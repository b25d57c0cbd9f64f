"""Arrays that several processes need, read once: each reads a part, collectives share them.

On a multi-host restore every process reads the regions its devices address,
so an array replicated over processes (``P()``, or sharded only within a
process) would be read whole by every process. Here such a leaf is read once
in total: its chunks, concatenated in chunk-grid order, form one stream of
elements, split into equal slices, one per device of the target sharding
(ordered by process). Each process reads the bytes of its own devices' slices
-- whole chunks where a slice covers one, ranged reads of a chunk's part where
it does not -- and the slices become a global array sharded over those
devices, which one jitted function (for every such leaf at once) reorders into
the array and lays out with the target sharding: XLA moves the bytes between
processes (gloo on CPU, NCCL on GPU, ICI on TPU).

A chunk read in parts is checked as a whole: each process publishes the
CRC32C of its parts through the JAX key-value store and every process
combines them (:func:`~jaxckpt.restoring._crccombine.crc32c_combine`) and
compares with the manifest, so all processes reach the same verdict. That
exchange is also the barrier before the collective: it waits at most the
agreement's timeout for every process, and a process that failed to read makes
every process raise (a corrupt chunk raises :class:`CorruptCheckpointError`
everywhere, so a fallback stays collective).
The collective itself (:mod:`jaxckpt.restoring._collective`) is waited on with the
same deadline.

Leaves below :data:`MIN_BYTES`, keys, leaves with a non-plain codec chain and
leaves whose chunks do not tile the array exactly are read by every process
that needs them, as before.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c
import jax
import numpy as np

from jaxckpt import _pools as pools
from jaxckpt.commit import Agreement, reached
from jaxckpt.errors import CheckpointError, CorruptCheckpointError
from jaxckpt.formats import chunk_key
from jaxckpt.records import TRAILER_BYTES, ChunkRecord, SavedLeaf, StepLocation, chunk_problem
from jaxckpt.restoring._collective import _collective, _Meta, _reassemble
from jaxckpt.restoring._crccombine import crc32c_combine
from jaxckpt.storage import Storage, aligned_empty

MIN_BYTES = 1 << 20
"""Leaves smaller than this are read by every process that needs them (one request
each is cheaper than a collective's latency)."""

_WORKERS = 8
PART_BYTES = 8 << 20
"""The largest ranged read of a chunk read in parts (they run in parallel)."""


@dataclass(frozen=True, kw_only=True)
class SharedLeaf:
    """A leaf read once over all processes and exchanged."""

    index: int
    """Its position among the leaves being restored."""
    leaf: SavedLeaf
    sharding: jax.sharding.Sharding
    dtype: np.dtype
    devices: tuple[Any, ...]
    """The target's devices, by process then id: device ``j`` holds stream slice ``j``."""
    records: tuple[ChunkRecord, ...]
    """The leaf's chunks in chunk-grid (stream) order."""

    @property
    def size(self) -> int:
        return math.prod(self.leaf.shape)

    @property
    def slice_size(self) -> int:
        """Elements per device (the last slices are padded)."""
        return -(-self.size // len(self.devices))

    def local_devices(self) -> range:
        """The indices of this process's devices (contiguous)."""
        me = jax.process_index()
        mine = [j for j, d in enumerate(self.devices) if d.process_index == me]
        return range(mine[0], mine[-1] + 1) if mine else range(0)


def plan(
    leaves: Sequence[SavedLeaf],
    shardings: Sequence[jax.sharding.Sharding | None],
    dtypes: Sequence[np.dtype | None],
    chunks: Mapping[str, Sequence[ChunkRecord]],
    plain: set[str],
    *,
    min_bytes: int | None = None,
) -> list[SharedLeaf]:
    """The leaves that more than one process needs (in whole or part) and can share.

    Decided from global facts only (the target shardings, the saved leaves and
    the agreed manifest), so every process gets the same plan.
    """
    if jax.process_count() == 1:
        return []
    threshold = MIN_BYTES if min_bytes is None else min_bytes
    out = []
    for i, (leaf, sharding, dtype) in enumerate(zip(leaves, shardings, dtypes, strict=True)):
        if (
            sharding is None
            or dtype is None
            or leaf.kind != "array"
            or leaf.name not in plain
            or not leaf.shape
            or math.prod(leaf.shape) * leaf.numpy_dtype.itemsize < threshold
            or not _needed_twice(leaf, sharding)
        ):
            continue
        records = _stream_records(leaf, chunks.get(leaf.name or "", ()))
        if records is None:
            continue
        devices = tuple(sorted(sharding.device_set, key=_device_order))
        out.append(
            SharedLeaf(
                index=i,
                leaf=leaf,
                sharding=sharding,
                dtype=np.dtype(dtype),
                devices=devices,
                records=records,
            )
        )
    return out


def _device_order(device: Any) -> tuple[int, int]:
    return device.process_index, device.id


def _needed_twice(leaf: SavedLeaf, sharding: jax.sharding.Sharding) -> bool:
    """Whether some element is addressed by devices of more than one process.

    Only targets that span every process qualify (every process then takes part
    in the collective); others are read as before.
    """
    if len({_device_order(d)[0] for d in sharding.device_set}) != jax.process_count():
        return False
    owners: dict[Any, set[int]] = {}
    device: Any
    for device, index in sharding.devices_indices_map(leaf.shape).items():
        key = tuple((s.start, s.stop) for s in index) if index else ()
        owners.setdefault(key, set()).add(device.process_index)
    return any(len(p) > 1 for p in owners.values())


def _stream_records(
    leaf: SavedLeaf, records: Sequence[ChunkRecord]
) -> tuple[ChunkRecord, ...] | None:
    """The chunk records in grid order, if the chunks tile the array exactly."""
    shape, chunk = leaf.shape, leaf.chunk_shape
    if len(chunk) != len(shape) or any(d % c for d, c in zip(shape, chunk, strict=True)):
        return None
    by_key = {r.key: r for r in records}
    full = math.prod(chunk) * leaf.numpy_dtype.itemsize + TRAILER_BYTES
    out = []
    for index in itertools.product(*(range(d // c) for d, c in zip(shape, chunk, strict=True))):
        cell = tuple((i * c, (i + 1) * c) for i, c in zip(index, chunk, strict=True))
        record = by_key.get(chunk_key(cell, chunk))
        if record is None or record.size != full:
            return None  # the regular path reports it
        out.append(record)
    return tuple(out)


@dataclass(frozen=True)
class _Part:
    """Bytes ``[lo, hi)`` of one chunk's raw data, read by this process."""

    leaf: int  # index into the shared leaves
    chunk: int  # index into its records
    lo: int
    hi: int
    dst: int  # byte offset in this process's buffer

    def whole(self, record: ChunkRecord) -> bool:
        return self.lo == 0 and self.hi == record.size - TRAILER_BYTES


class Exchange:
    """Reads this process's parts of the shared leaves, checks them with every
    process, and runs the collective that gives each process its full data.

    Args:
      storage: the root's storage.
      loc: the step's location.
      shared: the result of :func:`plan` (the same on every process).
      agreement: the manager's agreement (its timeout bounds every wait here).
    """

    def __init__(
        self,
        storage: Storage,
        loc: StepLocation,
        shared: Sequence[SharedLeaf],
        agreement: Agreement,
    ) -> None:
        self._storage = storage
        self._loc = loc
        self._shared = list(shared)
        self._agreement = agreement
        self._buffers: list[np.ndarray] = []
        self._crcs: list[list[Any]] = []  # [leaf name, chunk key, lo, hi, crc] of parts
        self._where = f"{storage.uri.rstrip('/')}/{loc.arrays_prefix}"

    def read(self) -> None:
        """Reads this process's slices of every shared leaf.

        Raises:
          CorruptCheckpointError: a chunk read whole, or the trailer of one read in
            parts, does not match its record.
          StorageError: the store failed.
        """
        parts: list[_Part] = []
        for n, s in enumerate(self._shared):
            itemsize = s.leaf.numpy_dtype.itemsize
            devices = s.local_devices()
            lo = min(devices.start * s.slice_size, s.size)
            hi = min(devices.stop * s.slice_size, s.size)
            buffer = aligned_empty(len(devices) * s.slice_size * itemsize)
            buffer[(hi - lo) * itemsize :] = 0  # the padding of the last slices
            self._buffers.append(buffer)
            per_chunk = math.prod(s.leaf.chunk_shape)
            for c in range(lo // per_chunk, -(-hi // per_chunk)):
                a = max(lo, c * per_chunk) - c * per_chunk
                b = min(hi, (c + 1) * per_chunk) - c * per_chunk
                dst = (c * per_chunk + a - lo) * itemsize
                if b - a == per_chunk:  # a whole chunk: one object read, checked as it is
                    parts.append(_Part(n, c, 0, per_chunk * itemsize, dst))
                    continue
                start, stop = a * itemsize, b * itemsize
                for x in range(start, stop, PART_BYTES):
                    y = min(x + PART_BYTES, stop)
                    parts.append(_Part(n, c, x, y, dst + x - start))
        with pools.borrow("shared", _WORKERS) as pool:
            for part, crc in zip(parts, pool.map(self._read_part, parts), strict=True):
                if crc is not None:
                    s = self._shared[part.leaf]
                    key = s.records[part.chunk].key
                    self._crcs.append([s.leaf.name, key, part.lo, part.hi, crc])

    def _read_part(self, part: _Part) -> int | None:
        """Reads one part into its buffer; the CRC32C of a partial chunk read, else None."""
        s = self._shared[part.leaf]
        record = s.records[part.chunk]
        whole = part.whole(record)
        with_trailer = part.hi == record.size - TRAILER_BYTES
        size = part.hi - part.lo + (TRAILER_BYTES if with_trailer else 0)
        address = record.address(self._loc, s.leaf.name or "")
        if whole and address.whole:
            data = self._storage.read_buffer(address.key, record.size)
        else:
            data = self._storage.read_range(address.key, address.offset + part.lo, size)
        where = self._location(s, record)
        if data is None:
            raise CorruptCheckpointError(f"{where}: missing")
        view = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data
        if whole:
            problem = chunk_problem(data, record)
            if problem is not None:
                raise CorruptCheckpointError(f"{where}: {problem}")
        elif len(view) != size:
            raise CorruptCheckpointError(f"{where}: shorter than its recorded {record.size} bytes")
        elif with_trailer and bytes(view[-TRAILER_BYTES:]) != record.crc32c.to_bytes(
            TRAILER_BYTES, "little"
        ):
            raise CorruptCheckpointError(f"{where}: checksum trailer mismatch")
        raw = view[: part.hi - part.lo]
        buffer = self._buffers[part.leaf]
        buffer[part.dst : part.dst + len(raw)] = raw
        return None if whole else int(_crc32c.crc32c(raw.data))

    def _location(self, s: SharedLeaf, record: ChunkRecord) -> str:
        text = f"step {self._loc.step}: {s.leaf.path_text}: chunk {record.key} of "
        return text + f"{self._where}{s.leaf.name}" + record.inside()

    def settle(self, error: Exception | None) -> None:
        """Waits for every process's reads (bounded) and checks chunks read in parts.

        Every process must call it, with the error its own reads raised (if any).

        Raises:
          CorruptCheckpointError: on every process, when any process found a
            corrupt chunk or a chunk read in parts fails its checksum.
          CheckpointError: a process failed otherwise, or did not arrive within the
            agreement's timeout, or the processes planned different exchanges.
        """
        mine = {
            "plan": self._digest(),
            "error": None
            if error is None
            else [isinstance(error, CorruptCheckpointError), f"{type(error).__name__}: {error}"],
            "crcs": [] if error is not None else self._crcs,
        }
        reached("exchange_read", self._loc.step)  # crash tests kill a peer here
        try:
            everyone = self._agreement.gather("restore-exchange", mine)
        except CheckpointError as e:  # a peer is dead or stalled
            if error is not None:
                raise error from e
            raise CheckpointError(f"{self._describe()}: {e}") from e
        if error is not None:
            raise error
        me = jax.process_index()
        for p, theirs in enumerate(everyone):
            if theirs["error"] is not None:
                corrupt, text = theirs["error"]
                cls = CorruptCheckpointError if corrupt else CheckpointError
                raise cls(f"process {me}: process {p} could not read its part: {text}")
        if len({e["plan"] for e in everyone}) != 1:
            raise CheckpointError(
                f"step {self._loc.step} under {self._storage.uri}: the processes planned "
                "different exchanges of replicated leaves (did they restore the same target?)"
            )
        self._check_parts([c for e in everyone for c in e["crcs"]])

    def _digest(self) -> str:
        text = json.dumps(
            [[s.leaf.name, s.dtype.name, [d.id for d in s.devices]] for s in self._shared]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _check_parts(self, crcs: list[list[Any]]) -> None:
        parts: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
        for name, key, lo, hi, crc in crcs:
            parts.setdefault((name, key), []).append((lo, hi, crc))
        by_name = {s.leaf.name: s for s in self._shared}
        for (name, key), pieces in sorted(parts.items()):
            s = by_name[name]
            record = next(r for r in s.records if r.key == key)
            crc, end = 0, 0
            for lo, hi, part_crc in sorted(pieces):
                if lo != end:
                    raise CheckpointError(f"{self._location(s, record)}: parts do not meet")
                crc = crc32c_combine(crc, part_crc, hi - lo) if end else part_crc
                end = hi
            if end != record.size - TRAILER_BYTES or crc != record.crc32c:
                raise CorruptCheckpointError(
                    f"{self._location(s, record)}: checksum mismatch (read in parts)"
                )

    def run(self, timeout_s: float) -> dict[int, jax.Array]:
        """The shared leaves with their target shardings, by leaf index.

        Raises:
          CheckpointError: the collective failed, or did not finish within ``timeout_s``.
        """
        reached("exchange_settled", self._loc.step)  # crash tests kill a peer here
        groups: dict[tuple[Any, ...], list[int]] = {}
        for n, s in enumerate(self._shared):
            groups.setdefault(s.devices, []).append(n)
        out: dict[int, jax.Array] = {}
        for devices, members in groups.items():
            mesh = jax.sharding.Mesh(np.array(devices), ("s",))
            staging = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("s"))
            inputs = [self._staged(self._shared[n], staging) for n in members]
            fn = _reassemble(
                tuple(_Meta.of(self._shared[n]) for n in members),
                tuple(self._shared[n].sharding for n in members),
            )
            results = _collective(fn, inputs, timeout_s, self._describe())
            out.update({self._shared[n].index: r for n, r in zip(members, results, strict=True)})
        self._buffers.clear()
        return out

    def _staged(self, s: SharedLeaf, staging: jax.sharding.Sharding) -> jax.Array:
        flat = self._buffers[self._shared.index(s)].view(s.leaf.numpy_dtype)  # little-endian
        m = s.slice_size
        pieces = [
            jax.device_put(flat[k * m : (k + 1) * m], s.devices[j], may_alias=True)
            for k, j in enumerate(s.local_devices())
        ]
        return jax.make_array_from_single_device_arrays((len(s.devices) * m,), staging, pieces)

    def _describe(self) -> str:
        names = ", ".join(s.leaf.path_text for s in self._shared[:3])
        more = f" and {len(self._shared) - 3} more" if len(self._shared) > 3 else ""
        return (
            f"process {jax.process_index()}: step {self._loc.step} under {self._storage.uri}: "
            f"exchanging {names}{more}"
        )
