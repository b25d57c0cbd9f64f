"""Crafted records: a checksum is not a signature, so every record is checked as untrusted.

Each test rewrites a committed step's records and recomputes every digest a
reader checks (the marker's file digests and its own CRC32C), as a hostile or
buggy writer could. Names that would leave the step (``../../OUTSIDE.bin``)
and shapes no manifest vouches for must make the step corrupt, quickly, with
nothing read or written outside: restore, verify and ``cp`` (to a directory
and to S3) all refuse.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import jaxckpt
from jaxckpt import cli
from jaxckpt.commit import CommitProtocol
from jaxckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from jaxckpt.records import FileDigest, ManifestPart, StepLocation, crc32c, dumps
from jaxckpt.storage import open_storage
from jaxckpt.tools._copy import _copy_objects

Edit = Callable[[dict[str, Any]], None]


def _save(root: str, layout: str) -> None:
    state = {"w": np.arange(48, dtype=np.float32).reshape(6, 8), "b": np.ones(3, np.int8)}
    with jaxckpt.CheckpointManager(root, layout=layout) as mgr:
        mgr.save(1, state)


def _tamper(
    root: str,
    *,
    manifest: Edit | None = None,
    tree: Edit | None = None,
    files: Callable[[dict[str, bytes]], dict[str, bytes]] | None = None,
) -> None:
    """Rewrites step 1's records with ``manifest``/``tree`` (edit the parsed JSON in
    place), then re-seals every checksum a reader checks: each part's own CRC32C, the
    marker's digests (the tree record's; ``files`` may name more), its ``parts_crc32c``
    and its own CRC32C."""
    storage = open_storage(root)
    protocol = CommitProtocol(storage)
    marker = protocol.require_marker(1)
    loc = marker.location
    parts = marker.manifest_names()
    records = {name: storage.read(loc.key(name)) or b"" for name in ["tree.json", *parts]}
    for name, data in list(records.items()):
        edit = tree if name == "tree.json" else manifest
        if edit is not None:
            obj = json.loads(data)
            obj.pop("part_crc32c", None)
            edit(obj)
            if name != "tree.json":
                obj["part_crc32c"] = crc32c(dumps(obj))
            records[name] = dumps(obj)
            storage.write(loc.key(name), records[name])
    digests = {"tree.json": records["tree.json"]}
    if files is not None:
        digests = files(records)
        parts = [n for n in digests if n.startswith("manifest/")]
    listed = [[n, len(records[n]), crc32c(records[n])] for n in parts]
    resealed = dataclasses.replace(
        marker,
        files={name: FileDigest.of(data) for name, data in digests.items()},
        parts_crc32c=crc32c(dumps(listed)),
    )
    path = Path(root) / marker.key
    path.write_bytes(resealed.to_bytes())


def _outside(tmp_path: Path) -> set[str]:
    return {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}


def _first_chunk(obj: dict[str, Any]) -> list[Any]:
    return obj["arrays"]["w"][0]


def _pack_escape(obj: dict[str, Any]) -> None:
    chunk = _first_chunk(obj)
    size = obj["packs"].pop(chunk[3])
    chunk[3] = "../../../../OUTSIDE.bin"
    obj["packs"][chunk[3]] = size


def _key_escape(obj: dict[str, Any]) -> None:
    _first_chunk(obj)[0] = "c/../../../../../OUTSIDE.bin"


def _array_escape(obj: dict[str, Any]) -> None:
    obj["arrays"]["../../../../OUTSIDE.bin"] = obj["arrays"].pop("w")


def _absolute_pack(obj: dict[str, Any]) -> None:
    chunk = _first_chunk(obj)
    chunk[3] = "/etc/passwd"
    obj["packs"]["/etc/passwd"] = 1 << 20


def _tree_name_escape(obj: dict[str, Any]) -> None:
    for leaf in obj["leaves"]:
        if leaf.get("name") == "w":
            leaf["name"] = "../../../../OUTSIDE.bin"


def _marker_file_escape(records: dict[str, bytes]) -> dict[str, bytes]:
    out = dict(records)
    out["../../../../OUTSIDE.bin"] = out.pop("manifest/0.json")
    return out


CASES = {
    "pack name": ("packed", {"manifest": _pack_escape}),
    "absolute pack name": ("packed", {"manifest": _absolute_pack}),
    "chunk key": ("plain", {"manifest": _key_escape}),
    "manifest array name": ("plain", {"manifest": _array_escape}),
    "tree array name": ("plain", {"tree": _tree_name_escape}),
    "marker file name": ("packed", {"files": _marker_file_escape}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_names_that_leave_the_step_make_it_corrupt_everywhere(case, tmp_path, capsys):
    layout, edits = CASES[case]
    root = str(tmp_path / "a" / "b" / "root")
    _save(root, layout)
    # a file where the escaping names point, holding bytes a reader would accept
    (tmp_path / "OUTSIDE.bin").write_bytes(b"\0" * (1 << 16))
    _tamper(root, **edits)
    before = _outside(tmp_path)

    # an unsafe name in the marker itself makes the marker damaged (it names no valid file)
    said = re.compile(r"unsafe \w+ name '[^']*(OUTSIDE|/etc/passwd)|damaged commit marker")
    with jaxckpt.CheckpointManager(root) as mgr, pytest.raises(CorruptCheckpointError) as e:
        mgr.restore(1)
    assert said.search(str(e.value)), e.value

    assert cli.main(["verify", root, "1"]) != 0
    out, err = capsys.readouterr()
    assert said.search(out + err), out + err

    dst = tmp_path / "copy"
    assert cli.main(["cp", f"{root}:1", str(dst)]) == 1
    err = capsys.readouterr().err
    assert said.search(err), err
    assert not dst.exists() or CommitProtocol(open_storage(str(dst))).marker_refs() == []
    after = _outside(tmp_path)
    assert {p for p in after - before if not p.startswith(("copy/", "a/b/root/"))} == set()
    assert (tmp_path / "OUTSIDE.bin").read_bytes() == b"\0" * (1 << 16)


def test_cp_to_s3_refuses_and_writes_nothing_outside(tmp_path, s3_server, capsys):
    root = str(tmp_path / "root")
    _save(root, "packed")
    _tamper(root, manifest=_pack_escape)
    dst = f"s3://{s3_server.bucket}/run/dst"
    assert cli.main(["cp", f"{root}:1", dst]) == 1
    assert "unsafe pack name" in capsys.readouterr().err
    keys = open_storage(f"s3://{s3_server.bucket}/run").list("")
    assert all(k.startswith("dst/") for k in keys), keys
    assert not any("OUTSIDE" in k for k in keys)


def test_the_copy_write_side_refuses_a_listed_key_that_leaves_the_destination(tmp_path):
    src, dst = open_storage(str(tmp_path / "src")), open_storage(str(tmp_path / "dst"))
    old, new = StepLocation(1, "e1-1-aa"), StepLocation(1, "e1-2-bb")  # (source, destination)
    src.write(old.key("x"), b"data")
    with pytest.raises(CorruptCheckpointError, match="unsafe key name"):
        _copy_objects(src, dst, [old.key("x"), old.prefix + "../../../OUTSIDE.bin"], {}, (old, new))
    assert not (tmp_path / "OUTSIDE.bin").exists()
    assert dst.list("") == []  # refused before anything was written


# -- shapes, grids, versions and malformed fields --------------------------------------


def _set_w(**fields: Any) -> Edit:
    def edit(obj: dict[str, Any]) -> None:
        for leaf in obj["leaves"]:
            if leaf.get("name") == "w":
                leaf.update(fields)

    return edit


SHAPES = {
    "2^20 x 2^20 in 1x1 chunks": {"shape": [1 << 20, 1 << 20], "chunk_shape": [1, 1]},
    "2^40": {"shape": [1 << 40], "chunk_shape": [1 << 40]},
    "2^31": {"shape": [1 << 31], "chunk_shape": [8]},
    "chunk of zero": {"chunk_shape": [0, 8]},
    "chunk bigger than the array": {"chunk_shape": [1 << 30, 8]},
    "rank differs": {"chunk_shape": [6]},
    "shape not a list": {"shape": "6x8"},
    "negative extent": {"shape": [-6, 8]},
    "bool extent": {"shape": [True, 8]},
    "unknown dtype": {"dtype": "float99"},
    "no dtype": {"dtype": None},
    "kind": {"kind": "blob"},
    "path": {"path": [["x", "w"]]},
    "grid of another leaf": {"shape": [6, 16], "chunk_shape": [6, 16]},
}


@pytest.mark.parametrize("layout", ["packed", "plain"])
@pytest.mark.parametrize("case", list(SHAPES))
def test_a_tree_record_the_manifest_does_not_vouch_for_is_corrupt_at_once(case, layout, tmp_path):
    root = str(tmp_path / "root")
    _save(root, layout)
    _tamper(root, tree=_set_w(**SHAPES[case]))
    with jaxckpt.CheckpointManager(root) as mgr:
        start = time.monotonic()
        with pytest.raises(CorruptCheckpointError, match=r"step 1|tree\.json"):
            mgr.restore(1)
        assert time.monotonic() - start < 5
        with pytest.raises(CorruptCheckpointError):
            jaxckpt.open_step(root, 1)


MALFORMED_TREES: dict[str, Edit] = {
    "no leaves": lambda o: o.pop("leaves"),
    "leaves not a list": lambda o: o.update(leaves={"w": 1}),
    "leaf not an object": lambda o: o["leaves"].append(7),
    "structure of other leaves": lambda o: o.update(structure=["list", []]),
    "structure unknown container": lambda o: o.update(structure=["set", []]),
    "structure malformed": lambda o: o.update(structure=[1, 2, 3]),
    "versions a list": lambda o: o.update(versions=[1]),
    "another step": lambda o: o.update(step=2),
    "a value leaf holding a dict": lambda o: o["leaves"].append(
        {"path": [["d", "z"]], "kind": "value", "value": {"a": 1}}
    ),
    "two leaves, one array": lambda o: o["leaves"].append(dict(o["leaves"][-1])),
}


@pytest.mark.parametrize("case", list(MALFORMED_TREES))
def test_a_malformed_tree_record_is_corrupt_naming_it(case, tmp_path):
    root = str(tmp_path / "root")
    _save(root, "packed")
    _tamper(root, tree=MALFORMED_TREES[case])
    with jaxckpt.CheckpointManager(root) as mgr, pytest.raises(CorruptCheckpointError) as e:
        mgr.restore(1)
    assert "tree.json" in str(e.value) or "step 1" in str(e.value)


MALFORMED_PARTS: dict[str, Edit] = {
    "chunk size a string": lambda o: _first_chunk(o).__setitem__(1, "52"),
    "chunk size too small": lambda o: _first_chunk(o).__setitem__(1, 2),
    "chunk size of another chunk": lambda o: _first_chunk(o).__setitem__(1, 100),
    "offset negative": lambda o: _first_chunk(o).__setitem__(4, -64),
    "offset past the pack": lambda o: _first_chunk(o).__setitem__(4, 1 << 40),
    "pack not listed": lambda o: o["packs"].clear(),
    "chunk record too short": lambda o: o["arrays"]["w"].__setitem__(0, ["c/0/0"]),
    "chunk off the grid": lambda o: _first_chunk(o).__setitem__(0, "c/9/0"),
    "chunk of another rank": lambda o: _first_chunk(o).__setitem__(0, "c/0"),
    "chunk missing": lambda o: o["arrays"]["w"].pop(),
    "array the tree lacks": lambda o: o["arrays"].update(z=o["arrays"]["b"]),
    "arrays a list": lambda o: o.update(arrays=[]),
    "step a string": lambda o: o.update(step="1"),
    "no process": lambda o: o.pop("process"),
    "a trillion processes": lambda o: o.update(num_processes=10**12),
}


@pytest.mark.parametrize("case", list(MALFORMED_PARTS))
def test_a_malformed_manifest_part_is_corrupt_naming_it(case, tmp_path):
    root = str(tmp_path / "root")
    _save(root, "packed")
    _tamper(root, manifest=MALFORMED_PARTS[case])
    with jaxckpt.CheckpointManager(root) as mgr, pytest.raises(CorruptCheckpointError) as e:
        mgr.restore(1)
    assert "manifest/0.json" in str(e.value) or "step 1" in str(e.value), e.value


def test_a_newer_tree_record_is_refused_clearly(tmp_path):
    root = str(tmp_path / "root")
    _save(root, "packed")
    _tamper(root, tree=lambda o: o.update(version=99))
    expected = pytest.raises(UnsupportedFormatError, match=r"tree\.json has format version 99")
    with jaxckpt.CheckpointManager(root) as mgr, expected:
        mgr.restore(1)


def test_a_root_holding_a_newer_marker_refuses_saves(tmp_path):
    root = str(tmp_path / "root")
    _save(root, "packed")
    storage = open_storage(root)
    marker = CommitProtocol(storage).require_marker(1)
    body = json.loads(marker.to_bytes())
    body.pop("marker_crc32c")
    body["version"] = 99
    body["marker_crc32c"] = crc32c(dumps(body))
    (Path(root) / marker.key).write_bytes(dumps(body))
    with pytest.raises(UnsupportedFormatError, match="version 99"):  # noqa: SIM117
        with jaxckpt.CheckpointManager(root) as mgr:
            mgr.save(2, {"w": np.zeros(3)})
    assert [r.step for r in CommitProtocol(storage).marker_refs()] == [1]  # nothing committed


def test_a_marker_naming_a_trillion_processes_is_damaged_not_iterated(tmp_path, capsys):
    root = str(tmp_path / "root")
    _save(root, "packed")
    marker = CommitProtocol(open_storage(root)).require_marker(1)
    body = json.loads(marker.to_bytes())
    body.pop("marker_crc32c")
    body["num_processes"] = 10**12
    body["marker_crc32c"] = crc32c(dumps(body))
    (Path(root) / marker.key).write_bytes(dumps(body))
    start = time.monotonic()
    with jaxckpt.CheckpointManager(root) as mgr, pytest.raises(CorruptCheckpointError):
        mgr.restore(1)
    assert cli.main(["cp", f"{root}:1", str(tmp_path / "copy")]) == 1
    assert "damaged commit marker" in capsys.readouterr().err
    assert time.monotonic() - start < 10


def test_manifest_parts_parse_every_field_they_round_trip(tmp_path):
    part = ManifestPart(step=1, process=0, num_processes=1, arrays={}, layout="packed")
    assert ManifestPart.from_bytes(part.to_bytes(), "m") == part


def test_promote_refuses_a_local_step_naming_files_outside_it(tmp_path, capsys, caplog):
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    state = {"w": np.arange(48, dtype=np.float32).reshape(6, 8)}
    with jaxckpt.CheckpointManager(root, local_root=str(local), promotion="external") as mgr:
        mgr.save(1, state)
    (tmp_path / "OUTSIDE.bin").write_bytes(b"\0" * (1 << 16))
    _tamper(str(local), manifest=_pack_escape)
    before = _outside(tmp_path)
    cli.main(["promote", str(local), root])  # its exit code is the CLI's (a failed step: 1)
    said = capsys.readouterr()
    told = said.out + said.err + caplog.text
    assert "unsafe pack name '../../../../OUTSIDE.bin'" in told, told
    with jaxckpt.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.steps() == []  # nothing promoted
    after = _outside(tmp_path)
    assert {p for p in after - before if not p.startswith(("durable/", "local/"))} == set()
    assert not any("OUTSIDE" in p for p in after - before)


# -- format 4: parts check themselves; the marker vouches for the set -------------------


def test_a_part_altered_without_its_own_checksum_is_corrupt_naming_it(tmp_path):
    root = str(tmp_path / "root")
    _save(root, "packed")
    storage = open_storage(root)
    loc = CommitProtocol(storage).require_marker(1).location
    obj = json.loads(storage.read(loc.key("manifest/0.json")) or b"")
    _first_chunk(obj)[2] ^= 1  # the chunk's CRC32C, the part's own checksum left as it was
    storage.write(loc.key("manifest/0.json"), dumps(obj))
    with jaxckpt.CheckpointManager(root) as mgr, pytest.raises(CorruptCheckpointError) as e:
        mgr.restore(1)
    assert "manifest/0.json: manifest part checksum mismatch (read twice)" in str(e.value)
    assert not jaxckpt.CheckpointManager(root, read_only=True).verify(1).ok


@pytest.mark.parametrize("field", ["process", "step"])
def test_a_part_that_checks_itself_but_is_another_process_s_or_step_s_is_corrupt(field, tmp_path):
    root = str(tmp_path / "root")
    _save(root, "packed")
    _tamper(root, manifest=lambda o: o.update({field: 7}))
    with jaxckpt.CheckpointManager(root) as mgr, pytest.raises(CorruptCheckpointError) as e:
        mgr.restore(1)
    assert "manifest/0.json is the part of process" in str(e.value), e.value


def test_a_set_of_parts_that_is_not_the_marker_s_is_corrupt_for_a_reader_of_all(tmp_path):
    """A part replaced by another that checks itself (the marker's ``parts_crc32c``
    covers every part's size and CRC32C): ``verify`` and ``cp`` read every part."""
    root = str(tmp_path / "root")
    _save(root, "packed")
    storage = open_storage(root)
    loc = CommitProtocol(storage).require_marker(1).location
    obj = json.loads(storage.read(loc.key("manifest/0.json")) or b"")
    obj.pop("part_crc32c")
    obj["arrays"]["b"] = []  # a valid part, not the one committed
    obj["part_crc32c"] = crc32c(dumps(obj))
    storage.write(loc.key("manifest/0.json"), dumps(obj))
    report = jaxckpt.CheckpointManager(root, read_only=True).verify(1)
    assert not report.ok and "not the ones its marker covers" in str(report.problems[0])
