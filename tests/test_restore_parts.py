"""Which manifest parts a restoring process reads (``restoring/_parts.py``), as a table.

Process 1 of 2, four devices (d0, d1 on process 0; d2, d3 on process 1), a
(8, 4) leaf in (2, 4) chunks. A chunk's writer is the process of the first
device holding its shard (``replica_id == 0``, JAX's numbering): a process reads
its own part, and the parts of the writers of what it needs. Shardings are
stand-ins with the two methods the module asks (``devices_indices_map``,
``addressable_devices_indices_map``); the multi-process counts are
``test_scale_counts.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import pytest

from jaxckpt.records import ChunkRecord, SavedLeaf
from jaxckpt.restoring import _parts

ME = 1
SHAPE = (8, 4)
LEAF = SavedLeaf(
    path=[["d", "w"]], kind="array", name="w", shape=SHAPE, dtype="float32", chunk_shape=(2, 4)
)


@dataclass(frozen=True)
class Device:
    id: int
    process_index: int


DEVICES = [Device(0, 0), Device(1, 0), Device(2, 1), Device(3, 1)]


class Sharding:
    """Rows split into ``len(groups)`` shards; ``groups[i]``: the devices holding shard i."""

    def __init__(self, *groups: tuple[int, ...]) -> None:
        self.groups = groups

    def devices_indices_map(self, shape: tuple[int, ...]) -> dict[Any, Any]:
        rows = shape[0] // len(self.groups)
        out = {}
        for device in DEVICES:  # device order, as JAX iterates its device assignment
            for i, group in enumerate(self.groups):
                if device.id in group:
                    out[device] = (slice(i * rows, (i + 1) * rows), slice(None))
        return out

    def addressable_devices_indices_map(self, shape: tuple[int, ...]) -> dict[Any, Any]:
        return {d: i for d, i in self.devices_indices_map(shape).items() if d.process_index == ME}


SHARDED = Sharding((0,), (1,), (2,), (3,))
REPLICATED = Sharding((0, 1, 2, 3))
HALVES_ACROSS = Sharding((0, 2), (1, 3))  # each half on both processes, written by process 0
OWN_HALVES = Sharding((0, 1), (2, 3))  # each process holds one half


@pytest.fixture(autouse=True)
def _process_1_of_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax, "process_index", lambda: ME)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(_parts, "target_sharding", lambda target: target)


def chunks_of(*rows: int) -> dict[str, tuple[ChunkRecord, ...]]:
    return {"w": tuple(ChunkRecord(key=f"c/{r}/0", size=36, crc32c=0) for r in rows)}


@pytest.mark.parametrize(
    ("sharding", "collective", "needed"),
    [
        (SHARDED, True, {1}),  # its own shards only
        (OWN_HALVES, True, {1}),
        (REPLICATED, True, {0, 1}),  # read once in all, exchanged: every chunk's writer
        (HALVES_ACROSS, True, {0, 1}),
        (REPLICATED, False, {0, 1}),  # each host reads what it addresses (a tiered restore)
        (None, True, None),  # read whole onto the host: every part
    ],
)
def test_a_process_reads_its_own_part_and_its_chunks_writers(
    sharding: Any, collective: bool, needed: set[int] | None
) -> None:
    assert _parts.needed_processes([LEAF], [sharding], 2, collective=collective) == needed


def test_a_job_of_another_size_reads_every_part() -> None:
    assert _parts.needed_processes([LEAF], [SHARDED], 4, collective=True) is None


def test_value_leaves_need_no_part() -> None:
    value = SavedLeaf(path=[["d", "s"]], kind="value", value=3)
    assert _parts.needed_processes([value], [None], 2, collective=True) == {ME}


@pytest.mark.parametrize(
    ("sharding", "listed", "missing"),
    [
        (SHARDED, (2, 3), None),  # rows 4-7: chunks 2 and 3, its own part's
        (SHARDED, (2,), "c/3/0"),
        (OWN_HALVES, (2, 3), None),
        (REPLICATED, (0, 1, 2, 3), None),
        (REPLICATED, (0, 1, 3), "c/2/0"),  # collective: every chunk
        (HALVES_ACROSS, (0, 1, 2, 3), None),
    ],
)
def test_a_chunk_it_needs_that_no_part_read_lists_is_found(
    sharding: Any, listed: tuple[int, ...], missing: str | None
) -> None:
    found = _parts.missing_chunk(chunks_of(*listed), [LEAF], [sharding], collective=True)
    assert (found and found[1]) == missing


def test_on_another_topology_the_guess_misses_a_chunk() -> None:
    """Saved on one process's four devices (every chunk in part 0), restored onto two
    processes' halves: process 1 guesses its own part, which lists none of its rows,
    so the reader reads every part."""
    assert _parts.needed_processes([LEAF], [OWN_HALVES], 2, collective=True) == {1}
    assert _parts.missing_chunk({}, [LEAF], [OWN_HALVES], collective=True) == (LEAF, "c/2/0")
    every = _parts.missing_chunk(chunks_of(0, 1, 2, 3), [LEAF], [OWN_HALVES], collective=True)
    assert every is None
