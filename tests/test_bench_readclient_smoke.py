"""Smoke test of ``scripts/bench.py readclient``: a tiny run writes a table and JSON with every row.

No timing is asserted (a tiny run on a shared machine means nothing), only
that every profile/op/workload/client row is there, that each client's reads
came back as written (the probe raises otherwise) and that every client's
requests went through the shaping proxy, the same number for every reader.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from triggers import SCRIPT_HANG_S

pytestmark = pytest.mark.timeout(SCRIPT_HANG_S + 300)

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"


def test_tiny_readclient_probe_writes_a_row_per_profile_workload_and_client(
    tmp_path: Path,
) -> None:
    out = tmp_path / "readclient.json"
    argv = ["--reads", "6x64KiB,30x4KiB", "--objects", "2", "--writes", "1x1MiB,3x64KiB"]
    argv += ["--rounds", "1", "--profiles", "bare,fast:2:50:100"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "readclient", *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=SCRIPT_HANG_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    readers = ("jaxckpt", "obstore", "obstore-ranges")
    writers = {"one": ("tensorstore", "obstore", "obstore-multipart"),
               "many": ("tensorstore", "obstore")}  # fmt: skip
    expected = [
        row
        for p in ("bare", "fast")
        for row in [
            *[(p, "read", w, c) for w in ("big", "small") for c in readers],
            *[(p, "write", w, c) for w, clients in writers.items() for c in clients],
        ]
    ]
    assert [(r["profile"], r["op"], r["workload"], r["client"]) for r in rows] == expected
    keys = {"seconds", "mb_per_s", "cpu_s", "requests", "connections", "bytes", "count", "size"}
    for r in rows:
        assert keys <= r.keys(), r
        assert r["seconds"] > 0 and r["mb_per_s"] == pytest.approx(r["bytes"] / r["seconds"] / 1e6)
    reads = {(r["profile"], r["workload"], r["client"]): r for r in rows if r["op"] == "read"}
    for (_, workload, _), r in reads.items():
        assert r["requests"] == {"big": 6, "small": 30}[workload], r  # one GET per range
    writes = {(r["profile"], r["workload"], r["client"]): r for r in rows if r["op"] == "write"}
    assert writes[("fast", "one", "tensorstore")]["requests"] == 1  # one PUT
    # initiate, one part (S3 takes parts of 5 MiB or more but the last), complete
    assert writes[("fast", "one", "obstore-multipart")]["requests"] == 3
    assert writes[("fast", "many", "obstore")]["requests"] == 3
    table = proc.stdout[proc.stdout.index("| profile | op |") :]
    assert table.count("\n| bare |") == table.count("\n| fast |") == len(expected) // 2
    assert "| 6 × 64 KiB | jaxckpt |" in table and "| 1 × 1 MiB | obstore-multipart |" in table
