"""Smoke test of ``scripts/bench.py cloud``: a tiny run writes a table and JSON with every row.

No timing is asserted (a tiny run on a shared machine means nothing), only
that every store/profile/state/layout row is there, restored correctly (the
benchmark raises otherwise) and counted objects and proxy requests.
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


def test_tiny_cloud_bench_writes_a_row_per_profile_state_and_layout(tmp_path: Path) -> None:
    out = tmp_path / "cloud.json"
    argv = [
        "--scale",
        "0.01",
        "--big-mib",
        "0.25",
        "--width",
        "8",
        "--profiles",
        "bare,fast:2:50:100",
    ]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "cloud", *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=SCRIPT_HANG_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    expected = [
        ("s3", profile, state, layout)
        for profile in ("bare", "fast")
        for state in ("big", "small", "mixed")
        for layout in ("raw", "plain", "packed")
    ]
    assert [(r["store"], r["profile"], r["state"], r["layout"]) for r in rows] == expected
    keys = {"save_s", "restore_s", "save_ratio", "restore_ratio", "objects", "leaves"}
    for r in rows:
        assert keys | {"save_requests", "restore_requests", "state_bytes"} <= r.keys(), r
        assert isinstance(r["save_extra_bytes"], int) and r["save_extra_bytes"] >= 0, r
        assert r["objects"] > 0 and r["save_requests"] >= r["objects"], r
        assert r["restore_requests"] > 0 and r["save_s"] > 0 and r["restore_s"] > 0, r
        assert [r["save_s"]] == r["save_rounds_s"] and [r["restore_s"]] == r["restore_rounds_s"]
        assert [r["save_ratio"]] == r["save_ratio_rounds"], r
        assert [r["restore_ratio"]] == r["restore_ratio_rounds"], r
        if r["layout"] == "raw":
            assert r["save_ratio"] == 1.0 and r["objects"] == r["leaves"], r
    table = proc.stdout[proc.stdout.index("| store | profile |") :]
    assert table.count("\n| s3 |") == len(expected)
    assert "| save vs raw |" in table and "| restore requests |" in table
    assert "| save extra memory |" in table
