"""The save's helpers: the tree record, the object bound, held chunks, fence errors and
the step's listing taken while the attempt is announced."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from typing import Any, TypeVar

from jaxckpt import _pools
from jaxckpt.commit import CommitProtocol, Listing
from jaxckpt.errors import CheckpointError, UnsupportedLeafError, WriterFencedError
from jaxckpt.formats import HostArray, chunk_key, chunks_of
from jaxckpt.records import (
    TRAILER_BYTES,
    ChunkRecord,
    SavedLeaf,
    StepLocation,
    json_record,
    structure_of,
    writer_versions,
)

log = logging.getLogger("jaxckpt")
_E = TypeVar("_E", bound=BaseException)


def tree_record(step: int, leaves: Sequence[SavedLeaf], metadata: Any, state: Any) -> bytes:
    try:
        return json_record(
            step=step,
            leaves=[x.to_json() for x in leaves],
            metadata=metadata,
            versions=dict(writer_versions()),
            structure=structure_of(state, leaves),
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"step {step}: metadata and non-array leaves must be JSON-serialisable: {e}"
        ) from e


def fence_error(e: BaseException) -> WriterFencedError | None:
    """The WriterFencedError behind ``e`` (Orbax wraps background errors), if any."""
    return behind(e, WriterFencedError)


def behind(e: BaseException, cls: type[_E]) -> _E | None:
    """The first ``cls`` in ``e``'s chain of causes, ``e`` included, if any (Orbax wraps
    a background error: a ChainedFuture turns any TimeoutError into its own)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, cls):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def split_held(
    records: dict[str, tuple[ChunkRecord, ...]], arrays: Sequence[HostArray]
) -> tuple[dict[str, tuple[ChunkRecord, ...]], dict[str, tuple[ChunkRecord, ...]]]:
    """Splits chunk records into this host's own (``replica_id == 0``) and ``held`` ones."""
    held_keys: dict[str, set[str]] = {}
    for host in arrays:
        if host.held and host.leaf.name is not None:
            shape = host.leaf.chunk_shape
            held_keys[host.leaf.name] = {
                chunk_key(c, shape) for region in host.held for c in chunks_of(region, shape)
            }
    if not held_keys:
        return records, {}
    own: dict[str, tuple[ChunkRecord, ...]] = {}
    held: dict[str, tuple[ChunkRecord, ...]] = {}
    for name, chunks in records.items():
        keys = held_keys.get(name, set())
        own[name] = tuple(c for c in chunks if c.key not in keys)
        if mine := tuple(c for c in chunks if c.key in keys):
            held[name] = mine
    return own, held


def check_object_bound(leaves: Sequence[SavedLeaf], max_object_bytes: int, step: int) -> None:
    """Refuses a leaf with a chunk (and its checksum) over ``max_object_bytes``: its shard
    has no divisor that splits it that small (e.g. a long axis of prime length)."""
    for leaf in leaves:
        if leaf.dtype is None:
            continue
        size = math.prod(leaf.chunk_shape) * leaf.numpy_dtype.itemsize + TRAILER_BYTES
        if size > max_object_bytes:
            raise UnsupportedLeafError(
                f"step {step}: {leaf.path_text}: its shards (chunks {leaf.chunk_shape}) cannot be "
                f"split into objects of at most max_object_bytes={max_object_bytes:,} bytes "
                f"(the smallest chunk is {size:,}); raise max_object_bytes or shard the leaf "
                "along an axis whose length has small divisors"
            )


def listing_and_announce(
    protocol: CommitProtocol, loc: StepLocation, *, announce: bool
) -> tuple[Listing, bool]:
    """The step's listing, and whether the attempt was announced meanwhile.

    With ``announce`` (the primary of a shared tier, unless a crash test watches
    the phases: then ``begin_save`` writes it after its checks, in order) the
    attempt's pending record is written while the listing is taken (a round trip
    less before the data).

    Raises:
      StepAlreadyExistsError: the step is committed (the record is removed again).
    """
    with _pools.borrow("announce", 1) as pool:
        announcing = pool.submit(protocol.announce, loc) if announce else None
        try:
            listing = protocol.step_listing(loc.step)
            protocol.check_absent(loc.step, listing)
            if announcing is not None:
                announcing.result()
        except BaseException:
            if announcing is not None:
                with contextlib.suppress(Exception):  # else collected as a stale attempt
                    announcing.result()
                    protocol.storage.delete(loc.pending_key)
            raise
    return listing, announce


def replace_corrupt(protocol: CommitProtocol, step: int, corrupt: set[int], root: str) -> bool:
    """Retracts the committed ``step`` if a restore found it corrupt (its data fails its
    checksums, agreed by every host), so that a save replaces it: the README's resume
    loop, after a fallback to an older step, saves the corrupt step again. True if so."""
    if step not in corrupt:
        return False
    marker = protocol.read_marker(step)
    if marker is None:
        return False
    log.warning(
        "step %d under %s is corrupt, bad or newer than the step restored (a restore fell "
        "back from it or skipped it): retracting its marker and data to save it again",
        step,
        root,
    )
    protocol.delete(step, marker=marker)
    corrupt.discard(step)
    return True
