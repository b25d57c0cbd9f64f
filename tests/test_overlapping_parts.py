"""Two manifest parts that list one chunk with different bytes make the step corrupt.

Every chunk of a step is written once (by its ``replica_id == 0`` holder), so a
chunk listed by two parts with different sizes or checksums is a damaged or forged
manifest: restore took whichever it met last and ``verify`` said intact. Each part
here checks itself and the marker's digests are resealed, as a buggy or hostile
writer could.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import jaxckpt
from jaxckpt.commit._protocol import CommitProtocol
from jaxckpt.records._step import crc32c, dumps
from jaxckpt.storage import open_storage

W = np.arange(48, dtype=np.float32).reshape(6, 8)


def _two_parts(root: str, *, same_bytes: bool) -> None:
    """Step 1 rewritten as a 2-process step: part 1 lists chunk ``c/0/0`` of ``w`` again,
    with the record of another chunk (valid bytes, checksum and all) unless ``same_bytes``."""
    storage = open_storage(root)
    marker = CommitProtocol(storage).require_marker(1)
    loc = marker.location
    part0 = json.loads(storage.read(loc.key("manifest/0.json")) or b"")
    part0.pop("part_crc32c")
    part0["num_processes"] = 2
    chunks = part0["arrays"]["w"]
    first = next(c for c in chunks if c[0] == "c/0/0")
    other = next(c for c in chunks if c[0] != "c/0/0")
    part1 = copy.deepcopy(part0)
    part1["process"] = 1
    part1.pop("process_state", None)
    listed = first if same_bytes else ["c/0/0", *other[1:]]
    part1["arrays"] = {name: [] for name in part0["arrays"]} | {"w": [listed]}
    records = {}
    for name, obj in (("manifest/0.json", part0), ("manifest/1.json", part1)):
        obj["part_crc32c"] = crc32c(dumps(obj))
        records[name] = dumps(obj)
        storage.write(loc.key(name), records[name])
    resealed = dataclasses.replace(
        marker,
        num_processes=2,
        parts_crc32c=crc32c(dumps([[n, len(d), crc32c(d)] for n, d in records.items()])),
    )
    (Path(root) / marker.key).write_bytes(resealed.to_bytes())


@pytest.fixture
def root(tmp_path: Path) -> str:
    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root, chunk_bytes=32) as mgr:  # 8-element chunks
        mgr.save(1, {"w": W})
    return root


def test_a_chunk_listed_twice_with_different_bytes_is_corrupt(root: str, capsys) -> None:
    _two_parts(root, same_bytes=False)
    with jaxckpt.CheckpointManager(root, read_only=True, fallback_on_corrupt=False) as mgr:
        with pytest.raises(jaxckpt.CorruptCheckpointError) as info:
            mgr.restore(1)
        said = str(info.value)
        assert "['w']: chunk c/0/0 is listed twice with different bytes" in said, said
        report = mgr.verify(1)
    assert not report.ok
    assert "listed twice with different bytes" in str(report.problems[0])
    from jaxckpt import cli

    assert cli.main(["verify", root, "1"]) == 1
    assert "listed twice with different bytes" in capsys.readouterr().err


def test_a_chunk_listed_twice_with_the_same_bytes_still_restores(root: str) -> None:
    """The same record twice changes no byte read: the step stays readable."""
    _two_parts(root, same_bytes=True)
    with jaxckpt.CheckpointManager(root, read_only=True) as mgr:
        np.testing.assert_array_equal(mgr.restore(1)["w"], W)
        assert mgr.verify(1).ok
