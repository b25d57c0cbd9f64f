"""Reading a committed step back: the tree record, the arrays, the target."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import tensorstore as ts

from jaxckpt.commit import Agreement, CommitProtocol, CommitReader
from jaxckpt.errors import CorruptCheckpointError, StorageError
from jaxckpt.formats import (
    PLAIN,
    ArrayWriter,
    DataFormat,
    Region,
    RegionRequest,
    check_chunks,
    format_named,
    full_region,
    plain_leaves,
    read_region,
    read_regions,
    region_of,
)
from jaxckpt.records import (
    PACK_UPLOADS,
    CheckedStep,
    ChunkRecord,
    CommitMarker,
    SavedLeaf,
    check_parts,
    flatten,
    manifest_name,
    parse_tree,
    path_str,
    read_checked,
    rebuild,
    unflatten_saved,
)
from jaxckpt.restoring._match import PathMap, check_casts, match_target
from jaxckpt.restoring._parts import missing_chunk, needed_processes
from jaxckpt.restoring._readonce import Exchange, plan
from jaxckpt.restoring._targets import (
    keep_weak_type,
    place_keys,
    resolve_targets,
    target_sharding,
    uncommitted,
)
from jaxckpt.storage import tensorstore_backed

if TYPE_CHECKING:
    from jaxckpt.tiers import Tier

log = logging.getLogger("jaxckpt")


@dataclass(frozen=True, kw_only=True)
class LoadedStep:
    """A committed step's records: marker, leaves, chunk manifest, user metadata."""

    marker: CommitMarker
    leaves: tuple[SavedLeaf, ...]
    chunks: Mapping[str, tuple[ChunkRecord, ...]]
    user_metadata: Any
    versions: Mapping[str, str] = field(default_factory=dict)
    layout: str = PLAIN.name
    """The step's data format by name (:data:`jaxckpt.formats.FORMATS`)."""
    plain_codecs: bool = False
    """Every manifest part says its arrays use jaxckpt's codec chain (``ManifestPart``)."""
    process_states: Mapping[int, Any] = field(default_factory=dict)
    """The ``process_state`` records of the parts read, by process (see ``_procstate``)."""
    structure: Any = None
    """The saved containers (``_tree.structure_of``); None in older records."""

    @property
    def format(self) -> DataFormat:
        """The step's data format (:mod:`jaxckpt.formats`)."""
        return format_named(self.layout)

    @property
    def raw_chunks(self) -> bool:
        """Every chunk is raw bytes plus a CRC32C trailer (no ``zarr.json`` need be read)."""
        return self.format.raw_chunks or self.plain_codecs


def load_step(protocol: CommitReader, marker: CommitMarker) -> LoadedStep:
    """Reads and checks the tree record and every manifest part of a step."""
    return _loaded(marker, read_checked(protocol, marker))


def _loaded(marker: CommitMarker, step: CheckedStep) -> LoadedStep:
    return LoadedStep(
        marker=marker,
        leaves=step.tree.leaves,
        chunks=step.chunks,
        user_metadata=step.tree.metadata,
        versions=step.tree.versions,
        layout=step.layout,
        plain_codecs=step.plain_codecs,
        structure=step.tree.structure,
        process_states=step.process_states,
    )


class StepRecords:
    """A committed step's records as a restore reads them: the tree record and this
    process's own part at once, other parts only where its target needs their chunks
    (see ``_parts``). A marker covering only some parts (a local tier's) has all read."""

    def __init__(self, protocol: CommitProtocol, marker: CommitMarker) -> None:
        self.protocol, self.marker = protocol, marker
        own = manifest_name(jax.process_index())
        several = marker.every_process and marker.num_processes > 1
        first = [own] if several and marker.covers(own) else None
        self._names = first
        raw, parts = protocol.read_step(marker, parts=first)
        assert raw is not None
        self.tree = parse_tree(raw, protocol.where(marker.location.tree_key), step=marker.step)
        self._parts = {n: p for n, p in zip(first or marker.manifest_names(), parts, strict=True)}
        self.loaded = self._check()

    @property
    def complete(self) -> bool:
        """Every part the marker covers has been read."""
        return self._names is None

    @property
    def leaves(self) -> tuple[SavedLeaf, ...]:
        return self.tree.leaves

    def need(self, processes: set[int] | None) -> LoadedStep:
        """The step with the parts of ``processes`` read as well (None: every part)."""
        if self.complete:
            return self.loaded
        names = None if processes is None else [manifest_name(p) for p in sorted(processes)]
        unread = None if names is None else [n for n in names if n not in self._parts]
        if unread == []:
            return self.loaded
        if unread is not None and not all(self.marker.covers(n) for n in unread):
            unread = None  # a process the step does not have: another topology
        _, parts = self.protocol.read_step(self.marker, tree=False, parts=unread)
        if unread is None:
            self._parts, self._names = (
                dict(zip(self.marker.manifest_names(), parts, strict=True)),
                None,
            )
        else:
            self._parts.update(zip(unread, parts, strict=True))
            self._names = [*(self._names or []), *unread]
        self.loaded = self._check()
        return self.loaded

    def _check(self) -> LoadedStep:
        parts = list(self._parts.values())
        checked = check_parts(self.protocol, self.marker, self.tree, parts, complete=self.complete)
        return _loaded(self.marker, checked)


def tier_reader(tier: Tier) -> StepReader:
    """A reader of ``tier``'s committed steps (through its arrays and TensorStore context)."""
    return StepReader(
        tier.protocol, tier.arrays, tier.context, reads_in_flight=tier.reads_in_flight
    )


class StepReader:
    """Restores leaves of committed steps, checking every chunk it reads."""

    def __init__(
        self,
        protocol: CommitProtocol,
        arrays: ArrayWriter,
        context: ts.Context,
        *,
        reads_in_flight: int = PACK_UPLOADS,
    ) -> None:
        self._protocol = protocol
        self._arrays = arrays
        self._context = context
        self._reads_in_flight = reads_in_flight

    def restore(
        self,
        records: StepRecords,
        target: Any = None,
        *,
        partial: bool = False,
        rename: PathMap | None = None,
        agreement: Agreement | None = None,
        allow_lossy_cast: bool = False,
    ) -> Any:
        """The step's values; with a target, only the leaves it names are read.

        With an ``agreement`` on several processes this is collective: leaves that
        several processes need are read once in total and exchanged (``_replicated``).
        Only the manifest parts that list chunks this process needs are read (see
        ``_parts``).

        Raises:
          TreeMismatchError: the target does not match, or converts an array to a
            dtype that cannot hold its values (``lossy_cast``) and not ``allow_lossy_cast``.
          CorruptCheckpointError: a chunk it needs is in no manifest part.
        """
        leaves = records.leaves
        if target is None:
            if partial or rename is not None:
                raise ValueError("partial= and rename= need a target")
            loaded = records.need(None)  # every leaf read whole
            values = self._read_all(loaded, list(leaves), [None] * len(leaves), agreement)
            if loaded.structure is not None:  # every container, empty ones included
                return rebuild(loaded.structure, values)
            return unflatten_saved(leaves, values)
        flat, treedef = flatten(target)
        targets = [t for _, t in flat]
        paths = [path_str(p) for p, _ in flat]
        matched = match_target(leaves, paths, targets, partial=partial, rename=rename)
        targets = resolve_targets(paths, matched, targets)
        if not allow_lossy_cast:
            check_casts(matched, paths, targets)
        loaded = _needed(records, matched, targets, collective=_collective(agreement))
        with np.errstate(over="ignore", invalid="ignore"):  # consented to: inf, wrapped ints
            values = self._read_all(loaded, matched, targets, agreement)
        values = [keep_weak_type(t, v) for t, v in zip(targets, values, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, values)

    def _read_all(
        self,
        loaded: LoadedStep,
        leaves: Sequence[SavedLeaf],
        targets: Sequence[Any],
        agreement: Agreement | None = None,
    ) -> list[Any]:
        plain, shared = None, {}
        if agreement is not None and jax.process_count() > 1:
            plain = self.plain_names(loaded, [x for x in leaves if x.name is not None])
            shared = {
                s.index: s
                for s in plan(
                    leaves,
                    [target_sharding(t) for t in targets],
                    [getattr(t, "dtype", None) for t in targets],
                    loaded.chunks,
                    plain,
                )
            }
        plans: list[dict[Any, Region] | None] = []
        requests: list[RegionRequest] = []
        for i, (leaf, target) in enumerate(zip(leaves, targets, strict=True)):
            if leaf.kind == "value" or leaf.name is None or i in shared:
                plans.append(None)
                continue
            regions = _regions_for(leaf, target)
            plans.append(regions)
            requests.extend(
                RegionRequest(leaf=leaf, region=r) for r in sorted(set(regions.values()))
            )
        if not shared:
            arrays = self.read(loaded, requests, plain=plain)
        else:  # collective: every process settles, then exchanges
            assert agreement is not None
            exchange = Exchange(
                self._protocol.storage, loaded.marker.location, list(shared.values()), agreement
            )
            error: Exception | None = None
            try:
                arrays = self.read(loaded, requests, plain=plain)
                exchange.read()
            except Exception as e:  # the others must learn of it, not wait for it
                error = e
            exchange.settle(error)
            exchanged = exchange.run(agreement.timeout_s)
        data = {(r.leaf.name, r.region): a for r, a in zip(requests, arrays, strict=True)}
        values: list[Any] = []
        placed: dict[int, _Placement] = {}  # their pieces go to devices in one device_put
        for i, (leaf, target, layout) in enumerate(zip(leaves, targets, plans, strict=True)):
            sharding = target_sharding(target)
            if i in shared:
                values.append(exchanged[i])
            elif layout is None:
                values.append(leaf.value)
            elif leaf.kind == "key" or sharding is None:  # read whole
                values.append(_assemble(leaf, target, data[(leaf.name, layout[None])]))
            else:
                values.append(None)
                dtype = np.dtype(getattr(target, "dtype", leaf.numpy_dtype))
                placed[i] = _Placement(leaf, sharding, dtype, layout, not uncommitted(target))
        for i, array in zip(placed, _to_devices(list(placed.values()), data), strict=True):
            values[i] = array
        return values

    def plain_names(self, loaded: LoadedStep, leaves: Iterable[SavedLeaf]) -> set[str]:
        """Names of ``leaves`` stored with jaxckpt's plain codec chain (read chunk by chunk).

        Every leaf of a packed step is (its chunks have the plain chain's bytes),
        and of a step whose manifest parts all say so; otherwise each leaf's
        ``zarr.json`` is read.
        """
        if loaded.raw_chunks:
            return {leaf.name for leaf in leaves if leaf.name is not None}
        kv = ts.KvStore.open(
            tensorstore_backed(self._protocol.storage).kvstore_spec(
                loaded.marker.location.arrays_prefix
            ),
            context=self._context,
        ).result()
        return plain_leaves(kv, list(leaves))

    def read(
        self,
        loaded: LoadedStep,
        requests: Sequence[RegionRequest],
        *,
        plain: set[str] | None = None,
        window_bytes: int = 512 << 20,
    ) -> list[np.ndarray]:
        """Reads regions of array leaves, checking every chunk; one array per request.

        Plain arrays are read straight from their chunk objects (``read_regions``);
        others (e.g. zstd archives) through TensorStore.

        Args:
          plain: the result of :meth:`plain_names` for these leaves, if known.
          window_bytes: the most chunk bytes read ahead on the plain path.
        """
        loc = loaded.marker.location
        leaves = {r.leaf.name: r.leaf for r in requests}
        if plain is None:
            plain = self.plain_names(loaded, leaves.values())
        stores = {
            name: self._arrays.open(loc, leaf, create=False)
            for name, leaf in leaves.items()
            if name not in plain
        }
        slow = {
            i: read_region(self._opened(loaded, r.leaf, stores[r.leaf.name]), r.region)
            for i, r in enumerate(requests)
            if r.leaf.name not in plain
        }
        fast = [i for i, r in enumerate(requests) if r.leaf.name in plain]
        fast_data = read_regions(
            self._protocol.storage,
            loc,
            [requests[i] for i in fast],
            loaded.chunks,
            window_bytes=window_bytes,
            workers=self._reads_in_flight,
        )
        out: dict[int, np.ndarray] = dict(zip(fast, fast_data, strict=True))
        for i, future in slow.items():
            try:
                out[i] = np.asarray(future.result())
            except ValueError as e:
                out[i] = self._read_again(loaded, requests[i], e)
        return [out[i] for i in range(len(requests))]

    def _opened(self, loaded: LoadedStep, leaf: SavedLeaf, future: Any) -> ts.TensorStore:
        """An opened array; a failed open is tried once more (see ``_read_again``)."""
        try:
            return future.result()
        except ValueError as e:
            first = e
        try:
            return self._arrays.open(loaded.marker.location, leaf, create=False).result()
        except ValueError as e:
            raise self._diagnose(loaded, leaf, e) from first

    def _read_again(self, loaded: LoadedStep, request: RegionRequest, first: Exception) -> Any:
        """A region whose TensorStore read failed, read once more before it is diagnosed.

        A byte flipped in transit fails a chunk's CRC32C (``DATA_LOSS``) once, not
        again; stored damage fails again and is named by :meth:`_diagnose`.
        """
        leaf = request.leaf
        store = self._opened(
            loaded, leaf, self._arrays.open(loaded.marker.location, leaf, create=False)
        )
        try:
            data = np.asarray(read_region(store, request.region).result())
        except ValueError as e:
            raise self._diagnose(loaded, leaf, e) from first
        log.warning(
            "step %d: %s failed once (%s), read again intact: a transfer error, not damage",
            loaded.marker.step,
            leaf.path_text,
            first,
        )
        return data

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


def _collective(agreement: Agreement | None) -> bool:
    return agreement is not None and jax.process_count() > 1


def _needed(
    records: StepRecords, leaves: Sequence[SavedLeaf], targets: Sequence[Any], *, collective: bool
) -> LoadedStep:
    """The step with every part read that lists chunks this process needs: the writers'
    of its regions on the saved topology; else (another one) every part.

    Raises:
      CorruptCheckpointError: a chunk it needs is in no part.
    """
    marker = records.marker
    needed = needed_processes(leaves, targets, marker.num_processes, collective=collective)
    loaded = records.need(needed)
    missing = missing_chunk(loaded.chunks, leaves, targets, collective=collective)
    if missing is not None and not records.complete:  # saved on another topology
        loaded = records.need(None)
        missing = missing_chunk(loaded.chunks, leaves, targets, collective=collective)
    if missing is not None:
        leaf, key = missing
        raise CorruptCheckpointError(
            f"step {marker.step}: {leaf.path_text}: chunk {key} of "
            f"{records.protocol.where(marker.location.array_prefix(leaf.name or ''))} is in "
            "no manifest part the marker covers"
        )
    return loaded


def _regions_for(leaf: SavedLeaf, target: Any) -> dict[Any, Region]:
    """The regions to read: one per addressable device, or the whole array."""
    sharding = target_sharding(target)
    if sharding is None or leaf.kind == "key":
        return {None: full_region(leaf.shape)}
    index_map = sharding.addressable_devices_indices_map(leaf.shape)
    return {device: region_of(index or (), leaf.shape) for device, index in index_map.items()}


def _assemble(leaf: SavedLeaf, target: Any, array: np.ndarray) -> Any:
    """A key leaf (on the target's sharding, if it has one), or a numpy array (no sharding)."""
    if leaf.kind == "key":
        return place_keys(leaf, target, array)
    array = array.astype(np.dtype(getattr(target, "dtype", leaf.numpy_dtype)), copy=False)
    array.flags.writeable = False  # often a view of the read buffer: read-only, always
    return array


@dataclass(frozen=True)
class _Placement:
    """A leaf restored onto a sharded target: its pieces' regions by device."""

    leaf: SavedLeaf
    sharding: jax.sharding.Sharding
    dtype: np.dtype
    layout: dict[Any, Region]
    committed: bool = True
    """False: an uncommitted array on the default device (the target was uncommitted)."""


def _to_devices(
    items: Sequence[_Placement], data: Mapping[tuple[str | None, Region], np.ndarray]
) -> list[jax.Array]:
    """Global arrays of sharded targets, every leaf's pieces put on their devices in one call.

    One batched ``device_put`` for all leaves costs a fraction of one call per
    leaf (1,000 small leaves: the per-call dispatch dominated the restore's
    own CPU time). ``may_alias``: on CPU an aligned read buffer becomes the
    array, no copy.
    """
    hosts = [
        data[(p.leaf.name, region)].astype(p.dtype, copy=False)
        for p in items
        for region in p.layout.values()
    ]
    devices = [device if p.committed else None for p in items for device in p.layout]
    pieces = iter(jax.device_put(hosts, devices, may_alias=True))
    arrays = []
    for p in items:
        mine = [next(pieces) for _ in p.layout]
        if len(mine) == 1 and (mine[0].sharding == p.sharding or not p.committed):
            arrays.append(mine[0])  # already the whole array, as the target wants it
        else:
            arrays.append(jax.make_array_from_single_device_arrays(p.leaf.shape, p.sharding, mine))
    return arrays
