"""The commit checks the other processes' part summaries against one listing of the attempt.

A save's processes send the primary a summary of the part each wrote (size,
CRC32C, chunk bytes, the count and an order-independent hash of its data
objects); the primary reads no other part, yet a pack or chunk object missing
before the marker still stops the commit, naming it. Two processes' saves are
played here on one process: process 1's part and pack are written by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxckpt.commit import CommitProtocol
from jaxckpt.errors import CheckpointError, CorruptCheckpointError
from jaxckpt.records import (
    ChunkRecord,
    ManifestPart,
    PartSummary,
    StepLocation,
    crc32c,
    dumps,
    json_record,
    keys_hash,
    manifest_name,
    new_attempt,
    object_keys,
    objects_of,
)
from jaxckpt.storage import open_storage


def _part(loc: StepLocation, process: int) -> tuple[ManifestPart, bytes, bytes]:
    raw = bytes([process]) * 60
    stored = raw + crc32c(raw).to_bytes(4, "little")
    pack = f"packs/{process}.0.bin"
    part = ManifestPart(
        step=loc.step,
        process=process,
        num_processes=2,
        arrays={"w": (ChunkRecord(key=f"c/{process}", size=64, crc32c=crc32c(raw), pack=pack),)},
        layout="packed",
        packs={pack: len(stored)},
    )
    return part, part.to_bytes(), stored


def _attempt(tmp_path: Path) -> tuple[CommitProtocol, StepLocation, dict[str, bytes], PartSummary]:
    """An attempt of step 1 of two processes, every object written; returns the protocol,
    the attempt, process 0's records (as it wrote them) and process 1's summary."""
    protocol = CommitProtocol(open_storage(str(tmp_path / "root")))
    protocol.ensure_root(create=True)
    protocol.take_epoch()
    loc = StepLocation(1, new_attempt(protocol.write_epoch()))
    protocol.begin_save(loc)
    tree = json_record(step=1, leaves=[])
    protocol.write_tree(loc, tree)
    written = {"tree.json": tree}
    summary = None
    for process in (0, 1):
        part, data, pack = _part(loc, process)
        protocol.storage.write(loc.key(f"packs/{process}.0.bin"), pack)
        protocol.storage.write(loc.key(manifest_name(process)), data)
        if process == 0:
            written[manifest_name(0)] = data
        else:
            summary = PartSummary.of(data, part, loc)
    assert summary is not None
    return protocol, loc, written, summary


def test_a_commit_of_summarised_parts_reads_none_of_them_and_its_marker_vouches_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    protocol, loc, written, summary = _attempt(tmp_path)
    read = []
    original = type(protocol.storage).read
    monkeypatch.setattr(
        type(protocol.storage), "read", lambda self, key: read.append(key) or original(self, key)
    )
    marker = protocol.commit(
        loc, num_processes=2, written=written, summaries={manifest_name(1): summary}
    )
    assert not [k for k in read if "/manifest/" in k], read
    monkeypatch.undo()
    assert marker.every_process and set(marker.files) == {"tree.json"}
    assert marker.nbytes == 128
    _, parts = protocol.read_step(protocol.require_marker(1))  # the set checks with the marker
    assert [p.process for p in parts] == [0, 1]


def test_a_summarised_pack_gone_before_the_marker_stops_the_commit_naming_it(
    tmp_path: Path,
) -> None:
    protocol, loc, written, summary = _attempt(tmp_path)
    protocol.storage.delete(loc.key("packs/1.0.bin"))  # collected under a long save
    with pytest.raises(CheckpointError, match=r"cannot commit step 1: chunk c/1 of w .*packs/1"):
        protocol.commit(
            loc, num_processes=2, written=written, summaries={"manifest/1.json": summary}
        )
    assert protocol.committed() == {}


def test_a_summarised_part_gone_stops_the_commit(tmp_path: Path) -> None:
    protocol, loc, written, summary = _attempt(tmp_path)
    protocol.storage.delete(loc.key("manifest/1.json"))
    with pytest.raises(
        CheckpointError, match=r"cannot commit step 1: .*manifest/1.json is missing"
    ):
        protocol.commit(
            loc, num_processes=2, written=written, summaries={"manifest/1.json": summary}
        )


def test_a_summary_naming_objects_the_attempt_lacks_stops_the_commit(tmp_path: Path) -> None:
    protocol, loc, written, summary = _attempt(tmp_path)
    claims = PartSummary(
        size=summary.size,
        crc32c=summary.crc32c,
        nbytes=summary.nbytes,
        objects=summary.objects + 1,
        objects_hash=summary.objects_hash,
    )
    with pytest.raises(CheckpointError, match=r"holds 2 data objects, its manifest parts name 3"):
        protocol.commit(
            loc, num_processes=2, written=written, summaries={"manifest/1.json": claims}
        )


def test_the_object_hash_of_disjoint_sets_adds_up_and_records_are_not_objects() -> None:
    loc = StepLocation(3, new_attempt(1, now=1_700_000_000))
    a, b = {loc.key("packs/0.0.bin")}, {loc.key("packs/1.0.bin"), loc.key("arrays/w/c/0")}
    assert (keys_hash(a) + keys_hash(b)) % (1 << 64) == keys_hash(a | b)
    listed = [*a, *b, loc.key("tree.json"), loc.key("manifest/0.json"), loc.key("zarr.json")]
    listed += [loc.key("arrays/w/zarr.json"), loc.key("manifest/.0.json.1-ab.tmp")]
    assert objects_of(loc, listed) == (3, keys_hash(a | b))
    part, _, _ = _part(loc, 1)
    assert object_keys(part, loc) == {loc.key("packs/1.0.bin")}


@pytest.mark.parametrize("value", [None, [1, 2, 3, 4], [1, 2, 3, 4, -5], [1, 2, 3, 4, 1 << 64]])
def test_a_malformed_summary_is_refused_naming_it(value: object) -> None:
    with pytest.raises(CorruptCheckpointError, match="summary of process 3: malformed"):
        PartSummary.from_json(value, "summary of process 3")


def test_a_summary_round_trips() -> None:
    summary = PartSummary(size=1, crc32c=2, nbytes=3, objects=4, objects_hash=(1 << 64) - 1)
    assert PartSummary.from_json(summary.to_json(), "s") == summary
    assert dumps(summary.to_json())  # JSON, as the coordination service carries it
