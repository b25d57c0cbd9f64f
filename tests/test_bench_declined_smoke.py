"""Smoke test of ``bench.py declined`` (the cost of a declined save by kind of step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from triggers import SCRIPT_HANG_S

pytestmark = pytest.mark.timeout(SCRIPT_HANG_S + 300)

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"


def test_tiny_bench_declined_writes_one_row_per_kind_of_step(tmp_path: Path) -> None:
    out = tmp_path / "bench_declined.json"
    argv = ["declined", "--steps", "6", "--rounds", "1", "--size", "32", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=SCRIPT_HANG_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert list(results) == ["int", "array", "array, read"]
    assert all(set(r) == {"save_ms", "step_s"} for r in results.values())
    assert "| array, read |" in proc.stdout
