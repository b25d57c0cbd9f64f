"""``bench.py gameday``: its schedule, its bounds and its goodput as tables, and one smoke run.

The smoke run is one JAX process, 30 steps, a kill and a corrupt newest local step
(``--smoke --kinds sigkill,corrupt --no-baseline``): the supervisor restarts the job
after each, the restores come from the local tier within their bound, and the final
state matches the uninterrupted reference bit for bit with no wrong batch. No timing
is asserted (the goodput of a tiny run on a shared machine means nothing).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from benchkit import gameday

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"

pytestmark = pytest.mark.timeout(300)


def test_the_schedule_is_seeded_and_ends_before_the_last_step() -> None:
    s = gameday.Settings(processes=4, steps=200, mtbf_steps=20, failures=50, seed=3)
    first, again = gameday.schedule(s, 0.1), gameday.schedule(s, 0.1)
    assert first == again and len(first) > 3
    assert all(f.at_step < s.steps - 1 for f in first)
    assert [f.at_step for f in first] == sorted({f.at_step for f in first})  # gaps of >= 2
    assert {f.kind for f in first} <= set(gameday.KINDS)
    assert {f.process for f in first} <= set(range(4))
    other = gameday.schedule(gameday.Settings(steps=200, mtbf_steps=20, seed=4), 0.1)
    assert other != first
    assert gameday.schedule(s, 0.1, k=1) == gameday.schedule(  # schedule k: seed + k
        gameday.Settings(processes=4, steps=200, mtbf_steps=20, failures=50, seed=4), 0.1
    )
    by_time = gameday.Settings(steps=200, mtbf_s=2.0, failures=50, seed=3)  # 20 steps of 0.1 s
    assert gameday.schedule(by_time, 0.1) == gameday.schedule(
        gameday.Settings(steps=200, mtbf_steps=20, failures=50, seed=3), 0.1
    )
    with pytest.raises(ValueError, match="unknown failure kinds"):
        gameday.Settings(kinds=("meteor",))


@pytest.mark.parametrize(
    ("kind", "processes", "bound"),
    [
        ("sigkill", 4, 5),
        ("preempt", 4, 5),
        ("disk_full", 1, 5),
        ("node_loss", 4, 5),  # its replica on the next node heals it
        ("node_loss", 1, 20),  # alone: the durable root's newest step
        ("corrupt", 4, 10),  # the newest step's other copy is gone: the one before
        ("storm", 4, 0),  # nothing restarts
    ],
)
def test_intervals(kind: str, processes: int, bound: int) -> None:
    s = gameday.Settings(processes=processes, every=5, promote_every=20)
    assert gameday.interval_steps(kind, s) == bound


@pytest.mark.parametrize(
    ("settings", "step_s", "every"),
    [
        ({}, 0.155, 10),  # Daly: 2.0 s for 70 ms a save and 30 s between failures: 12.9 steps
        ({"mtbf_s": 8.0}, 0.155, 5),  # 1.0 s: 6.5 steps, and 5 divides the promotion interval
        ({"save_cost_s": 1.0}, 0.155, 20),  # 7.1 s: 45.8 steps, at most one promotion interval
        ({"mtbf_steps": 9}, 0.02, 5),  # 9 steps of 20 ms: Daly's 0.12 s is 5.8 steps
        ({"every": 3}, 0.155, 3),  # chosen
    ],
)
def test_the_local_save_interval_is_dalys_for_the_measured_save_cost(
    settings: dict[str, Any], step_s: float, every: int
) -> None:
    assert gameday.local_interval(gameday.Settings(**settings), step_s) == every


def test_goodput_from_the_supervisors_records() -> None:
    runs: list[dict[str, Any]] = [
        {"restored": 0, "tier": "fresh", "reached": 17, "ended_by": "sigkill", "held": 15},
        {"restored": 15, "tier": "local", "reached": 33, "ended_by": "corrupt", "held": 30},
        {"restored": 25, "tier": "local", "reached": 40, "ended_by": "done"},
    ]
    day = {"runs": runs, "wall_s": 40.0, "finished": True}
    g = gameday.goodput(day, step_s=0.5, steps=40)
    assert g["goodput"] == pytest.approx(0.5)  # 40 steps of 0.5 s in 40 s
    assert [(r["restored_step"], r["reached_step"], r["lost_steps"]) for r in g["restarts"]] == [
        (15, 17, 2),
        (25, 33, 8),
    ]
    assert [r["tier"] for r in g["restarts"]] == ["local", "local"]
    assert [r["bound_steps"] for r in g["restarts"]] == [2, 3]  # the second lost too much
    assert g["lost_steps"] == 10
    for run, startup in zip(runs, (5.0, 4.0, 4.0), strict=True):
        run["startup_s"] = startup
    assert gameday.goodput(day, 0.5, 40)["startup_s"] == 13.0
    assert gameday.goodput({**day, "finished": False}, 0.5, 40)["goodput"] == 0.0


def test_the_wall_time_is_split_into_startup_training_ending_and_between_runs() -> None:
    runs: list[dict[str, Any]] = [
        {"launched_t": 0.0, "first_step_t": 5.0, "last_step_t": 15.0, "steps": 11, "ended_t": 16.0},
        {"launched_t": 18.0, "ended_t": 20.0},  # died before its first step
        {
            "launched_t": 21.0,
            "first_step_t": 24.0,
            "last_step_t": 34.0,
            "steps": 6,
            "ended_t": 34.5,
        },
    ]
    p = gameday.phases(runs)
    assert (p["startup"], p["training"], p["ending"], p["between"]) == (10.0, 20.0, 1.5, 3.0)
    assert p["step_s"] == pytest.approx(20.0 / 15)  # 10 + 5 steps after each run's first


def test_each_restart_is_matched_with_the_failure_that_ended_its_run() -> None:
    """A crash nobody scheduled (a job that died at start) is reported as unplanned, with
    the end of its log; the scheduled kill is matched with the restart after it, the storm
    restarts nothing."""
    crashed = "crash (process 0 exited -6)"
    runs: list[dict[str, Any]] = [
        {"restored": None, "tier": None, "reached": 0, "ended_by": crashed, "crash_log": "F"},
        {"restored": 0, "tier": "fresh", "reached": 12, "ended_by": "sigkill", "held": 10},
        {"restored": 10, "tier": "local", "reached": 20, "ended_by": "done"},
    ]
    fired = [
        {"kind": "storm", "process": 0, "at_reached": 4},
        {"kind": "sigkill", "process": 1, "at_reached": 12},
    ]
    crcs = {(0, s): "c" for s in range(1, 21)}
    day = {"runs": runs, "wall_s": 10.0, "finished": True, "fired": fired, "digest": "d"}
    day |= {"crcs": crcs, "wrong": []}
    ref = {"crcs": crcs, "digest": "d"}
    result = gameday.assess(day, ref, gameday.Settings(processes=2, steps=20), 0.1)
    assert [(f["kind"], f["lost_steps"], f["bound_steps"]) for f in result["failures"]] == [
        ("unplanned: crash (process 0 exited -6)", 0, None),
        ("storm", 0, 0),
        ("sigkill", 2, 2),
    ]
    assert result["bit_exact"] and result["wrong_data"] == 0
    assert result["crash_logs"] == ["F"]
    changed = gameday.assess(
        day,
        {"crcs": {**crcs, (0, 5): "x"}, "digest": "e"},
        gameday.Settings(processes=2, steps=20),
        0.1,
    )
    assert not changed["bit_exact"] and changed["wrong_data"] == 1


def test_schedules_combine_into_mean_goodputs_and_every_failure() -> None:
    """Several schedules: each contender's mean goodput, every failure with its
    schedule's seed, bit-exact and no wrong data only if every day was."""

    def day(seed: int, goodput: float, baseline: float | None, exact: bool) -> dict[str, Any]:
        failures = [{"kind": "sigkill", "lost_steps": 3, "bound_steps": 4}]
        return {"seed": seed, "goodput": goodput, "baseline_goodput": baseline} | {
            "bit_exact": exact,
            "wrong_data": seed,
            "failures": failures,
        }

    both = gameday.combine([day(0, 0.8, 0.7, True), day(1, 0.9, 0.8, False)])
    assert both["goodput"] == pytest.approx(0.85)
    assert both["baseline_goodput"] == pytest.approx(0.75)
    assert both["bit_exact"] is False and both["wrong_data"] == 1
    assert [f["schedule"] for f in both["failures"]] == [0, 1]
    assert gameday.combine([day(0, 0.8, None, True)])["baseline_goodput"] is None
    assert gameday.healthy(gameday.combine([day(0, 0.8, None, True)]))
    with pytest.raises(ValueError, match="schedules"):
        gameday.Settings(schedules=0)


def test_smoke_run_restarts_within_bounds_and_ends_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "gameday.json"
    plot = tmp_path / "day.png"
    argv = ["--smoke", "--kinds", "sigkill,corrupt", "--no-baseline", "--json", str(out)]
    argv += ["--plot", str(plot)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "gameday", *argv],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"goodput", "baseline_goodput", "bit_exact", "wrong_data", "failures"} <= set(result)
    assert result["bit_exact"] is True and result["wrong_data"] == 0
    assert result["baseline_goodput"] is None
    assert 0.0 < result["goodput"] <= 1.0
    assert len(result["failures"]) == 2, result["failures"]
    (day,) = result["schedules"]  # the smoke size runs one schedule
    assert day["seed"] == 0 and day["goodput"] == result["goodput"]
    for f in result["failures"]:
        assert f["kind"] in ("sigkill", "corrupt"), f
        assert f["bound_steps"] is not None and 0 <= f["lost_steps"] <= f["bound_steps"], f
        assert f["bound_steps"] <= 2 * f["interval_steps"], f  # one save in flight at most
    assert [r["tier"] for r in day["restarts"]] == ["local", "local"], day["restarts"]
    assert "| kind | process | at step | lost steps | bound | interval | within |" in proc.stdout
    # The job's own run ledger sees every run (a run killed within its first flush interval
    # wrote at its open, or once its deferred durable epoch was adopted), and its report
    # draws the day.
    ledger = day["ledger"]
    assert len(ledger["lost_steps"]) == len(day["restarts"]), (ledger, day["restarts"])
    assert 0.0 < ledger["goodput"] <= 1.0
    assert plot.read_bytes().startswith(b"\x89PNG")
