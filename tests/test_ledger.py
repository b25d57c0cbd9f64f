"""The run ledger and ``jaxckpt report``: events round-trip on every backend, a failing
ledger never fails a save, a SIGKILLed run shows as a restart with lost steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import harness
import jax
import numpy as np
import pytest

import jaxckpt
from jaxckpt import policy
from jaxckpt.cli import main
from jaxckpt.ledger import LedgerObject, RunEvents, ledger_key, read_ledger
from jaxckpt.ledger._report import build_report
from jaxckpt.storage import open_storage

CHILD = str(Path(__file__).with_name("ledger_child.py"))
KEYS = ["badput_s", "daly", "goodput", "restarts", "saves", "storage", "wall_s"]


def _train(root: str, steps: range, **kwargs: object) -> jaxckpt.CheckpointManager:
    opts = {"save_policy": policy.EveryNSteps(5), "ledger_flush_s": 0.2, **kwargs}
    with jaxckpt.CheckpointManager(root, **opts) as mgr:  # type: ignore[arg-type]
        if mgr.latest_step() is not None:
            mgr.restore()
        for step in steps:
            mgr.save(step, {"w": np.full(64, float(step))})
    return mgr


def _kinds(run: RunEvents, process: int = 0) -> list[str]:
    return [e["kind"] for e in run.events[process]]


def test_ledger_round_trips(storage_root: str) -> None:
    mgr = _train(storage_root, range(1, 13), retention=policy.KeepLast(1))
    assert mgr.ledger.write_failures == 0
    (run,) = read_ledger(open_storage(storage_root))
    assert run.epoch == mgr.epoch and run.processes == 1 and run.skipped == 0
    kinds = _kinds(run)
    assert kinds[0] == "open" and kinds[-1] == "exit" and "first_save" in kinds
    assert [e["step"] for e in run.of("save")] == [5, 10]
    assert run.of("reached")[-1]["step"] == 12
    assert [e["step"] for e in run.of("deleted")] == [5]
    saved = run.of("save")[0]
    assert saved["tier"] == "durable" and saved["nbytes"] > 0 and saved["total_s"] > 0


def test_ledger_lives_with_the_durable_root_through_a_local_tier(
    object_root: str, tmp_path: Path
) -> None:
    local = str(tmp_path / "local")
    tiered = {"local_root": local, "promote_policy": policy.EveryNSteps(10)}
    mgr = _train(object_root, range(1, 11), **tiered)
    _train(object_root, range(11, 12), **tiered)  # restores step 10 from the local tier
    assert open_storage(local).list("ledger/") == []
    run, _ = read_ledger(open_storage(object_root))
    assert {e["tier"] for e in run.of("save")} == {"local"}
    (promoted,) = run.of("promoted")
    assert promoted["step"] == 10 and promoted["durable_s"] is not None
    r = jaxckpt.report(object_root)
    assert r.saves["by_tier"] == {"local": 2} and r.saves["promoted"] == 1
    assert r.storage["written_bytes"] == promoted["nbytes"] > 0
    (restart,) = r.restarts
    assert (restart.restored_step, restart.tier, restart.crash) == (10, "local", False)
    assert mgr.ledger.write_failures == 0


def test_an_unwritable_ledger_never_fails_a_save(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "ledger").write_text("a file where the ledger's directory would go")
    mgr = _train(str(root), range(1, 11))
    assert mgr.ledger.write_failures >= 1
    with jaxckpt.CheckpointManager(str(root), read_only=True) as reader:
        assert reader.steps() == [5, 10]


def test_a_sigkilled_run_is_a_restart_with_lost_steps(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    storage = open_storage(root)

    def reached(step: int) -> bool:
        runs = read_ledger(storage) if storage.list("ledger/") else []
        return any(e["step"] == step for run in runs for e in run.of("reached"))

    with harness.running([sys.executable, CHILD, root, "--until", "13"]) as child:
        child.expect("REACHED 13")
        harness.wait_until(lambda: reached(13), what="reached step 13 in the ledger", timeout_s=60)
        assert child.kill() == -9
    told: list[float] = []

    def listen(name: str, value: float, **kwargs: object) -> None:
        if name == "/jax/jaxckpt/restore/lost_steps":
            told.append(value)

    jax.monitoring.register_scalar_listener(listen)
    try:
        _train(root, range(11, 16))  # restores step 10: steps 11-13 are done again
        harness.wait_until(lambda: told, what="the lost steps told", timeout_s=60)
    finally:
        jax.monitoring.unregister_scalar_listener(listen)
    assert told == [3]  # read off the restore's path, from the killed run's ledger
    r = jaxckpt.report(root)
    (restart,) = r.restarts
    assert (restart.restored_step, restart.reached_step, restart.lost_steps) == (10, 13, 3)
    assert restart.crash and restart.tier == "durable" and restart.lost_s > 0
    assert r.daly["failures"] == 1 and r.daly["optimal_s"] is not None
    assert 0 < r.goodput < 1 and r.badput_s.lost_work == restart.lost_s


def test_report_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "root")
    _train(root, range(1, 8))
    _train(root, range(6, 12))
    png, page = tmp_path / "t.png", tmp_path / "t.html"
    assert main(["report", root, "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(out) == KEYS
    assert sorted(out["badput_s"]) == ["lost_work", "restore", "save_blocking", "startup"]
    (restart,) = out["restarts"]
    assert {"restored_step", "reached_step", "lost_steps", "lost_s", "tier"} <= set(restart)
    assert (restart["restored_step"], restart["reached_step"], restart["lost_steps"]) == (5, 7, 2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["report", root, "--plot", str(page)]) == 0
    assert "goodput" in capsys.readouterr().out
    assert "<svg" in page.read_text()


def _run(epoch: int, *events: dict[str, object]) -> RunEvents:
    return RunEvents(epoch=epoch, processes=1, events={0: [dict(e) for e in events]})


def test_the_report_arithmetic() -> None:
    """Run 1 starts at 0, saves step 10 at t=10 (0.5 s blocking) and dies at t=15 with
    step 15 reached; run 2 starts at 20, restores step 10 (1 s) and exits at 41."""
    first = _run(
        1,
        {"kind": "open", "t": 1.0, "process_start": 0.0, "open_start": 0.5, "tiers": [], "pid": 1},
        {"kind": "first_save", "t": 2.0, "step": 1},
        {"kind": "reached", "t": 2.0, "step": 1},
        {
            "kind": "save",
            "t": 11.0,
            "step": 10,
            "blocking_s": 0.5,
            "total_s": 1.0,
            "nbytes": 8,
            "tier": "durable",
            "started": 10.0,
        },
        {"kind": "reached", "t": 15.0, "step": 15},
    )
    second = _run(
        2,
        {
            "kind": "open",
            "t": 22.0,
            "process_start": 20.0,
            "open_start": 21.0,
            "tiers": [],
            "pid": 2,
        },
        {
            "kind": "restore",
            "t": 23.0,
            "step": 10,
            "tier": "durable",
            "seconds": 1.0,
            "newest": 10,
            "why": None,
            "nbytes": 8,
        },
        {"kind": "first_save", "t": 24.0, "step": 11},
        {"kind": "reached", "t": 40.0, "step": 30},
        {"kind": "exit", "t": 41.0, "closed": True},
    )
    r = build_report("root", [first, second])
    assert r.wall_s == 41.0
    assert (r.badput_s.save_blocking, r.badput_s.restore, r.badput_s.lost_work) == (0.5, 1.0, 5.0)
    assert r.badput_s.startup == 2.0 + 3.0 + 5.0  # each run's start, and the restart's gap
    assert r.goodput == pytest.approx((41.0 - 16.5) / 41.0)
    assert r.daly["failures"] == 1 and r.daly["mtbf_s"] == 41.0


def test_a_run_killed_before_its_restore_was_written_restored_the_newest_save() -> None:
    """Run 2 died within its first flush interval: only its open was written. The newest
    save of the runs before it (step 10, at or below the 15 reached) stands in for what
    it restored, instead of step 0 (15 steps lost where 5 were)."""
    opened = {"kind": "open", "process_start": None, "tiers": [], "pid": 1}
    saved = {"kind": "save", "blocking_s": 0.1, "total_s": 0.2, "nbytes": 8, "tier": "local"}
    first = _run(
        1,
        {**opened, "t": 1.0, "open_start": 0.5},
        {**saved, "t": 10.5, "step": 10, "started": 10.0},
        {"kind": "reached", "t": 21.0, "step": 15},
    )
    second = _run(2, {**opened, "t": 31.0, "open_start": 30.0})
    third = _run(
        3,
        {**opened, "t": 41.0, "open_start": 40.0},
        {"kind": "restore", "t": 41.5, "step": 10, "tier": "local", "seconds": 0.5}
        | {"newest": 10, "why": None, "nbytes": 8},
        {"kind": "first_save", "t": 42.0, "step": 11},
        {"kind": "exit", "t": 50.0, "closed": True},
    )
    one, two = build_report("root", [first, second, third]).restarts
    assert (one.restored_step, one.reached_step, one.lost_steps, one.why) == (
        10,
        15,
        5,
        "unrecorded",
    )
    assert one.tier is None and (two.restored_step, two.lost_steps) == (10, 0)
    unsaved = _run(
        1, {**opened, "t": 1.0, "open_start": 0.5}, {"kind": "reached", "t": 5.0, "step": 4}
    )
    (fresh,) = build_report("root", [unsaved, second]).restarts  # nothing saved before it
    assert (fresh.restored_step, fresh.lost_steps, fresh.why) == (None, 4, None)


def test_progress_made_by_runs_the_ledger_never_heard_of_is_not_badput() -> None:
    """Between run 1 (steps 0-100 at 0.2 s, dead at t=20) and run 2 (from t=60, restoring
    step 200) runs trained that never learned their epoch (a storm over their whole life):
    of the 40 s gap, the 100 steps kept (20 s) are not badput, the rest is."""
    opened = {"kind": "open", "process_start": None, "tiers": [], "pid": 1}
    first = _run(
        1,
        {**opened, "t": 0.0, "open_start": 0.0},
        {"kind": "first_save", "t": 0.0, "step": 0},
        {"kind": "reached", "t": 20.0, "step": 100},
    )
    second = _run(
        2,
        {**opened, "t": 60.0, "open_start": 60.0},
        {"kind": "restore", "t": 60.0, "step": 200, "tier": "durable", "seconds": 0.0}
        | {"newest": 200, "why": None, "nbytes": 8},
        {"kind": "first_save", "t": 60.0, "step": 201},
        {"kind": "reached", "t": 70.0, "step": 251},
        {"kind": "exit", "t": 70.0, "closed": True},
    )
    r = build_report("root", [first, second])
    assert r.badput_s.startup == pytest.approx(20.0)
    assert r.goodput == pytest.approx(50.0 / 70.0)
    assert r.restarts[0].lost_steps == 0


def test_a_run_that_died_before_its_progress_was_written_trained_from_its_restore() -> None:
    """Run 1 (steps 0-100 at 0.2 s, step 90 saved, dead at t=20); run 2 opens at t=25 and
    dies before its next flush (nothing but its open written); run 3 opens at t=40 and
    restores step 140: run 2 trained steps 90-140 (10 s) of the 15 s after its open, and
    only the rest is badput (the report counted all 15 s, and a day of frequent kills
    read 0.54 against the supervisor's 0.66)."""
    opened = {"kind": "open", "process_start": None, "tiers": [], "pid": 1}
    saved = {"kind": "save", "t": 18.5, "step": 90, "blocking_s": 0.0, "total_s": 0.5}
    first = _run(
        1,
        {**opened, "t": 0.0, "open_start": 0.0},
        {"kind": "first_save", "t": 0.0, "step": 0},
        saved | {"nbytes": 8, "tier": "local", "started": 18.0},
        {"kind": "reached", "t": 20.0, "step": 100},
    )
    second = _run(2, {**opened, "t": 25.0, "open_start": 24.0})
    third = _run(
        3,
        {**opened, "t": 40.0, "open_start": 40.0},
        {"kind": "restore", "t": 40.0, "step": 140, "tier": "local", "seconds": 0.0}
        | {"newest": 140, "why": None, "nbytes": 8},
        {"kind": "first_save", "t": 40.0, "step": 141},
        {"kind": "reached", "t": 50.0, "step": 191},
        {"kind": "exit", "t": 50.0, "closed": True},
    )
    r = build_report("root", [first, second, third])
    assert [x.restored_step for x in r.restarts] == [90, 140]  # run 2's: the newest save
    assert r.badput_s.startup == pytest.approx(1.0 + 4.0 + 5.0)  # run 2's open, two gaps
    assert r.badput_s.lost_work == pytest.approx(2.0)  # run 1: steps 90-100
    assert r.goodput == pytest.approx(38.0 / 50.0)
    # Killed early twice: run 2 (open at t=25) and run 3 (open at t=32, nothing else);
    # run 4 (t=40) restores step 140, 50 steps (10 s) past the newest save runs 2-3 knew.
    again = _run(3, {**opened, "t": 32.0, "open_start": 32.0})
    fourth = RunEvents(epoch=4, processes=1, events=third.events)
    r = build_report("root", [first, second, again, fourth])
    assert [x.restored_step for x in r.restarts] == [90, 90, 140]
    assert r.badput_s.startup == pytest.approx(1.0 + 4.0 + 7.0 + 8.0 - 10.0)
    assert r.goodput == pytest.approx(38.0 / 50.0)


def test_the_reader_skips_what_is_not_a_ledger_object(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    good = LedgerObject(
        epoch=3,
        process=0,
        seq=0,
        processes=1,
        events=({"kind": "reached", "t": 1.0, "step": 4}, {"kind": "reached", "t": 2.0}),
    )
    storage.write(ledger_key(3, 0, 0), good.to_bytes())
    storage.write(ledger_key(3, 0, 1), b"{" * (2 << 20))  # oversized
    storage.write(ledger_key(3, 1, 0), good.to_bytes())  # the body names another process
    storage.write("ledger/000000000003/000000/x.json", good.to_bytes())  # not a ledger name
    (run,) = read_ledger(storage)
    assert run.of("reached") == [{"kind": "reached", "t": 1.0, "step": 4}]
    assert run.skipped == 3  # the event without a step, the oversized and the mismatched


def test_saves_and_restores_are_recorded_under_orbax_names(tmp_path: Path) -> None:
    seen: list[str] = []

    def listen(name: str, *args: object, **kwargs: object) -> None:
        seen.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    jax.monitoring.register_scalar_listener(listen)
    try:
        _train(str(tmp_path / "root"), range(1, 6))
        _train(str(tmp_path / "root"), range(6, 7))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
        jax.monitoring.unregister_scalar_listener(listen)
    for name in (
        "/jax/orbax/write/blocking_duration_secs",
        "/jax/orbax/write/total_duration_secs",
        "/jax/orbax/write/gbytes_per_sec",
        "/jax/orbax/read/total_duration_secs",
        "/jax/checkpoint/read/gbytes_per_sec",
        "/jax/jaxckpt/startup/first_save_secs",
    ):
        assert name in seen, name


def test_the_compilation_cache_is_kept_in_a_local_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    before = jax.config.jax_compilation_cache_dir
    try:
        with jaxckpt.CheckpointManager(str(root), compilation_cache=True):
            assert jax.config.jax_compilation_cache_dir == str(root / "compilation-cache")
    finally:
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()
    with pytest.raises(ValueError, match="compilation_cache needs a local_root"):
        jaxckpt.CheckpointManager("s3://bucket/run", compilation_cache=True)


def test_a_job_of_several_processes_keeps_each_process_step_and_leaves_jax_cache_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """JAX's cache writes from process 0 alone: in the local tier of a job of several
    processes it would serve process 0 only, so ``compile`` keeps each process's step."""
    from jaxckpt.ledger import _run

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    before = jax.config.jax_compilation_cache_dir
    caplog.set_level("INFO", logger="jaxckpt")
    ledger = _run.RunLedger.starting(
        tmp_path / "root",
        jaxckpt.CheckpointOptions(local_root=str(tmp_path / "local"), compilation_cache=True),
    )
    assert jax.config.jax_compilation_cache_dir == before
    assert "CheckpointManager.compile keeps each process's step" in caplog.text
    assert ledger.executables is not None
    assert ledger.executables.directory == str(tmp_path / "local/compilation-cache/executables")


def _lowered(scale: float) -> jax.stages.Lowered:
    def step(w: jax.Array, x: jax.Array) -> jax.Array:
        return w - scale * jax.numpy.tanh(x @ w).T @ x  # w's shape: its buffer is donated

    return jax.jit(step, donate_argnums=0).lower(
        np.ones((8, 8), np.float32), np.ones((2, 8), np.float32)
    )


def test_compile_keeps_the_step_and_a_restart_loads_it(tmp_path: Path) -> None:
    """The first run compiles and keeps the executable; the next loads it and computes the
    same bits; a damaged file is compiled again (counted, said) and replaced; a program
    that differs is another entry; only the newest ``KEEP`` per process stay."""
    from jaxckpt.ledger._executables import KEEP, ExecutableCache

    def run(scale: float = 2.0) -> tuple[ExecutableCache, np.ndarray]:
        cache = ExecutableCache(str(tmp_path / "cc"))  # a restarted process's
        w, x = np.arange(64, dtype=np.float32).reshape(8, 8) / 64, np.ones((2, 8), np.float32)
        return cache, np.asarray(cache.compile(_lowered(scale))(w, x))

    first, want = run()
    (kept,) = (tmp_path / "cc/executables").iterdir()
    assert (first.compiled, first.loaded, first.failures, first.outcome) == (1, 0, 0, "compiled")
    second, got = run()
    assert (second.compiled, second.loaded, second.failures) == (0, 1, 0)
    assert second.outcome == "loaded"
    assert got.tobytes() == want.tobytes()

    data = bytearray(kept.read_bytes())
    data[-10] ^= 0xFF
    kept.write_bytes(bytes(data))
    third, got = run()
    assert (third.compiled, third.loaded, third.failures) == (1, 0, 1)
    assert third.outcome == "recompiled"
    assert got.tobytes() == want.tobytes()
    assert run()[0].loaded == 1  # replaced by a whole one

    for scale in range(3, 3 + KEEP):
        assert run(float(scale))[0].compiled == 1
    assert len(list((tmp_path / "cc/executables").iterdir())) == KEEP
    assert run(float(2 + KEEP))[0].loaded == 1  # the newest stay
    with pytest.raises(TypeError, match=r"jax.stages.Lowered"):
        first.compile(jax.jit(lambda v: v))


def test_the_compile_is_an_event_the_report_shows_per_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each run's ``compile`` (its outcome and seconds) is in the ledger and recorded
    under ``/jax/jaxckpt/startup/compile_secs``; a restart's row says how it compiled."""
    root = str(tmp_path / "root")
    heard: list[tuple[str, dict[str, object]]] = []

    def listen(name: str, *args: object, **kwargs: object) -> None:
        heard.append((name, kwargs))

    def run(steps: range) -> None:
        with jaxckpt.CheckpointManager(
            root, compilation_cache=True, ledger_flush_s=0.2, save_policy=policy.EveryNSteps(5)
        ) as mgr:
            mgr.compile(_lowered(2.0))
            if mgr.latest_step() is not None:
                mgr.restore()
            for step in steps:
                mgr.save(step, {"w": np.full(64, float(step))})

    before = jax.config.jax_compilation_cache_dir
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        run(range(1, 6))
        run(range(6, 11))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()
    runs = read_ledger(open_storage(root))
    assert [[e["outcome"] for e in r.of("compile")] for r in runs] == [["compiled"], ["loaded"]]
    outcomes = [kw["outcome"] for name, kw in heard if name.endswith("startup/compile_secs")]
    assert outcomes == ["compiled", "loaded"]
    (restart,) = jaxckpt.report(root).restarts
    assert restart.compile == "loaded" and restart.compile_s is not None
    assert restart.compile_s < 60
    assert main(["report", root]) == 0
    header, row = [
        line
        for line in capsys.readouterr().out.splitlines()
        if "RESTART" in line or " loaded " in line
    ]
    assert header.split()[-1] == "COMPILE" and " loaded " in row


def test_compile_without_the_cache_compiles(tmp_path: Path) -> None:
    with jaxckpt.CheckpointManager(str(tmp_path / "root")) as mgr:
        compiled = mgr.compile(_lowered(1.0))
        assert isinstance(compiled, jax.stages.Compiled)
        assert mgr.ledger.executables is None
    assert not (tmp_path / "root/compilation-cache").exists()


def test_a_restarted_process_loads_its_compiled_step_from_the_cache(tmp_path: Path) -> None:
    """The first run compiles the step (a program far under JAX's default 1 s threshold)
    into the cache beside the checkpoints; the next process loads it instead."""
    root = tmp_path / "root"
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("cache_child.py")), str(root)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-3000:]
        runs.append(next(line for line in proc.stdout.splitlines() if line.startswith("CACHE")))
    first, second = runs
    assert first != "CACHE hits=0 misses=0" and "hits=0" in first, runs
    assert any((root / "compilation-cache").iterdir())
    assert second.startswith("CACHE hits=") and "misses=0" in second and "hits=0" not in second


def test_a_loop_that_raises_ends_a_failed_run(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    with pytest.raises(RuntimeError), jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": np.zeros(4)})
        raise RuntimeError("the loss diverged")
    _train(root, range(2, 3))
    (run, _) = read_ledger(open_storage(root))
    assert run.of("exit")[0]["error"] == "RuntimeError: the loss diverged"
    (restart,) = jaxckpt.report(root).restarts
    assert restart.crash and restart.restored_step == 1


def test_a_restore_that_falls_back_says_why(tmp_path: Path) -> None:
    from rootpaths import data_objects

    root = str(tmp_path / "root")
    _train(root, range(1, 11))
    for key in data_objects(root, 10):  # step 10 damaged at rest: the restore takes step 5
        path = tmp_path / "root" / key
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    _train(root, range(6, 7))
    (restart,) = jaxckpt.report(root).restarts
    assert (restart.restored_step, restart.why, restart.lost_steps) == (5, "fallback", 5)


def test_the_trainer_serves_prometheus_metrics(tmp_path: Path) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root, save_policy=policy.EveryNSteps(5), metrics_port=port) as m:
        for step in range(1, 8):
            m.save(step, {"w": np.zeros(4)})
        m.wait()
        m.save(8, {"w": np.zeros(4)})  # declined; the committed save 5 is counted now
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    assert "jaxckpt_reached_step 8.0" in text and "jaxckpt_saves_total 1.0" in text
    with socket.socket() as s:  # closing the manager stopped the server: no one listens
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT, not a listener
        s.bind(("127.0.0.1", port))


def test_an_exit_with_the_manager_open_is_recorded_as_a_clean_end(tmp_path: Path) -> None:
    """The interpreter's exit handler (``atexit``) ends a run left open, flushing its last
    events; close() after it adds nothing."""
    from jaxckpt.ledger import _run

    root = str(tmp_path / "root")
    mgr = jaxckpt.CheckpointManager(root, save_policy=policy.EveryNSteps(5))
    for step in range(1, 8):
        mgr.save(step, {"w": np.zeros(4)})
    mgr.wait()
    _run._at_exit()
    mgr.close()
    (run,) = read_ledger(open_storage(root))
    assert run.events[0][-1]["kind"] == "exit" and run.events[0][-1]["closed"] is False
    assert len(run.of("exit")) == 1
    assert [e["step"] for e in run.of("save")] == [5] and run.of("reached")[-1]["step"] == 7
