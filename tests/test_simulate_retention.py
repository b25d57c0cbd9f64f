"""Runs scripts/simulate_retention.py and checks its numbers hang together."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from triggers import SCRIPT_HANG_S

pytestmark = pytest.mark.timeout(SCRIPT_HANG_S + 300)

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load_script() -> ModuleType:
    import simulate_retention  # scripts/ is on the suite's pythonpath

    return simulate_retention


def _table_rows(text: str) -> dict[str, list[str]]:
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows[1:]]
    return {c[0]: c[1:] for c in cells}


def test_script_output_matches_the_committed_table() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "simulate_retention.py")],
        check=True,
        capture_output=True,
        text=True,
        timeout=SCRIPT_HANG_S,
    ).stdout
    assert out.strip() == (SCRIPTS / "simulate_retention.md").read_text().strip()
    rows = _table_rows(out)
    assert rows["keep all"] == ["725", "0", "725", "43.50 TB", "43.50 TB"]
    assert rows["last 3 + milestones (1, 2, 5)"] == ["725", "713", "12", "780 GB", "720 GB"]
    assert "725,760 steps" in out


def test_simulation_numbers_are_consistent() -> None:
    sim = _load_script()
    assert sim.total_steps() == 725_760
    keep_all, retained = sim.scenarios()
    for result in (keep_all, retained):
        assert result.written == 725_760 // 1000 == 725
        assert result.written == result.deleted + len(result.kept)
        assert result.kept[-1] == 725_000
    assert keep_all.deleted == 0
    assert keep_all.final_gb == keep_all.peak_gb == 725 * 60
    assert retained.kept == (
        1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000,
        723_000, 724_000, 725_000,
    )  # fmt: skip
    assert retained.final_gb == 12 * 60
    # The new checkpoint is written before retention deletes old ones: one extra at peak.
    assert retained.peak_checkpoints == len(retained.kept) + 1
