"""``_records``: the on-storage records round-trip, and every bad one is named when refused.

A record that cannot be trusted raises ``CorruptCheckpointError`` (or
``UnsupportedFormatError`` for a newer version) whose message names the
record's location (the ``what`` a reader passes: the object's URI).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest

from jaxckpt.errors import CheckpointError, CorruptCheckpointError, UnsupportedFormatError
from jaxckpt.records import StepLocation, marker_key, new_attempt
from jaxckpt.records import _step as R

WHERE = "s3://bucket/run/commits/000000000007.e2.json"
ATTEMPT = new_attempt(2, now=1_700_000_000)


def marker(**overrides: Any) -> R.CommitMarker:
    fields: dict[str, Any] = dict(
        step=7,
        time=1_700_000_000.5,
        num_processes=2,
        files={
            "tree.json": R.FileDigest(size=10, crc32c=1),
            "manifest/0.json": R.FileDigest(size=20, crc32c=2),
        },
        nbytes=1 << 20,
        metrics={"blocking_s": 0.25},
        keep=True,
        attempt=ATTEMPT,
        epoch=2,
    )
    fields.update(overrides)
    return R.CommitMarker(**fields)


def resealed(body: dict[str, Any], field: str = "marker_crc32c") -> bytes:
    """A marker (or, ``field="part_crc32c"``, a manifest part) body with a correct self-CRC
    (what a buggy or hostile writer could store)."""
    body = {k: v for k, v in body.items() if k != field}
    body[field] = R.crc32c(R.dumps(body))
    return R.dumps(body)


def resealed_part(body: dict[str, Any]) -> bytes:
    return resealed(body, "part_crc32c")


# -- commit markers ---------------------------------------------------------------


def test_a_marker_round_trips_and_names_its_attempt_and_key() -> None:
    m = marker()
    back = R.CommitMarker.from_bytes(m.to_bytes(), WHERE)
    assert back == m
    assert back.location == StepLocation(7, m.attempt)
    assert back.key == marker_key(7, 2)


def test_a_marker_encoding_is_canonical() -> None:
    a = marker(files={"b": R.FileDigest(size=1, crc32c=1), "a": R.FileDigest(size=2, crc32c=2)})
    b = marker(files={"a": R.FileDigest(size=2, crc32c=2), "b": R.FileDigest(size=1, crc32c=1)})
    assert a.to_bytes() == b.to_bytes()
    assert b" " not in a.to_bytes()


def test_a_format_1_marker_has_no_attempt_and_lives_under_steps() -> None:
    m = marker(version=1, attempt=None, epoch=0)
    data = m.to_bytes()
    assert b'"attempt"' not in data
    back = R.CommitMarker.from_bytes(data, WHERE)
    assert back.attempt is None and back.location == StepLocation(7)
    assert back.key == "commits/7.json"


def test_every_flipped_byte_of_a_marker_is_refused_naming_it() -> None:
    data = marker().to_bytes()
    for i in range(len(data)):
        torn = bytearray(data)
        torn[i] ^= 0x01
        with pytest.raises(CheckpointError, match=re.escape(WHERE)):
            R.CommitMarker.from_bytes(bytes(torn), WHERE)


@pytest.mark.parametrize("cut", [0, 1, 10, -1])
def test_a_truncated_marker_is_corrupt(cut: int) -> None:
    data = marker().to_bytes()[:cut]
    with pytest.raises(CorruptCheckpointError, match=f"{WHERE}.*(JSON|checksum)"):
        R.CommitMarker.from_bytes(data, WHERE)


def test_a_marker_of_a_newer_format_is_unsupported_not_ignored() -> None:
    body = json.loads(marker().to_bytes())
    body["version"] = R.FORMAT_VERSION + 1
    newer = R.FORMAT_VERSION + 1
    with pytest.raises(UnsupportedFormatError, match=rf"{WHERE} has format version {newer}"):
        R.CommitMarker.from_bytes(resealed(body), WHERE)


def test_a_marker_that_names_no_valid_attempt_is_corrupt() -> None:
    body = json.loads(marker().to_bytes())
    body["attempt"] = "not-an-attempt"
    with pytest.raises(CorruptCheckpointError, match=f"{WHERE}: names no valid save attempt"):
        R.CommitMarker.from_bytes(resealed(body), WHERE)


@pytest.mark.parametrize("field", ["step", "time", "num_processes", "files", "nbytes"])
def test_a_sealed_marker_without_a_required_field_is_corrupt_naming_it(field: str) -> None:
    body = json.loads(marker().to_bytes())
    del body[field]
    with pytest.raises(CorruptCheckpointError, match=f"{WHERE}.*{field}"):
        R.CommitMarker.from_bytes(resealed(body), WHERE)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"[1, 2]", "is not a JSON object"),
        (b"\xff\xfe", "is not valid JSON"),
        (R.dumps({"format": "orbax", "version": 2}), "is not a jaxckpt record"),
        (R.dumps({"format": "jaxckpt"}), "has no format version"),
        (R.dumps({"format": "jaxckpt", "version": "2"}), "has no format version"),
    ],
)
def test_records_that_are_not_jaxckpt_records_are_corrupt(data: bytes, says: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=f"{WHERE} {says}"):
        R.load_json_record(data, WHERE)
    with pytest.raises(CorruptCheckpointError, match=WHERE):
        R.CommitMarker.from_bytes(data, WHERE)


# -- manifest parts -------------------------------------------------------------------


def test_a_plain_manifest_part_round_trips_at_version_2() -> None:
    part = R.ManifestPart(
        step=3,
        process=1,
        num_processes=2,
        arrays={
            "w": (R.ChunkRecord(key="c/0/0", size=12, crc32c=5),),
            "b": (
                R.ChunkRecord(key="c/0", size=8, crc32c=6),
                R.ChunkRecord(key="c/1", size=8, crc32c=7),
            ),
        },
        plain_codecs=True,
    )
    data = part.to_bytes()
    body = json.loads(data)
    assert body["version"] == R.FORMAT_VERSION and "layout" not in body
    assert body["codecs"] == R.PLAIN_CODECS
    assert body["arrays"]["w"] == [["c/0/0", 12, 5]]
    back = R.ManifestPart.from_bytes(data, WHERE)
    assert back == part and back.nbytes == 28


def test_a_part_without_the_codecs_field_reads_as_unknown_codecs() -> None:
    part = R.ManifestPart(step=3, process=0, num_processes=1, arrays={})
    assert b"codecs" not in part.to_bytes()
    assert R.ManifestPart.from_bytes(part.to_bytes(), WHERE).plain_codecs is False


def test_a_packed_manifest_part_round_trips_at_the_format_version() -> None:
    chunk = R.ChunkRecord(key="c/0", size=68, crc32c=9, pack="packs/0.0.bin", offset=128)
    part = R.ManifestPart(
        step=3,
        process=0,
        num_processes=1,
        arrays={"w": (chunk,)},
        layout="packed",
        packs={"packs/0.0.bin": 4096},
    )
    body = json.loads(part.to_bytes())
    assert body["version"] == R.FORMAT_VERSION and body["layout"] == "packed"
    assert body["arrays"]["w"] == [["c/0", 68, 9, "packs/0.0.bin", 128]]
    assert R.ManifestPart.from_bytes(part.to_bytes(), WHERE) == part


def test_manifest_parts_of_a_newer_version_are_unsupported() -> None:
    body = {"format": "jaxckpt", "version": R.FORMAT_VERSION + 1, "step": 1, "arrays": {}}
    with pytest.raises(UnsupportedFormatError, match=WHERE):
        R.ManifestPart.from_bytes(R.dumps(body), WHERE)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"layout": "zip"}, "unknown layout 'zip'"),
        ({"arrays": {"w": [["c/0", 12]]}}, r"malformed chunk record \['c/0', 12\]"),
        ({"arrays": {"w": [["c/0", 1, 2, 3, 4, 5]]}}, "malformed chunk record"),
    ],
)
def test_a_bad_manifest_part_is_corrupt_naming_it(change: dict[str, Any], says: str) -> None:
    part = R.ManifestPart(step=1, process=0, num_processes=1, arrays={})
    body = {**json.loads(part.to_bytes()), **change}
    with pytest.raises(CorruptCheckpointError, match=f"{WHERE}: {says}"):
        R.ManifestPart.from_bytes(resealed_part(body), WHERE)


@pytest.mark.parametrize("field", ["step", "process", "num_processes", "arrays"])
def test_a_manifest_part_without_a_required_field_is_corrupt_naming_it(field: str) -> None:
    part = R.ManifestPart(step=1, process=0, num_processes=1, arrays={})
    body = json.loads(part.to_bytes())
    del body[field]
    with pytest.raises(CorruptCheckpointError, match=f"{WHERE}.*{field}"):
        R.ManifestPart.from_bytes(resealed_part(body), WHERE)


def test_a_manifest_part_refuses_an_unknown_layout_when_built() -> None:
    with pytest.raises(ValueError, match="layout must be one of"):
        R.ManifestPart(step=1, process=0, num_processes=1, arrays={}, layout="zip")


# -- chunks ---------------------------------------------------------------------------


def stored_chunk(raw: bytes) -> tuple[bytes, R.ChunkRecord]:
    crc = R.crc32c(raw)
    data = raw + crc.to_bytes(R.TRAILER_BYTES, "little")
    return data, R.ChunkRecord(key="c/0", size=len(data), crc32c=crc)


def test_chunk_problem_accepts_an_intact_chunk_as_bytes_or_an_array() -> None:
    data, record = stored_chunk(b"weights" * 100)
    assert R.chunk_problem(data, record) is None
    assert R.chunk_problem(np.frombuffer(data, np.uint8).copy(), record) is None


def test_chunk_problem_names_what_is_wrong() -> None:
    data, record = stored_chunk(b"weights" * 100)
    assert R.chunk_problem(data[:-1], record) == f"size {len(data) - 1} != recorded {record.size}"
    flipped = bytearray(data)
    flipped[3] ^= 0x10
    assert R.chunk_problem(bytes(flipped), record) == "checksum mismatch"
    trailer = bytearray(data)
    trailer[-1] ^= 0x10
    assert R.chunk_problem(bytes(trailer), record) == "checksum trailer mismatch"


def test_chunk_records_round_trip_in_both_layouts() -> None:
    plain = R.ChunkRecord(key="c/1/2", size=5, crc32c=3)
    packed = R.ChunkRecord(key="c/1/2", size=5, crc32c=3, pack="packs/1.2.bin", offset=64)
    for record in (plain, packed):
        assert R.ChunkRecord.decode(record.encode(), WHERE) == record
    assert len(plain.encode()) == 3 and len(packed.encode()) == 5


def test_crc32c_is_castagnoli_and_file_digests_use_it() -> None:
    assert R.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert R.FileDigest.of(b"123456789") == R.FileDigest(size=9, crc32c=0xE3069283)


# -- other records ----------------------------------------------------------------------


def test_versioned_json_records_round_trip() -> None:
    data = R.json_record(operation="save", step=3, started=1.5)
    obj = R.load_json_record(data, WHERE)
    assert obj == {"format": "jaxckpt", "version": R.FORMAT_VERSION, "operation": "save",
                   "step": 3, "started": 1.5}  # fmt: skip
    newer = R.dumps({"format": "jaxckpt", "version": R.FORMAT_VERSION + 1})
    with pytest.raises(UnsupportedFormatError, match="Upgrade jaxckpt"):
        R.load_json_record(newer, WHERE)


def test_canonical_json_does_not_depend_on_key_order() -> None:
    assert R.dumps({"b": 1, "a": [1, 2]}) == R.dumps({"a": [1, 2], "b": 1}) == b'{"a":[1,2],"b":1}'


@pytest.mark.parametrize(
    ("parts", "text"),
    [
        ([], "<root>"),
        ([["d", "opt"], ["s", 0], ["a", "mu"]], "['opt'][0].mu"),
        ([["d", 3]], "[3]"),
    ],
)
def test_path_text_reads_like_keystr(parts: list[list[Any]], text: str) -> None:
    assert R.path_text(parts) == text


# -- names read from records --------------------------------------------------------

ESCAPES = ["../../OUTSIDE.bin", "/etc/passwd", "a/../../b", "a//b", ".", "", "a\\b", "a\0b"]


@pytest.mark.parametrize("name", ESCAPES)
def test_a_replica_index_naming_a_file_outside_its_replica_is_corrupt(name: str) -> None:
    index = R.ReplicaIndex(
        step=3,
        process=1,
        attempt=ATTEMPT,
        num_processes=2,
        files={"tree.json": R.FileDigest(size=1, crc32c=2), name: R.FileDigest(size=1, crc32c=2)},
    )
    with pytest.raises(CorruptCheckpointError, match=f"{WHERE}: unsafe key name"):
        R.ReplicaIndex.from_bytes(index.to_bytes(), WHERE)


@pytest.mark.parametrize("name", [*ESCAPES, "manifest/x.json", "packs/0.0.bin", "tree.json/x"])
def test_a_marker_naming_an_unexpected_file_is_corrupt(name: str) -> None:
    files = {name: R.FileDigest(size=1, crc32c=2), "tree.json": R.FileDigest(size=1, crc32c=2)}
    with pytest.raises(CorruptCheckpointError, match=f"{WHERE}: unsafe file name"):
        R.CommitMarker.from_bytes(marker(files=files).to_bytes(), WHERE)


@pytest.mark.parametrize(
    ("item", "says"),
    [
        (["c/../../x", 8, 1], "unsafe chunk name"),
        (["c/0/1", 8, 1, "packs/../../x.bin", 0], "unsafe pack name"),
        (["c/0/1", 8, 1, "packs/0.0.bin/../x", 0], "unsafe pack name"),
        (["c/0/1", "8", 1], "chunk size is not a non-negative integer"),
        (["c/0/1", 8, 1 << 32], "malformed chunk record"),
        (["c/0/1", 8, 1, "packs/0.0.bin", -1], "offset is not a non-negative integer"),
        ({"key": "c/0"}, "malformed chunk record"),
    ],
)
def test_a_chunk_record_is_checked_field_by_field(item: Any, says: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=f"^{re.escape(WHERE)}: {says}"):
        R.ChunkRecord.decode(item, WHERE)


@pytest.mark.parametrize("name", ["../w", "a/b", "..", ""])
def test_a_manifest_array_name_must_be_one_safe_segment(name: str) -> None:
    part = R.ManifestPart(step=1, process=0, num_processes=1, arrays={name: ()})
    with pytest.raises(CorruptCheckpointError, match="unsafe array name"):
        R.ManifestPart.from_bytes(part.to_bytes(), WHERE)


def test_a_record_nested_past_the_parser_s_depth_is_corrupt() -> None:
    with pytest.raises(CorruptCheckpointError, match="is not valid JSON"):
        R.load_json_record(b"[" * 100_000 + b"]" * 100_000, WHERE)


# -- format 4: parts that check themselves, a marker of constant size ------------------


def test_a_part_checks_itself_and_a_flipped_byte_is_refused_naming_it() -> None:
    part = R.ManifestPart(
        step=3,
        process=1,
        num_processes=2,
        arrays={"w": (R.ChunkRecord(key="c/0", size=8, crc32c=5),)},
    )
    data = part.to_bytes()
    assert json.loads(data)["part_crc32c"] == R.crc32c(
        R.dumps({k: v for k, v in json.loads(data).items() if k != "part_crc32c"})
    )
    assert R.ManifestPart.from_bytes(data, WHERE, self_checked=True) == part
    at = data.index(b'"c/0"') + 2  # the chunk key "c/0" becomes "c/1": valid JSON, wrong part
    flipped = data[:at] + b"1" + data[at + 1 :]
    with pytest.raises(CorruptCheckpointError, match=f"{WHERE}: manifest part checksum mismatch"):
        R.ManifestPart.from_bytes(flipped, WHERE)


def test_an_older_part_read_without_a_digest_in_its_marker_is_corrupt() -> None:
    """A part of version 3 or older has no CRC32C of its own: only a marker's digest
    vouches for it, so one found where the marker lists none is not trusted."""
    body = {"format": "jaxckpt", "version": 3, "step": 1, "process": 0, "num_processes": 1}
    data = R.dumps({**body, "arrays": {}, "layout": "packed", "packs": {}})
    assert R.ManifestPart.from_bytes(data, WHERE).version == 3
    with pytest.raises(CorruptCheckpointError, match=f"{WHERE}: .*no checksum of its own"):
        R.ManifestPart.from_bytes(data, WHERE, self_checked=True)


def test_a_marker_of_every_process_stays_the_same_size_whatever_their_number() -> None:
    tree = {"tree.json": R.FileDigest(size=10, crc32c=1)}
    small = marker(num_processes=2, files=tree, parts_crc32c=7)
    large = marker(num_processes=8192, files=tree, parts_crc32c=7)
    # The same bytes but the count (and the marker's own CRC32C, whose decimal width varies).
    sizes = [len(re.sub(rb'"marker_crc32c":\d+', b"", m.to_bytes())) for m in (small, large)]
    assert sizes[1] - sizes[0] == len("8192") - len("2")
    back = R.CommitMarker.from_bytes(large.to_bytes(), WHERE)
    assert back == large and back.every_process and back.parts_crc32c == 7
    assert back.covers("manifest/8191.json") and not back.covers("manifest/8192.json")
    assert not back.covers("manifest/01.json") and not back.covers("manifest/1.held.json")
    assert back.manifest_names()[:2] == ["manifest/0.json", "manifest/1.json"]


def test_a_marker_of_some_parts_names_them() -> None:
    parts = ("manifest/1.json", "manifest/1.held.json")
    m = marker(files={"tree.json": R.FileDigest(size=10, crc32c=1)}, parts=parts, parts_crc32c=3)
    back = R.CommitMarker.from_bytes(m.to_bytes(), WHERE)
    assert back.parts == parts and not back.every_process
    assert back.manifest_names() == list(parts) and back.covers("manifest/1.held.json")
    assert not back.covers("manifest/0.json")


@pytest.mark.parametrize("parts", [["tree.json"], ["manifest/0.json", "manifest/0.json"], "x"])
def test_a_marker_naming_parts_that_are_not_its_parts_is_corrupt(parts: Any) -> None:
    body = json.loads(marker(files={"tree.json": R.FileDigest(size=1, crc32c=2)}).to_bytes())
    body["parts"] = parts
    with pytest.raises(CorruptCheckpointError, match=f"{WHERE}: parts"):
        R.CommitMarker.from_bytes(resealed(body), WHERE)


def test_older_markers_name_their_parts_by_their_digests() -> None:
    m = marker(version=2)
    assert m.manifest_names() == ["manifest/0.json"] and not m.every_process
    both = dict(m.files, **{"manifest/1.json": R.FileDigest(size=1, crc32c=1)})
    assert marker(version=2, files=both).every_process
    assert b"parts" not in m.to_bytes()
