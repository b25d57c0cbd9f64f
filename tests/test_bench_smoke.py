"""Smoke test of ``scripts/bench.py``: a tiny run writes a table, a chart and JSON that parse.

No timing is asserted: the numbers of a tiny run on a shared machine mean nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_tiny_bench_writes_markdown_chart_and_json(tmp_path: Path) -> None:
    out, scratch = tmp_path / "results", tmp_path / "scratch"
    argv = ["--tiny", "--repeats", "1", "--out", str(out), "--root", str(scratch)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    report = json.loads((out / "bench.json").read_text())
    assert {"machine", "settings", "cases"} <= report.keys()
    cases = {c["case"]["name"]: c for c in report["cases"]}
    assert set(cases) == {"tiny-big", "tiny-small"}
    for name, case in cases.items():
        for contender, summary in case["io"].items():
            assert summary["errors"] == [], (name, contender, summary["errors"])
            assert summary["n"] == 1 and summary["incorrect"] == 0, (name, contender)
        for contender in ("jaxckpt", "orbax"):
            assert case["loop"][contender]["errors"] == [], (name, contender)
        assert {t["verdict"] for t in case["targets"]} <= {"PASS", "MISS", "n/a"}

    markdown = (out / "bench.md").read_text()
    assert markdown.startswith("# jaxckpt benchmark")
    assert "| case | target | measured | bound | result |" in markdown
    assert "### tiny-big" in markdown and "### tiny-small" in markdown
    assert report["machine"]["cpu"] in markdown

    png = (out / "bench.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000

    leftovers = list(scratch.iterdir())
    assert leftovers == [], f"scratch directories left behind: {leftovers}"


PACKED_SCRIPT = SCRIPT.parent / "bench_packed.py"


def test_tiny_bench_packed_writes_one_row_per_state_and_contender(tmp_path: Path) -> None:
    out = tmp_path / "packed.json"
    argv = ["--tiny", "--rounds", "1", "--no-object-stores", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(PACKED_SCRIPT), *argv],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    contenders = ["plain", "packed", "ocdbt", "orbax-ocdbt"]
    assert [(r["state"], r["backend"], r["layout"]) for r in rows] == [
        (state, "local", layout) for state in ("many", "sharded") for layout in contenders
    ]
    keys = {"objects", "save_requests", "restore_requests", "save_mbps", "restore_mbps"}
    for r in rows:
        assert keys | {"save_rss_mib", "restore_rss_mib", "state_mib"} <= r.keys(), r
        assert r["save_requests"] is None and r["restore_requests"] is None  # no server here
        assert r["save_mbps"] > 0 and r["restore_mbps"] > 0 and r["restore_rss_mib"] >= 0
    objects = {(r["state"], r["layout"]): r["objects"] for r in rows}
    for state, leaves, shards in (("many", 20, 1), ("sharded", 10, 8)):
        # plain: a zarr.json and a chunk per shard of every leaf, plus the step's records
        assert objects[(state, "plain")] > leaves * (shards + 1)
        assert objects[(state, "packed")] <= 4 + 5  # one pack here, plus the step's records
        assert objects[(state, "ocdbt")] < objects[(state, "plain")]
    assert "| state | backend | layout | objects |" in proc.stdout
