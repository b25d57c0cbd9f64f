"""Reading a committed step back: the tree record, the arrays, the target."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from jaxckpt._chunkread import RegionRequest, plain_leaves, read_regions
from jaxckpt._commit import CommitProtocol
from jaxckpt._layout import TREE_FILE
from jaxckpt._records import ChunkRecord, CommitMarker
from jaxckpt._tree import (
    PathMap,
    SavedLeaf,
    flatten,
    match_target,
    path_str,
    unflatten_saved,
)
from jaxckpt._tsio import ArrayWriter, Region, check_chunks, full_region, read_region, region_of
from jaxckpt.errors import CorruptCheckpointError, StorageError


@dataclass(frozen=True, kw_only=True)
class LoadedStep:
    """A committed step's records: marker, leaves, chunk manifest, user metadata."""

    marker: CommitMarker
    leaves: tuple[SavedLeaf, ...]
    chunks: Mapping[str, tuple[ChunkRecord, ...]]
    user_metadata: Any
    versions: Mapping[str, str] = field(default_factory=dict)


def load_step(protocol: CommitProtocol, marker: CommitMarker) -> LoadedStep:
    """Reads and checks the tree record and every manifest part of a step."""
    tree = json.loads(protocol.read_step_file(marker, TREE_FILE))
    chunks: dict[str, list[ChunkRecord]] = {}
    for part in protocol.read_manifest(marker):
        for name, records in part.arrays.items():
            chunks.setdefault(name, []).extend(records)
    return LoadedStep(
        marker=marker,
        leaves=tuple(SavedLeaf.from_json(x) for x in tree["leaves"]),
        chunks={k: tuple(v) for k, v in chunks.items()},
        user_metadata=tree.get("metadata"),
        versions=tree.get("versions") or {},
    )


class StepReader:
    """Restores leaves of committed steps, checking every chunk it reads."""

    def __init__(self, protocol: CommitProtocol, arrays: ArrayWriter, context: ts.Context) -> None:
        self._protocol = protocol
        self._arrays = arrays
        self._context = context

    def restore(
        self,
        loaded: LoadedStep,
        target: Any = None,
        *,
        partial: bool = False,
        rename: PathMap | None = None,
    ) -> Any:
        """The step's values; with a target, only the leaves it names are read."""
        leaves = loaded.leaves
        if target is None:
            if partial or rename is not None:
                raise ValueError("partial= and rename= need a target")
            values = self._read_all(loaded, list(leaves), [None] * len(leaves))
            return unflatten_saved(leaves, values)
        flat, treedef = flatten(target)
        targets = [t for _, t in flat]
        paths = [path_str(p) for p, _ in flat]
        matched = match_target(leaves, paths, targets, partial=partial, rename=rename)
        values = self._read_all(loaded, matched, targets)
        return jax.tree_util.tree_unflatten(treedef, values)

    def _read_all(
        self, loaded: LoadedStep, leaves: Sequence[SavedLeaf], targets: Sequence[Any]
    ) -> list[Any]:
        loc = loaded.marker.location
        arrays = [leaf for leaf in leaves if leaf.kind != "value" and leaf.name is not None]
        kv = ts.KvStore.open(
            self._protocol.storage.kvstore_spec(loc.arrays_prefix), context=self._context
        ).result()
        plain = plain_leaves(kv, arrays)
        stores = {
            leaf.name: self._arrays.open(loc, leaf, create=False)
            for leaf in arrays
            if leaf.name not in plain
        }
        plans: list[tuple[dict[Any, Region], dict[Region, Any]] | None] = []
        requests: list[RegionRequest] = []
        for leaf, target in zip(leaves, targets, strict=True):
            if leaf.kind == "value" or leaf.name is None:
                plans.append(None)
                continue
            regions = _regions_for(leaf, target)
            unique = sorted(set(regions.values()))
            if leaf.name in plain:
                requests.extend(RegionRequest(leaf=leaf, region=r) for r in unique)
                plans.append((regions, {}))
            else:
                store = self._opened(loaded, leaf, stores[leaf.name])
                plans.append((regions, {r: read_region(store, r) for r in unique}))
        fast = read_regions(self._protocol.storage, loc, requests, loaded.chunks)
        fast_data = {(r.leaf.name, r.region): a for r, a in zip(requests, fast, strict=True)}
        values = []
        for leaf, target, plan in zip(leaves, targets, plans, strict=True):
            if plan is None:
                values.append(leaf.value)
                continue
            regions, reads = plan
            if leaf.name in plain:
                data = {r: fast_data[(leaf.name, r)] for r in set(regions.values())}
            else:
                try:
                    data = {r: np.asarray(f.result()) for r, f in reads.items()}
                except ValueError as e:
                    raise self._diagnose(loaded, leaf, e) from e
            values.append(_assemble(leaf, target, regions, data))
        return values

    def _opened(self, loaded: LoadedStep, leaf: SavedLeaf, future: Any) -> ts.TensorStore:
        try:
            return future.result()
        except ValueError as e:
            raise self._diagnose(loaded, leaf, e) from e

    def _diagnose(self, loaded: LoadedStep, leaf: SavedLeaf, exc: Exception) -> Exception:
        step = loaded.marker.step
        where = self._protocol.where(loaded.marker.location.array_prefix(leaf.name or ""))
        bad = [
            (chunk, problem)
            for chunk, problem, _ in check_chunks(
                self._protocol.storage,
                self._context,
                loaded.marker.location,
                leaf,
                loaded.chunks.get(leaf.name or "", ()),
            )
            if problem is not None
        ]
        if bad:
            chunk, problem = bad[0]
            more = f" (and {len(bad) - 1} more chunks)" if len(bad) > 1 else ""
            return CorruptCheckpointError(
                f"step {step}: {leaf.path_text}: chunk {chunk.key} of {where}: {problem}{more}"
            )
        text = str(exc)
        if "DATA_LOSS" in text or "NOT_FOUND" in text or "FAILED_PRECONDITION" in text:
            return CorruptCheckpointError(f"step {step}: {leaf.path_text} ({where}): {text}")
        return StorageError(f"step {step}: cannot read {leaf.path_text} ({where}): {text}")


def _target_sharding(target: Any) -> jax.sharding.Sharding | None:
    if isinstance(target, jax.Array):
        return target.sharding
    if isinstance(target, jax.ShapeDtypeStruct):
        return target.sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return None


def _regions_for(leaf: SavedLeaf, target: Any) -> dict[Any, Region]:
    """The regions to read: one per addressable device, or the whole array."""
    sharding = _target_sharding(target)
    if sharding is None or leaf.kind == "key":
        return {None: full_region(leaf.shape)}
    index_map = sharding.addressable_devices_indices_map(leaf.shape)
    return {device: region_of(index or (), leaf.shape) for device, index in index_map.items()}


def _assemble(
    leaf: SavedLeaf, target: Any, regions: dict[Any, Region], data: dict[Region, np.ndarray]
) -> Any:
    target_dtype = (
        np.dtype(getattr(target, "dtype", leaf.numpy_dtype)) if leaf.kind != "key" else None
    )
    if leaf.kind == "key":
        keys = jax.random.wrap_key_data(jax.numpy.asarray(data[regions[None]]), impl=leaf.key_impl)
        sharding = _target_sharding(target)
        return jax.device_put(keys, sharding) if sharding is not None else keys
    sharding = _target_sharding(target)
    if sharding is None:
        array = data[regions[None]]
        if target_dtype is not None:
            array = array.astype(target_dtype, copy=False)
        array.flags.writeable = False  # often a view of the read buffer: read-only, always
        return array
    pieces = [  # may_alias: on CPU an aligned read buffer becomes the array, no copy
        jax.device_put(data[region].astype(target_dtype, copy=False), device, may_alias=True)
        for device, region in regions.items()
    ]
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, pieces)
