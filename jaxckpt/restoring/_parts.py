"""Which manifest parts a restoring process reads: its own, and those of the writers of
the chunks it needs, never every part on every host.

A chunk's writer is the process holding its shard's ``replica_id == 0`` copy:
for a sharding, the process of the first device in ``devices_indices_map``
order with that index (how JAX numbers replicas). Restoring onto the sharding a
leaf was saved with (the same topology), a process needs the parts of the
writers of the shards it addresses (itself, for a sharded leaf) and, for a
leaf several processes address (replicated: read once and exchanged, see
``_readonce``) or read whole (a PRNG key), the writers of every shard. Onto
another topology those guesses may miss chunks: :func:`missing_chunk` finds
that, and the reader then reads every part (as before), only the data that
overlaps its target. A chunk still missing then is corruption, never zeros.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jaxckpt.formats import Region, full_region, region_of
from jaxckpt.records import ChunkRecord, SavedLeaf
from jaxckpt.restoring._targets import target_sharding


@functools.lru_cache(maxsize=1024)
def _writers(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """Per shard index of ``sharding`` over ``shape``: ``(index, writer, processes)``, the
    writer being the process of its ``replica_id == 0`` device."""
    found: dict[Any, tuple[int, set[int]]] = {}
    device: Any
    for device, index in sharding.devices_indices_map(shape).items():
        key = tuple((s.start, s.stop, s.step) for s in index) if index else ()
        found.setdefault(key, (device.process_index, set()))[1].add(device.process_index)
    return tuple((k, w, frozenset(p)) for k, (w, p) in found.items())


def _read_shape(leaf: SavedLeaf) -> tuple[int, ...]:
    """The shape a target's sharding is for (a key leaf's: its key shape)."""
    return tuple(leaf.shape[:-1]) if leaf.kind == "key" else tuple(leaf.shape)


def whole(leaf: SavedLeaf, sharding: jax.sharding.Sharding | None, collective: bool) -> bool:
    """Whether this process needs every chunk of ``leaf``: read whole (no sharding, a key)
    or, in a ``collective`` restore, addressed by several processes (then possibly read
    once and exchanged: every process plans it from every chunk's record)."""
    if sharding is None or leaf.kind == "key":
        return True
    return collective and any(len(p) > 1 for _, _, p in _writers(sharding, _read_shape(leaf)))


def needed_processes(
    leaves: Sequence[SavedLeaf], targets: Sequence[Any], num_processes: int, *, collective: bool
) -> set[int] | None:
    """The processes whose parts hold the chunks this process needs to restore ``leaves``
    onto ``targets``, if they were saved with these shardings; None: every part (a leaf
    read whole without a sharding, or a job of another size)."""
    me = jax.process_index()
    if jax.process_count() != num_processes:
        return None
    needed = {me}
    for leaf, target in zip(leaves, targets, strict=True):
        if leaf.kind == "value" or leaf.name is None:
            continue
        sharding = target_sharding(target)
        if sharding is None:
            return None
        writers = _writers(sharding, _read_shape(leaf))
        if whole(leaf, sharding, collective):
            needed.update(w for _, w, _ in writers)
        else:
            needed.update(w for _, w, p in writers if me in p)
    return needed


def missing_chunk(
    chunks: Mapping[str, Sequence[ChunkRecord]],
    leaves: Sequence[SavedLeaf],
    targets: Sequence[Any],
    *,
    collective: bool,
) -> tuple[SavedLeaf, str] | None:
    """The first leaf and chunk key this process needs that ``chunks`` does not list."""
    for leaf, target in zip(leaves, targets, strict=True):
        if leaf.kind == "value" or leaf.name is None or any(d == 0 for d in leaf.shape):
            continue
        sharding = target_sharding(target)
        listed = {c.key for c in chunks.get(leaf.name, ())}
        if whole(leaf, sharding, collective):
            regions: list[Region] = [full_region(leaf.shape)]
        else:
            assert sharding is not None
            index_map = sharding.addressable_devices_indices_map(leaf.shape)
            regions = sorted({region_of(i or (), leaf.shape) for i in index_map.values()})
        for region in regions:
            if not math.prod(hi - lo for lo, hi in region):
                continue
            ranges = [
                range(lo // c, -(-hi // c))
                for (lo, hi), c in zip(region, leaf.chunk_shape, strict=True)
            ]
            for index in itertools.product(*ranges):  # the chunks overlapping the region
                key = "/".join(["c", *map(str, index)])
                if key not in listed:
                    return leaf, key
    return None
