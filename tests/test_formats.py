"""``jaxckpt.formats`` and ``ChunkRecord.address``: the data-format seam.

The table of formats is what options and records accept; a chunk's address
(object, offset, size) is the one answer every reader, verifier, copier and
exporter uses. Pure: no storage but a dict, no jax.
"""

from __future__ import annotations

import pytest

import jaxckpt
from jaxckpt.formats import FORMATS, PACKED, PLAIN, format_named, step_format
from jaxckpt.formats.writers import WRITERS
from jaxckpt.records import LAYOUTS, ChunkRecord, ManifestPart, StepLocation, new_attempt

LOC = StepLocation(step=7, attempt=new_attempt(1))


def test_the_table_names_every_format_once_and_options_and_records_accept_exactly_it():
    assert list(FORMATS) == ["plain", "packed"] == list(LAYOUTS)
    assert set(WRITERS) == set(FORMATS)
    for name, data_format in FORMATS.items():
        assert format_named(name) is data_format
        jaxckpt.CheckpointOptions(layout=name)  # accepted
        ManifestPart(step=1, process=0, num_processes=1, arrays={}, layout=name)
    with pytest.raises(ValueError, match="layout must be 'plain' or 'packed', got 'zip'"):
        jaxckpt.CheckpointOptions(layout="zip")
    with pytest.raises(ValueError, match="layout must be one of"):
        format_named("zip")


def test_what_readers_may_assume_of_each_format():
    assert PLAIN.zarr_arrays and not PLAIN.raw_chunks
    assert not PACKED.zarr_arrays and PACKED.raw_chunks


def test_a_step_is_plain_only_when_every_part_is():
    assert step_format([]) is PLAIN
    assert step_format(["plain", "plain"]) is PLAIN
    assert step_format(["plain", "packed"]) is PACKED
    with pytest.raises(ValueError):
        step_format(["plain", "zip"])


class _Reads:
    """A storage double that records which read a chunk address asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int | None, int | None]] = []

    def read_buffer(self, key: str, size: int | None) -> bytes:
        self.calls.append(("buffer", key, None, size))
        return b"x"

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        self.calls.append(("range", key, offset, size))
        return b"y"


def test_a_plain_chunk_is_its_own_object_read_whole():
    record = ChunkRecord(key="c/0/1", size=12, crc32c=5)
    address = record.address(LOC, "params.w")
    assert address.key == LOC.array_prefix("params.w") + "c/0/1"
    assert (address.offset, address.size, address.whole) == (0, 12, True)
    assert record.whole_object and record.inside() == ""
    reads = _Reads()
    assert address.read(reads) == b"x"  # type: ignore[arg-type]
    assert reads.calls == [("buffer", address.key, None, 12)]


def test_a_packed_chunk_is_a_byte_range_of_its_pack_whatever_the_array():
    record = ChunkRecord(key="c/0", size=20, crc32c=5, pack="packs/0-1.bin", offset=4096)
    address = record.address(LOC, "params.w")
    assert address == record.address(LOC, "other")  # the pack, not the array, holds it
    assert address.key == LOC.key("packs/0-1.bin")
    assert (address.offset, address.size, address.whole) == (4096, 20, False)
    assert not record.whole_object
    assert record.inside() == " (in pack packs/0-1.bin at byte 4096)"
    reads = _Reads()
    assert address.read(reads) == b"y"  # type: ignore[arg-type]
    assert reads.calls == [("range", address.key, 4096, 20)]


def test_a_part_counts_its_objects_and_knows_which_it_wrote():
    plain = ChunkRecord(key="c/0", size=8, crc32c=1)
    packed = ChunkRecord(key="c/1", size=8, crc32c=1, pack="packs/a", offset=0)
    stray = ChunkRecord(key="c/2", size=8, crc32c=1, pack="packs/b", offset=0)
    part = ManifestPart(
        step=1,
        process=0,
        num_processes=1,
        arrays={"w": (plain, packed, packed)},
        layout="packed",
        packs={"packs/a": 64, "packs/c": 64},
    )
    assert part.format is PACKED
    assert part.objects == 3  # two packs and the chunk stored whole
    assert part.lists_object(plain) and part.lists_object(packed)
    assert not part.lists_object(stray)
