"""Smoke tests of ``scripts/bench.py``, the one benchmark entry point, and its subcommands.

A tiny run of each part that fits in a few seconds (``tiers`` and ``listing``
on the session's loopback S3 server) writes tables and JSON that parse;
``replread`` (ten groups of multi-process JAX) is too slow for the suite, and so are
``scale``, ``storm`` and ``denied`` (``tests/test_scale_counts.py`` runs ``scale``;
here the storm's gates and the deny rules are checked on the shared fault proxy
alone). No timing is asserted: the numbers of a tiny run on a shared machine mean
nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import faultproxy
import pytest
from benchkit import servers, storm
from triggers import SCRIPT_HANG_S

pytestmark = pytest.mark.timeout(SCRIPT_HANG_S + 300)

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python scripts/bench.py *argv``, which must succeed."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=SCRIPT_HANG_S
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_tiny_bench_writes_markdown_chart_and_json(tmp_path: Path) -> None:
    out, scratch = tmp_path / "results", tmp_path / "scratch"
    bench("--tiny", "--repeats", "1", "--out", str(out), "--root", str(scratch))

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
    # the packed layout runs side by side in the many-small case (skipped in tiny-big)
    assert "jaxckpt-packed" in cases["tiny-small"]["io"]
    assert "jaxckpt-packed" not in cases["tiny-big"]["io"]
    packed = {t["target"]: t for t in cases["tiny-small"]["targets"]}
    assert packed["save throughput vs raw write+fsync (layout=packed)"]["value"] > 0

    markdown = (out / "bench.md").read_text()
    assert markdown.startswith("# jaxckpt benchmark")
    assert "| case | target | measured | bound | result |" in markdown
    assert "### tiny-big" in markdown and "### tiny-small" in markdown
    assert "| raw write+fsync | jaxckpt | jaxckpt packed | Orbax |" in markdown
    assert report["machine"]["cpu"] in markdown

    png = (out / "bench.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000

    leftovers = list(scratch.iterdir())
    assert leftovers == [], f"scratch directories left behind: {leftovers}"


def test_tiny_bench_packed_writes_one_row_per_state_and_contender(tmp_path: Path) -> None:
    out = tmp_path / "packed.json"
    argv = ["--tiny", "--rounds", "1", "--no-object-stores", "--json", str(out)]
    proc = bench("packed", *argv)
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


def test_tiny_bench_tiers_on_the_session_s3_server(
    tmp_path: Path, s3_server: servers.Server
) -> None:
    out = tmp_path / "bench_tiers.json"
    argv = ["--mb", "1", "--leaves", "2", "--saves", "1", "--every", "2", "--stores", "s3"]
    proc = bench("tiers", *argv, "--s3-endpoint", s3_server.endpoint, "--out", str(out))
    report = json.loads(out.read_text())
    assert report["config"]["mb"] == 1 and report["config"]["stores"] == "s3"
    rows = report["rows"]
    assert [(r["store"], r["kind"], r["saves"]) for r in rows] == [
        ("s3", "direct", 1),
        ("s3", "tiered", 1),
    ]
    direct, tiered = rows
    assert direct["to_local_s"] is None and tiered["to_local_s"] > 0
    for r in rows:
        assert r["blocking_ms"] > 0 and r["to_durable_s"] > 0 and r["base_loop_s"] > 0, r
    assert "| s3 | object store |" in proc.stdout and "| s3 | local tier |" in proc.stdout


def test_tiny_bench_listing_on_the_session_s3_server(
    tmp_path: Path, s3_server: servers.Server
) -> None:
    out = tmp_path / "listing.json"
    argv = ["--steps", "2,5", "--repeats", "1", "--json", str(out)]
    proc = bench("listing", *argv, "--s3-endpoint", s3_server.endpoint)
    results = json.loads(out.read_text())
    ops = {
        "latest_step()",
        "steps()",
        "restore() newest",
        "restore(step)",
        "open (writable)",
        "save until committed",
        "jaxckpt ls",
    }
    assert set(results) == {"local", "s3"}
    for backend, by_steps in results.items():
        assert set(by_steps) == {"2", "5"}, backend
        for n, times in by_steps.items():
            assert set(times) == ops and all(t > 0 for t in times.values()), (backend, n)
    assert "| backend | operation | 2 steps (ms) | 5 steps (ms) | ratio |" in proc.stdout
    assert "| local | restore() newest |" in proc.stdout
    assert "| s3 | latest_step() |" in proc.stdout


def test_bench_all_refuses_an_unknown_part() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "all", "--parts", "core,nope"],
        capture_output=True,
        text=True,
        timeout=SCRIPT_HANG_S,
    )
    assert proc.returncode == 2 and "unknown parts ['nope']" in proc.stderr


def test_bench_all_writes_each_part_result_under_out(tmp_path: Path) -> None:
    out = tmp_path / "results"
    bench("all", "--tiny", "--parts", "listing", "--out", str(out))
    assert sorted(p.name for p in out.iterdir()) == ["bench_all.json", "listing.json"]
    (run,) = json.loads((out / "bench_all.json").read_text())["runs"]
    assert run["part"] == "listing" and run["rc"] == 0
    assert run["argv"][:3] == ["listing", "--json", str(out / "listing.json")]
    assert set(json.loads((out / "listing.json").read_text())) == {"local", "s3"}


def test_tiny_bench_savemem_writes_a_row_per_store_and_layout(tmp_path: Path) -> None:
    out = tmp_path / "savemem.json"
    argv = ["--gib", "0.02", "--leaf-mib", "1", "--stores", "local,s3", "--layouts", "packed"]
    proc = bench("savemem", *argv, "--json", str(out))
    rows = json.loads(out.read_text())
    assert [(r["store"], r["layout"]) for r in rows] == [("local", "packed"), ("s3", "packed")]
    for r in rows:
        assert r["leaves"] == 21 and r["state_bytes"] == 20 * (1 << 20) + 4, r
        assert r["save_s"] > 0 and r["extra_bytes"] >= 0, r
        assert r["extra_ratio"] == r["extra_bytes"] / r["state_bytes"], r
        assert r["packed_bound_bytes"] == 17 * ((64 << 20) + (64 << 10)), r  # 16 + 1 joining
    assert "| store | layout | state |" in proc.stdout and "target: packed extra" in proc.stdout


def _status(endpoint: str, path: str) -> tuple[int, bytes]:
    """The status and body of an unsigned GET (moto answers those too)."""
    try:
        with urllib.request.urlopen(endpoint + path, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_storm_gates_and_deny_rules_drive_the_shared_fault_proxy(
    s3_server: servers.Server,
) -> None:
    """``bench.py storm`` throttles every request from a stormed gate until the next gate;
    ``bench.py denied`` (and tests/denyproxy.py) deny matching requests until cleared."""
    proxy = faultproxy.FaultProxy(s3_server.endpoint)
    storms = storm.Storms(proxy, seconds=60.0, stormed=storm.WITH_OPEN)
    data = f"/{s3_server.bucket}/r/data/0a/1.2/packs/0.0.bin"
    try:
        assert _status(proxy.endpoint, data)[0] == 404  # forwarded: no such key
        storms("save")
        status, body = _status(proxy.endpoint, data)
        assert status == 503 and b"SlowDown" in body
        storms("close")  # the next gate ends a storm still running
        assert _status(proxy.endpoint, data)[0] == 404
        storms("reopen")  # a restart: its open, then its restore, in one storm
        storms("restore")
        assert _status(proxy.endpoint, data)[0] == 503
        storms("close2")
        assert _status(proxy.endpoint, data)[0] == 404
        assert storms.throttled == {"save": 1, "reopen": 1}

        proxy.deny(("GET", "/packs/"))
        status, body = _status(proxy.endpoint, data)
        assert status == 403 and b"AccessDenied" in body
        assert _status(proxy.endpoint, f"/{s3_server.bucket}/r/root.json")[0] == 404
        proxy.clear_rules()
        assert _status(proxy.endpoint, data)[0] == 404
        assert proxy.snapshot()["deny"] == 1
    finally:
        storms.calm()
        proxy.close()
