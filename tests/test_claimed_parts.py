"""A marker's claimed part count is untrusted: it never drives unbounded work.

A format-4 marker covers ``manifest/0.json`` ... ``manifest/<n-1>.json`` for its
``num_processes`` (up to 2^20) without listing them. A crafted marker claiming
2^20 parts with one stored queued a read per claimed part: ``restore`` and
``verify`` ran out of memory after most of a minute, and ``ls`` listed the step
as committed. Here the reads go through a bounded window and stop at the first
missing part; ``ls`` compares the claimed count with the listing. The child runs
under an address-space limit and a timeout, so a regression fails instead of
swapping the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jaxckpt
from jaxckpt.commit._protocol import CommitProtocol
from jaxckpt.records._step import crc32c, dumps
from jaxckpt.storage import open_storage

CHILD = """
import json, sys
import jaxckpt
from jaxckpt import cli
root = sys.argv[1]
out = {}
with jaxckpt.CheckpointManager(root, read_only=True) as mgr:
    for step in (1, 2):
        try:
            mgr.restore(step)
            out[step] = "restored"
        except jaxckpt.CheckpointError as e:
            out[step] = f"{type(e).__name__}: {e}"
    out["fallback"] = int(mgr.restore()["w"][0])
out["verify"] = cli.main(["verify", root, "1"])  # its one-line error goes to stderr
print(json.dumps(out))
"""

LIMIT = 3 << 30  # address space of the child: a regression raises MemoryError, no swap


def _forge_processes(root: str, step: int, count: int) -> None:
    marker = CommitProtocol(open_storage(root)).require_marker(step)
    body = json.loads(marker.to_bytes())
    body.pop("marker_crc32c")
    body["num_processes"] = count
    body["marker_crc32c"] = crc32c(dumps(body))
    (Path(root) / marker.key).write_bytes(dumps(body))


def _limited(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["prlimit", f"--as={LIMIT}", "--", sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def root(tmp_path: Path) -> str:
    """Step 1 claims 2^20 parts (one stored), step 2's only part is gone, step 0 is intact."""
    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root) as mgr:
        for step in (0, 1, 2):
            mgr.save(step, {"w": np.full(8, step, np.float32)})
    _forge_processes(root, 1, 1 << 20)
    storage = open_storage(root)
    marker = CommitProtocol(storage).require_marker(2)
    storage.delete(marker.location.key("manifest/0.json"))
    return root


def test_restore_and_verify_stop_at_the_first_missing_part(root: str) -> None:
    done = _limited("-c", CHILD, root)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["1"].startswith("CorruptCheckpointError: step 1: "), said
    assert said["1"].endswith("manifest/1.json is missing"), said
    assert said["2"].startswith("CorruptCheckpointError: step 2: "), said
    assert said["2"].endswith("manifest/0.json is missing"), said
    assert said["fallback"] == 0  # restore() without a step falls back to the intact one
    assert said["verify"] == 1
    assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr
    assert "manifest/1.json is missing" in done.stderr, done.stderr[-3000:]


def test_ls_shows_a_step_with_claimed_or_missing_parts_as_damaged(root: str, capsys) -> None:
    from jaxckpt import cli

    assert cli.main(["ls", root, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [c["step"] for c in listed["committed"]] == [0]
    reasons = {d["step"]: d["reason"] for d in listed["damaged"]}
    assert reasons == {
        1: "its marker covers manifest/1.json, which is missing (it claims 1,048,576 parts; "
        "1 stored)",
        2: "its marker covers manifest/0.json, which is missing",
    }
    assert cli.main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert ": 1 committed steps (" in out and out.splitlines()[0].endswith(", 2 DAMAGED"), out
    rows = {line.split()[0]: line for line in out.splitlines()[2:5]}
    assert rows["1"].split()[1] == "DAMAGED" and rows["2"].split()[1] == "DAMAGED", out
    assert "manifest/0.json, which is missing; data kept" in rows["2"], out
