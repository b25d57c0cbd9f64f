"""Step health: policies, marks (API and CLI), restore skipping bad steps, retention keeping
the newest good step, rollback, and crash-loop quarantine with real processes that die."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness
import numpy as np
import pytest
from benchkit import servers

import jaxckpt
from jaxckpt import policy
from jaxckpt.cli import main as cli_main
from jaxckpt.records import _health, _runs
from jaxckpt.storage import open_storage

CHILD = Path(__file__).with_name("health_child.py")
NAN, INF = float("nan"), float("inf")


def state(step: int) -> dict[str, Any]:
    return {"w": np.full(4, step, np.float32), "step": step}


def saved(root: Path, losses: dict[int, float], **options: Any) -> None:
    with jaxckpt.CheckpointManager(root, **options) as mgr:
        for step, loss in losses.items():
            mgr.save(step, state(step), metrics={"loss": loss})
            mgr.wait()


def ls_json(root: Path, capsys: pytest.CaptureFixture[str]) -> dict[int, dict[str, Any]]:
    capsys.readouterr()
    assert cli_main(["ls", str(root), "--json"]) == 0
    return {c["step"]: c for c in json.loads(capsys.readouterr().out)["committed"]}


# ------------------------------------------------------------------------ policies

H = [{"loss": v} for v in (2.0, 1.0, 3.0, 2.0)]  # median of the last 3: 2.0


def loss_below_5(step: int, metrics: Any) -> bool:
    return metrics.get("loss", 0.0) < 5


@pytest.mark.parametrize(
    ("judge", "metrics", "history", "bad"),
    [
        (policy.FiniteMetrics(), {}, [], None),
        (policy.FiniteMetrics(), {"loss": 1.0, "acc": -INF}, [], "metric acc is -inf"),
        (policy.FiniteMetrics(), {"loss": NAN}, [], "metric loss is nan"),
        (policy.MetricSpike("loss", 2.0, 3), {"loss": 4.0}, H, None),  # exactly 2x: good
        (policy.MetricSpike("loss", 2.0, 3), {"loss": 4.5}, H, "loss 4.5 is above 2 x"),
        (policy.MetricSpike("loss", 2.0, 3), {"loss": 9.0}, H[:2], None),  # too few earlier
        (policy.MetricSpike("loss", 2.0, 3), {"acc": 9.0}, H, None),  # no such metric
        (policy.MetricSpike("loss", 2.0, 3), {"loss": NAN}, H, None),  # FiniteMetrics' job
        (policy.MetricSpike("loss", 2.0, 2), {"loss": 5.5}, [*H, {"loss": NAN}], "median 2.5"),
        (policy.health_from(loss_below_5), {"loss": 6.0}, [], "loss_below_5 said bad"),
        (policy.FiniteMetrics() & loss_below_5, {"loss": 6.0}, [], "loss_below_5 said bad"),
        (policy.FiniteMetrics() & loss_below_5, {"loss": NAN}, [], "metric loss is nan"),
        (loss_below_5 | policy.FiniteMetrics(), {"loss": 6.0}, [], None),
        (
            policy.MetricSpike("loss", 2.0, 3) | loss_below_5,
            {"loss": 7.0},
            H,
            "loss 7 is above 2 x the median 2 of the last 3 saves; loss_below_5 said bad",
        ),
    ],
)
def test_health_policy_table(judge, metrics, history, bad):
    reason = judge.check(10, metrics, history)
    assert (reason is None) == (bad is None), reason
    assert bad is None or bad in reason


def test_health_policies_compose_flat_and_validate():
    both = policy.FiniteMetrics() & policy.MetricSpike("loss") & loss_below_5
    assert isinstance(both, policy.AllHealthy) and len(both.policies) == 3
    either = policy.FiniteMetrics() | policy.MetricSpike("loss") | loss_below_5
    assert isinstance(either, policy.AnyHealthy) and len(either.policies) == 3
    for bad in ({"name": ""}, {"name": "loss", "factor": 1.0}, {"name": "l", "window": 0}):
        with pytest.raises(ValueError):
            policy.MetricSpike(**bad)
    with pytest.raises(TypeError, match="health policy"):
        jaxckpt.CheckpointOptions(health=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="crash_loop_limit"):
        jaxckpt.CheckpointOptions(crash_loop_limit=0)


@pytest.mark.parametrize(
    ("keep", "steps", "bad", "kept"),
    [
        (policy.KeepLast(1), [1, 2, 3], [], [3]),
        (policy.KeepLast(1), [1, 2, 3], [3], [2, 3]),
        (policy.KeepLast(2), [1, 2, 3, 4], [3, 4], [2, 3, 4]),
        (policy.KeepLast(1), [1, 2, 3], [1, 2, 3], [3]),  # none good: only the newest
        (policy.KeepLast(1), [1, 2, 3], [2], [3]),  # the newest is good
    ],
)
def test_retention_keeps_the_newest_good_step_table(keep, steps, bad, kept):
    infos = [policy.StepInfo(step=s) for s in steps]
    assert sorted(policy.decide_retention(keep, infos, bad=bad).keep) == kept


# ------------------------------------------------------------- the manager and the CLI


def test_a_nan_step_is_skipped_and_a_spike_detected(tmp_path, caplog, capsys):
    root = tmp_path / "run"
    spike = policy.FiniteMetrics() & policy.MetricSpike("loss", factor=3.0, window=3)
    saved(root, {1: 2.0, 2: 2.1, 3: 1.9, 4: 2.0, 5: 9.0, 6: NAN}, health=spike)
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    with caplog.at_level(logging.WARNING, "jaxckpt"):
        assert mgr.restore()["step"] == 4 and mgr.restored_step == 4
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert skipped == [
        "restore skipped step 6: metric loss is nan",
        "restore skipped step 5: loss 9 is above 3 x the median 2 of the last 3 saves",
    ]
    assert mgr.latest_good_step() == 4 and mgr.latest_step() == 6
    caplog.clear()
    with caplog.at_level(logging.WARNING, "jaxckpt"):
        assert mgr.restore(6)["step"] == 6  # asked for: restored, with a warning
    assert "restoring step 6 although it is marked bad: metric loss is nan" in caplog.text
    health = ls_json(root, capsys)
    assert [(s, c["health"]) for s, c in health.items()] == [
        (1, "unknown"), (2, "unknown"), (3, "unknown"), (4, "unknown"), (5, "bad"), (6, "bad")
    ]  # fmt: skip
    assert health[6]["health_reason"] == "metric loss is nan"
    assert health[4]["health_reason"] is None
    # a new run compares with the good saves before it, read from their markers
    saved(root, {7: 2.2, 8: 7.0}, health=spike)
    assert jaxckpt.CheckpointManager(root, read_only=True).latest_good_step() == 7
    reason = ls_json(root, capsys)[8]["health_reason"]
    # steps 3, 4 and 7 (1.9, 2.0, 2.2): the bad steps 5 and 6 are not compared with
    assert reason == "loss 7 is above 3 x the median 2 of the last 3 saves"


def test_marks_by_api_and_cli_are_reversible_and_never_touch_the_step(tmp_path, capsys):
    root = tmp_path / "run"
    saved(root, {1: 1.0, 2: 1.0})
    step_files = [  # the markers and the data they name
        p
        for p in root.rglob("*")
        if p.is_file() and p.parts[len(root.parts)] in ("data", "attempts")
    ] + sorted(root.glob("commits/0*.json"))
    assert len(step_files) > 2
    before = {p: p.read_bytes() for p in step_files}
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.mark(2, good=False, reason="loss diverged after it")
        assert mgr.restore()["step"] == 1 and mgr.latest_good_step() == 1
        with pytest.raises(jaxckpt.StepNotFoundError, match="no committed step 7"):
            mgr.mark(7, good=False)
    entry = ls_json(root, capsys)[2]
    assert (entry["health"], entry["health_reason"]) == ("bad", "loss diverged after it")
    assert cli_main(["mark", str(root), "2", "--good", "--reason", "a false alarm"]) == 0
    assert "marked step 2 of" in capsys.readouterr().out
    assert ls_json(root, capsys)[2]["health"] == "good"
    assert jaxckpt.CheckpointManager(root, read_only=True).restore()["step"] == 2
    assert cli_main(["mark", str(root), "1", "--bad", "--reason", "bad data\nshard 3"]) == 0
    capsys.readouterr()
    assert cli_main(["ls", str(root)]) == 0
    table = capsys.readouterr().out
    assert "HEALTH" in table.splitlines()[1] and "bad: bad data shard 3" in table
    assert cli_main(["mark", str(root), "9", "--bad"]) == 1
    assert "no committed step 9" in capsys.readouterr().err
    # each mark is its own record, with time and host; the step's own files are as they were
    marks = sorted(open_storage(str(root)).list(_health.MARKS))
    assert len(marks) == 3 and all(_health.parse_mark_key(k) for k in marks)
    record = json.loads((root / marks[0]).read_bytes())
    assert record["host"] and record["time"] > 0 and record["source"] == "mark"
    assert {p: p.read_bytes() for p in step_files} == before


def test_a_verdict_that_cannot_be_written_never_fails_the_save(tmp_path, monkeypatch, caplog):
    def refuse(storage, mark):
        raise jaxckpt.StorageError(28, f"{storage.uri}: no space left")

    monkeypatch.setattr(_health, "write_mark", refuse)
    with caplog.at_level(logging.ERROR, "jaxckpt"), jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state(1), metrics={"loss": NAN})
        mgr.wait()
        assert mgr.steps() == [1] and mgr._health.failures == 1
    assert "could not read or write health of step 1" in caplog.text


def test_untrusted_marks_are_ignored_or_bounded(tmp_path, caplog, capsys):
    root = tmp_path / "run"
    saved(root, {1: 1.0, 2: 1.0})
    storage = open_storage(str(root))
    storage.write(f"{_health.MARKS}2/x.bad.json", b"{}")  # not a mark's name
    storage.write(f"{_health.MARKS}000000000001/junk.bad.json", b"{}")
    key = f"{_health.MARKS}000000000002/{_health.stamp()}.bad.json"
    storage.write(key, b"x" * (_health.MAX_RECORD_BYTES + 10))  # too large to read
    assert _health.bad_steps(storage) == {2}
    with caplog.at_level(logging.WARNING, "jaxckpt"):
        assert ls_json(root, capsys)[2]["health_reason"].startswith("(unreadable mark")
    assert "is over 4096 bytes" in caplog.text


def test_retention_never_deletes_the_newest_good_step(tmp_path):
    root = tmp_path / "run"
    saved(root, {1: 1.0, 2: NAN, 3: INF, 4: NAN}, retention=policy.KeepLast(2))
    mgr = jaxckpt.CheckpointManager(root, retention=policy.KeepLast(2))
    assert mgr.steps() == [1, 3, 4]
    assert set(_health.list_marks(open_storage(str(root)))) == {3, 4}  # 2's went with it
    assert mgr.explain()[1] == ("newest good",)
    assert mgr.restore()["step"] == 1
    mgr.close()
    assert cli_main(["prune", str(root), "--keep-last", "1"]) == 0  # the CLI's rule too
    assert jaxckpt.CheckpointManager(root, read_only=True).steps() == [1, 4]


def test_rollback_restores_the_newest_good_older_step_with_its_process_state(tmp_path, caplog):
    root = tmp_path / "run"
    with jaxckpt.CheckpointManager(root) as mgr:
        with pytest.raises(jaxckpt.StepNotFoundError, match="nothing was saved or restored"):
            mgr.rollback()
        for step in (10, 20, 30):
            mgr.save(step, state(step), metrics={"loss": 1.0}, process_state={"pos": step})
        mgr.mark(20, good=False, reason="suspect")
        loss = NAN  # the loop diverges after step 30
        restored = mgr.rollback() if not math.isfinite(loss) else None
        assert restored["step"] == 10 and mgr.restored_step == 10
        assert mgr.restored_process_state == {"pos": 10}
        with pytest.raises(jaxckpt.StepNotFoundError, match="no good committed step older"):
            mgr.rollback()  # nothing older than 10
        # the steps rolled back past are bad until saved again, which replaces them
        assert mgr.latest_good_step() == 10
        mgr.save(20, state(20), metrics={"loss": 0.5}, process_state={"pos": 20})
        mgr.wait()
        assert mgr.latest_good_step() == 20
    marks = _health.read_marks(open_storage(str(root)))
    assert (marks[30].good, marks[30].reason, marks[30].source) == (
        False,
        "rolled back to step 10",
        "rollback",
    )
    assert marks[20].good and marks[20].source == "policy"
    reopened = jaxckpt.CheckpointManager(root, read_only=True)
    assert reopened.restore()["step"] == 20 and reopened.restored_process_state == {"pos": 20}


# ------------------------------------------------------------------- crash loops


def _run(root: Path, how: str, *extra: str) -> int:
    """One run of ``health_child.py``; the step it restored."""
    proc = subprocess.run(
        [sys.executable, "-u", str(CHILD), str(root), how, *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=harness.child_env(JAX_PLATFORMS="cpu"),
    )
    lines = proc.stdout.splitlines()
    restored = [int(line.split()[1]) for line in lines if line.startswith("RESTORED")]
    assert len(restored) == 1, proc.stderr[-3000:]
    expected = {"sigkill": -9, "preempted": -9, "exit": 3, "clean": 0}[how]
    assert proc.returncode == expected, proc.stderr[-3000:]
    return restored[0]


def test_a_crash_loop_quarantines_its_step_with_real_processes(tmp_path, capsys, caplog):
    root = tmp_path / "run"
    saved(root, {1: 1.0, 2: 1.0})
    # limit 2: a clean exit and a preemption never count (the SIGKILLed run after them
    # restores step 2 again); a SIGKILL and an os._exit without progress do
    runs = ["clean", "preempted", "sigkill", "exit"]
    assert [_run(root, how, "--limit=2") for how in runs] == [2] * len(runs)
    with caplog.at_level(logging.ERROR, "jaxckpt"):
        mgr = jaxckpt.CheckpointManager(root, crash_loop_limit=2)
        assert mgr.restore()["step"] == 1
    assert "step 2: crash loop: restored 2 times without progress" in caplog.text
    entry = ls_json(root, capsys)[2]
    assert entry["health"] == "bad"
    assert entry["health_reason"] == "crash loop: restored 2 times without progress"
    mgr.save(3, state(3))  # progress: this run can no longer count toward a loop
    mgr.wait()
    listed = _runs.list_runs(open_storage(str(root)))
    assert [(r.restored, r.progress, r.exit) for r in listed] == [
        (1, True, None),
        (2, False, None),
        (2, False, None),
        (2, False, "preempted"),
        (2, False, "clean"),
    ]
    mgr.close()
    assert _runs.list_runs(open_storage(str(root)))[0].exit == "clean"
    assert jaxckpt.report(str(root)).restarts[-1].why == "quarantine"  # the ledger says why


def test_a_step_marked_good_by_hand_starts_its_count_again(tmp_path, capsys):
    root = tmp_path / "run"
    saved(root, {1: 1.0, 2: 1.0})
    storage = open_storage(str(root))
    for _ in range(2):  # two runs restored step 2 and died
        _runs.write_restore(storage, _runs.new_run(), 2)
    assert cli_main(["mark", str(root), "2", "--good", "--reason", "fixed the input"]) == 0
    with jaxckpt.CheckpointManager(root, crash_loop_limit=2) as mgr:
        assert mgr.restore()["step"] == 2  # the runs before the mark do not count
    for _ in range(2):
        _runs.write_restore(storage, _runs.new_run(), 2)
    with jaxckpt.CheckpointManager(root, crash_loop_limit=2) as mgr:
        assert mgr.restore()["step"] == 1  # two failed runs since the mark: a loop
    assert ls_json(root, capsys)[2]["health"] == "bad"


def test_run_records_stay_bounded(tmp_path):
    root = tmp_path / "run"
    saved(root, {1: 1.0})
    storage = open_storage(str(root))
    for _ in range(_runs.KEEP_RUNS + 5):
        run = _runs.new_run()
        _runs.write_restore(storage, run, 1)
        _runs.write_exit(storage, run, "clean")
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.restore()
    listed = _runs.list_runs(storage)
    assert len(listed) == _runs.KEEP_RUNS and listed[0].exit == "clean"


@pytest.mark.parametrize(
    ("runs", "loop"),
    [
        ([], (None, 0)),
        ([(5, False, None)], (5, 1)),
        ([(5, False, None), (5, False, None), (4, False, None)], (5, 2)),
        ([(5, False, None), (5, False, "clean"), (5, False, None)], (5, 1)),
        ([(5, False, None), (5, True, None), (5, False, None)], (5, 1)),
        ([(5, False, "preempted"), (5, False, None)], (5, 0)),
        ([(None, False, None)], (None, 0)),  # a run that never restored
    ],
)
def test_crash_loop_counting_table(runs, loop):
    listed = [_runs.Run(f"r{i}", s, p, e) for i, (s, p, e) in enumerate(runs)]
    assert _runs.crash_loop(listed) == loop


def test_the_quarantine_is_the_primarys_decision_with_real_jax_processes(tmp_path):
    root = tmp_path / "run"
    saved(root, {1: 1.0, 2: 1.0})
    storage = open_storage(str(root))
    for _ in range(2):  # two runs of a job restored step 2 and died
        _runs.write_restore(storage, _runs.new_run(), 2)
    # the primary's limit is 2 (a loop), process 1's is 5 (none): both follow the primary
    outs = _group(root, ["--limit=2", "--limit=5"])
    for lines in outs:
        assert "RESTORED 1" in lines and "CLOSED" in lines, lines
    marks = storage.list(_health.MARKS)
    assert len(marks) == 1 and "/000000000002/" in marks[0]  # written once, by the primary
    listed = _runs.list_runs(storage)
    assert [(r.restored, r.exit) for r in listed] == [(1, "clean"), (2, None), (2, None)]


def _group(root: Path, extra: list[str]) -> list[list[str]]:
    """Runs 2 children as one JAX group, restoring and closing; their stdout lines."""
    for _ in range(3):  # the coordinator's port may be taken before process 0 binds it
        port = servers.free_port()
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-u",
                    str(CHILD),
                    str(root),
                    "clean",
                    extra[i],
                    f"--coordinator=127.0.0.1:{port}",
                    "--num-processes=2",
                    f"--process-id={i}",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=harness.child_env(JAX_PLATFORMS="cpu"),
            )
            for i in range(2)
        ]
        try:
            outs = [p.communicate(timeout=150) for p in procs]
        finally:
            for p in procs:
                harness.kill(p)
        if all(p.returncode == 0 for p in procs):
            return [out.splitlines() for out, _ in outs]
        if "address already in use" not in outs[0][1].lower():
            pytest.fail("\n".join(f"process {i}: {err[-3000:]}" for i, (_, err) in enumerate(outs)))
        time.sleep(0.5)
    pytest.fail("no free coordinator port in 3 attempts")
