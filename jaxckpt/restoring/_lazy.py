"""Lazy reading of one committed step: one leaf, or a slice of it, without the rest.

:func:`open_step` reads the step's records (commit marker, tree record, chunk
manifest) and nothing else; indexing a leaf reads only the chunks that overlap
the requested region, each checked against its manifest CRC32C, through the
same chunk reader as :meth:`jaxckpt.CheckpointManager.restore`. It works on
every backend (local, ``gs://``, ``s3://``).

Leaves are addressed by their *dotted path* (``params.dense.kernel``: the tree
path's keys joined by dots, the tensor names ``jaxckpt export`` writes), by the
``jax.tree_util.keystr`` form (``['params']['dense']['kernel']``) or by the
zarr array name.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxckpt.commit import CommitReader
from jaxckpt.errors import StepNotFoundError
from jaxckpt.formats import Region, RegionRequest
from jaxckpt.records import SavedLeaf
from jaxckpt.restoring._stepreader import LoadedStep, load_step, tier_reader
from jaxckpt.storage import open_storage
from jaxckpt.tiers import reading_tier

__all__ = ["LeafView", "StepView", "dotted_path", "open_step"]

DEFAULT_BLOCK_BYTES = 64 << 20


def dotted_path(leaf: SavedLeaf) -> str:
    """The leaf's tree path keys joined by dots: ``params.dense.kernel``, ``layers.0.w``."""
    return ".".join(str(key) for _, key in leaf.path) or (leaf.name or "root")


@dataclass(frozen=True)
class _Index:
    """A numpy basic index split into a region to read and an index into that region."""

    region: Region
    then: tuple[Any, ...]


def _parse_index(index: Any, shape: Sequence[int], what: str) -> _Index:
    """Turns ints, slices and ``...`` into the bounding region and a residual index.

    Raises:
      IndexError: an index numpy would refuse (out of range, too many axes,
        arrays or ``None``), naming the leaf.
    """
    items = index if isinstance(index, tuple) else (index,)
    if sum(1 for i in items if i is Ellipsis) > 1:
        raise IndexError(f"{what}: an index can only have a single ellipsis")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = len(shape) - (len(items) - 1)
        items = items[:at] + (slice(None),) * max(fill, 0) + items[at + 1 :]
    if len(items) > len(shape):
        raise IndexError(f"{what}: {len(items)} indices for an array of {len(shape)} dimensions")
    items = items + (slice(None),) * (len(shape) - len(items))
    region: list[tuple[int, int]] = []
    then: list[Any] = []
    for axis, (item, size) in enumerate(zip(items, shape, strict=True)):
        if isinstance(item, slice):
            start, stop, step = item.indices(size)
            if step > 0:
                lo, hi = start, max(start, stop)
                region.append((lo, hi))
                then.append(slice(None, None, step))
            else:  # read the axis, let numpy reverse it
                region.append((0, size))
                then.append(item)
        elif isinstance(item, int | np.integer) and not isinstance(item, bool):
            i = int(item) + size if item < 0 else int(item)
            if not 0 <= i < size:
                raise IndexError(
                    f"{what}: index {int(item)} is out of bounds for axis {axis} with size {size}"
                )
            region.append((i, i + 1))
            then.append(0)
        else:
            raise IndexError(
                f"{what}: only integers, slices and ... are supported, got {item!r}; "
                "read the slice first, then index the numpy array"
            )
    return _Index(region=tuple(region), then=tuple(then))


class LeafView:
    """One array leaf of a committed step; indexing it reads only what is asked for.

    >>> import tempfile, numpy as np, jaxckpt
    >>> root = tempfile.mkdtemp()
    >>> with jaxckpt.CheckpointManager(root) as mgr:
    ...     mgr.save(7, {"params": {"w": np.arange(12.0).reshape(3, 4)}})
    True
    >>> w = jaxckpt.open_step(root)["params.w"]
    >>> w.shape, w.dtype, w[1, 2:]
    ((3, 4), dtype('float64'), array([6., 7.]))
    """

    def __init__(self, step: StepView, leaf: SavedLeaf) -> None:
        self._step = step
        self.leaf = leaf

    @property
    def path(self) -> str:
        """The dotted path, e.g. ``params.dense.kernel``."""
        return dotted_path(self.leaf)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.leaf.shape

    @property
    def dtype(self) -> np.dtype:
        """The stored numpy dtype (``bfloat16`` via ml_dtypes; key data for PRNG keys)."""
        return self.leaf.numpy_dtype

    @property
    def ndim(self) -> int:
        return len(self.leaf.shape)

    @property
    def size(self) -> int:
        return math.prod(self.leaf.shape)

    @property
    def nbytes(self) -> int:
        return self.leaf.nbytes

    def __repr__(self) -> str:
        return f"LeafView({self.path!r}, shape={self.shape}, dtype={self.leaf.dtype})"

    def __getitem__(self, index: Any) -> np.ndarray:
        parsed = _parse_index(index, self.shape, f"step {self._step.step}: {self.path}")
        data = self._step.read_region(self.leaf, parsed.region)
        return np.asarray(data[parsed.then])

    def read_region(self, region: Region) -> np.ndarray:
        """Reads ``region`` (``(start, stop)`` per axis), checking every chunk."""
        return self._step.read_region(self.leaf, region)

    def read(self) -> np.ndarray:
        """The whole array."""
        return self[...]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        data = self.read()
        return data if dtype is None else data.astype(dtype)

    def blocks(self, max_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[np.ndarray]:
        """The array in row-major order, as consecutive blocks along the first axis.

        Each block is a whole number of chunk rows and at most ``max_bytes``
        unless one chunk row is larger, so reading a leaf this way holds about
        ``max(max_bytes, one chunk row)`` in memory. Concatenating the blocks'
        bytes gives the array's C-order bytes. A 0-d array is one block; a
        zero-size array yields nothing.
        """
        for region in self.block_regions(max_bytes):
            yield self._step.read_region(self.leaf, region)

    def block_regions(self, max_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[Region]:
        """The regions :meth:`blocks` reads."""
        shape = self.shape
        if not shape:
            yield ()
            return
        if self.size == 0:
            return
        row_bytes = self.nbytes // shape[0]
        unit = self.leaf.chunk_shape[0] if self.leaf.chunk_shape else 1
        rows = max(unit, (max_bytes // max(row_bytes * unit, 1)) * unit)
        rest = tuple((0, d) for d in shape[1:])
        for lo in range(0, shape[0], rows):
            yield ((lo, min(lo + rows, shape[0])), *rest)


class StepView:
    """A committed step opened for lazy reading; see :func:`open_step`."""

    def __init__(self, protocol: CommitReader, loaded: LoadedStep) -> None:
        self._protocol = protocol
        self._loaded = loaded
        self._reader = tier_reader(reading_tier(protocol.storage))
        self._plain: set[str] | None = None
        self._lock = threading.Lock()
        self._by_key: dict[str, SavedLeaf] = {}
        self.window_bytes = DEFAULT_BLOCK_BYTES
        """The most chunk bytes a read holds ahead (object stores); a budgeted export lowers it."""
        for leaf in loaded.leaves:
            for key in (dotted_path(leaf), leaf.path_text, leaf.name):
                if key is not None:
                    self._by_key.setdefault(key, leaf)

    @property
    def root(self) -> str:
        return self._protocol.storage.uri

    @property
    def step(self) -> int:
        return self._loaded.marker.step

    @property
    def loaded(self) -> LoadedStep:
        """The step's checked records: marker, leaves, chunk manifest."""
        return self._loaded

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self._loaded.marker.metrics)

    @property
    def commit_time(self) -> float:
        return self._loaded.marker.time

    @property
    def metadata(self) -> Any:
        """The user metadata saved with the step."""
        return self._loaded.user_metadata

    @property
    def leaves(self) -> tuple[SavedLeaf, ...]:
        return self._loaded.leaves

    def paths(self) -> list[str]:
        """Dotted paths of every leaf (arrays, keys and values), in tree order."""
        return [dotted_path(leaf) for leaf in self._loaded.leaves]

    def leaf(self, path: str) -> SavedLeaf:
        """The saved leaf at ``path`` (dotted, keystr or array name).

        Raises:
          KeyError: no such leaf; the message lists a few that exist.
        """
        leaf = self._by_key.get(path)
        if leaf is None:
            known = self.paths()
            more = f", ... ({len(known)} leaves)" if len(known) > 8 else ""
            raise KeyError(
                f"step {self.step} of {self.root} has no leaf {path!r}; "
                f"leaves: {', '.join(known[:8])}{more}"
            )
        return leaf

    def __getitem__(self, path: str) -> Any:
        """A :class:`LeafView` for an array leaf, the value itself for a value leaf."""
        leaf = self.leaf(path)
        return leaf.value if leaf.kind == "value" else LeafView(self, leaf)

    def __contains__(self, path: object) -> bool:
        return isinstance(path, str) and path in self._by_key

    def arrays(self) -> list[LeafView]:
        """Every array leaf (PRNG keys as their key data), in tree order."""
        return [LeafView(self, leaf) for leaf in self._loaded.leaves if leaf.kind != "value"]

    def read_region(self, leaf: SavedLeaf, region: Region) -> np.ndarray:
        """Reads ``region`` of ``leaf``, checking each chunk against the manifest."""
        return self.read_regions([(leaf, region)])[0]

    def read_regions(self, items: Sequence[tuple[SavedLeaf, Region]]) -> list[np.ndarray]:
        """Reads several regions at once (their chunks are fetched concurrently)."""
        with self._lock:
            if self._plain is None:
                arrays = [leaf for leaf in self._loaded.leaves if leaf.kind != "value"]
                self._plain = self._reader.plain_names(self._loaded, arrays)
            plain = self._plain
        requests = [RegionRequest(leaf=leaf, region=region) for leaf, region in items]
        return self._reader.read(
            self._loaded, requests, plain=plain, window_bytes=self.window_bytes
        )

    def codecs_plain(self, leaf: SavedLeaf) -> bool:
        """Whether ``leaf`` is stored with jaxckpt's plain codec chain (no compression)."""
        self.read_regions([])
        assert self._plain is not None
        return leaf.name in self._plain


def open_step(
    root: str | os.PathLike[str], step: int | None = None, **storage_options: Any
) -> StepView:
    """Opens a committed step for lazy reading (the newest when ``step`` is None).

    Only the step's records are read here; array data is read when a leaf is
    indexed. Every chunk read is checked against its CRC32C.

    Args:
      root: a local path, ``gs://bucket/prefix`` or ``s3://bucket/prefix``.
      step: the committed step; None opens the newest.
      **storage_options: backend options, as ``CheckpointOptions.storage_options``.

    Returns:
      A :class:`StepView`; ``view["params.w"][0, :10]`` reads one row's start.

    Raises:
      NotACheckpointRootError: ``root`` is not a jaxckpt root, or has no committed step.
      StepNotFoundError: no committed ``step`` (the message lists the committed ones).
      CorruptCheckpointError: the step's records or a chunk read fail their checksums.
    """
    protocol = CommitReader(open_storage(root, **storage_options))
    protocol.check_root()
    if step is not None and (
        isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0
    ):
        raise StepNotFoundError(f"step must be a non-negative integer, got {step!r}")
    marker = protocol.marker_or_latest(None if step is None else int(step))
    return StepView(protocol, load_step(protocol, marker))
