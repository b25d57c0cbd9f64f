"""The cluster-scale model behind ``jaxckpt plan --processes`` (``jaxckpt/planning/_scale.py``,
its counts per process ``_profiles.py``, its stores and constants ``_assumptions.py``)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from jaxckpt import cli
from jaxckpt.planning import PROFILES, STORES, Linear, PhaseCost, fit_profile, scale_plan
from jaxckpt.planning._measured import REPORT, measured_profile


def _report(points: dict[int, tuple[int, int, int, int]]) -> dict[str, object]:
    """A ``bench.py scale --json`` report: per N (meta reads, meta writes, parts, calls)."""
    runs = []
    for n, (reads, writes, parts, calls) in points.items():
        figures = {
            "meta_reads": reads,
            "meta_writes": writes,
            "manifest_gets": parts,
            "coordination_calls": calls,
        }
        runs.append(
            {
                "processes": n,
                "summary": {
                    p: {r: figures for r in ("primary", "others_max")} for p in ("save", "restore")
                },
            }
        )
    return {"runs": runs}


def test_fit_recovers_lines_and_constants() -> None:
    profile = fit_profile(_report({2: (6, 3, 2, 9), 4: (8, 3, 4, 13), 8: (12, 3, 8, 21)}))
    row = profile.formulas["restore"]["other"]
    assert row["meta_reads"] == Linear(a=4.0, b=1.0)
    assert row["meta_writes"] == Linear(a=3.0, b=0.0)
    assert row["parts_read"] == Linear(a=0.0, b=1.0)
    assert row["coordination_calls"] == Linear(a=5.0, b=2.0)
    assert profile.value("save", "primary", "coordination_calls", 1024) == 5 + 2 * 1024
    with pytest.raises(ValueError, match="no runs"):
        fit_profile({"runs": []})


def _row(rows: list[PhaseCost], store: str, n: int, phase: str) -> PhaseCost:
    (found,) = [r for r in rows if (r.store, r.processes, r.phase) == (store, n, phase)]
    return found


def test_the_counts_before_format_4_exceed_s3_on_restore_at_a_thousand_processes() -> None:
    rows = scale_plan(processes=[16, 1024], profile=PROFILES["before"], stores=["s3"])
    small = _row(rows, "s3", 16, "restore")
    assert not small.limit_exceeded and small.time_s == small.unthrottled_s
    big = _row(rows, "s3", 1024, "restore")
    assert big.limit_exceeded and big.fails and big.time_s > 60
    # every process reads every part: N parts of a 1.1 TB state's records each
    assert big.metadata_mb_other == big.metadata_mb_primary > 1000
    assert big.coordination_cluster > 1024**2


@pytest.mark.parametrize("rtt_ms", [20, 50])
def test_the_target_meets_the_issue_bounds_on_s3_with_hashed_prefixes(rtt_ms: int) -> None:
    """Issue 35's model target: under 10 s at 1,024 and under 60 s at 8,192 on S3."""
    from jaxckpt.planning import Link

    rows = scale_plan(
        processes=[1024, 8192],
        profile=PROFILES["target"],
        prefixes=256,
        stores=["s3"],
        link=Link(rtt_s=rtt_ms / 1e3),
    )
    for r in rows:
        bound = 10 if r.processes == 1024 else 60
        assert r.time_s < bound and not r.limit_exceeded, r


def test_prefixes_multiply_s3_rates_not_the_gcs_bucket_rate() -> None:
    one, many = (  # the same packs at both (no write budget: it would follow the rates)
        scale_plan(processes=[8192], profile=PROFILES["target"], prefixes=k, write_budget=False)
        for k in (1, 64)
    )
    s3_one, s3_many = _row(one, "s3", 8192, "save"), _row(many, "s3", 8192, "save")
    assert s3_one.limit_s == pytest.approx(64 * s3_many.limit_s)
    assert s3_one.limit_exceeded and not s3_many.limit_exceeded
    gcs_one, gcs_many = _row(one, "gcs", 8192, "save"), _row(many, "gcs", 8192, "save")
    assert gcs_one.limit_s == gcs_many.limit_s > 60
    assert STORES["gcs"].per_prefix is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stores": ["azure"]}, "unknown stores"),
        ({"prefixes": 0}, "prefixes"),
        ({"processes": [0]}, "processes"),
        ({"state_bytes": -1.0}, "state_bytes"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"processes": [8], "profile": PROFILES["before"], **kwargs}
    with pytest.raises(ValueError, match=message):
        scale_plan(**args)  # type: ignore[arg-type]


def test_cli_prints_the_table_and_every_assumption(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--processes", "1024,8192", "--stores", "s3", "--prefixes", "1"]
    argv += ["--counts", "before"]  # the counts before format 4, on one prefix: restores fail
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "s3     1,024  restore" in out and "fails, retries give up" in out
    for needle in ("assumptions:", "85 MB/s per connection", "3,500 PUT", "least-squares fit"):
        assert needle in out, needle


def test_cli_json_fits_a_report_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    report = tmp_path / "bench_scale.json"
    report.write_text(json.dumps(_report({2: (5, 1, 2, 6), 4: (7, 1, 4, 8)})))
    argv = ["plan", "--processes", "1024", "--counts", str(report), "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rows"]) == 4  # s3 and gcs, save and restore
    assert any("bench_scale.json" in line for line in out["assumptions"])
    restore = next(r for r in out["rows"] if r["store"] == "s3" and r["phase"] == "restore")
    assert restore["coordination_primary"] == 4 + 1024


def test_cli_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["plan", "--processes", "64", "--counts", str(tmp_path / "nope")]) == 2
    assert "--counts" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "--step-seconds", "1"])  # neither the interval's options nor N
    assert exc.value.code == 2
    assert "required: --params, --write-gbps" in capsys.readouterr().err


def test_the_default_counts_are_the_current_formats_measured_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The shipped ``bench.py scale --json`` report fits a profile whose per-process counts
    do not grow with N, except the primary's (the commit lists every process's keys); the
    CLI uses it unless ``--counts`` names another."""
    profile = measured_profile()
    report = json.loads(resources.files("jaxckpt.planning").joinpath(REPORT).read_text())
    assert len({r["processes"] for r in report["runs"]}) >= 2  # a fit, not one point
    for phase in ("save", "restore"):
        for metric, line in profile.formulas[phase]["other"].items():
            assert line.b == 0, (phase, metric, str(line))  # constant per process
    restore = profile.formulas["restore"]["primary"]
    assert restore["parts_read"].b == 0 and restore["meta_reads"].b == 0
    assert cli.main(["plan", "--processes", "1024,8192", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert any(REPORT in line and "measured" in line for line in out["assumptions"])
    assert not any(r["fails"] for r in out["rows"])  # no phase of today's code gives up
    assert cli.main(["plan", "--processes", "8", "--counts", "nope"]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in ("measured", "before", "target"))
