"""Tiers: saves to a local tier, promotion to a durable root (local, S3, GCS), restore from either.

Real processes throughout: a tiered trainer SIGKILLed after its local
commits, ``jaxckpt promote`` run as a command, killed mid-upload and rerun,
and as a watching sidecar scraped over HTTP.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import harness
import numpy as np
import pytest
from rootpaths import chunk_path, data_objects, data_steps
from tier_child import state
from trees import assert_tree_bitexact

import jaxckpt
from jaxckpt import cli, policy
from jaxckpt.commit import CommitProtocol, list_attempt
from jaxckpt.records import ATTEMPTS, DATA, parse_data_key, read_requests
from jaxckpt.storage import open_storage

CHILD = str(Path(__file__).with_name("tier_child.py"))
TIMEOUT_S = 120.0


def tiered(root: str, local: Path, **kwargs: Any) -> jaxckpt.CheckpointManager:
    return jaxckpt.CheckpointManager(root, local_root=str(local), chunk_bytes=64 << 10, **kwargs)


def durable_steps(root: str) -> list[int]:
    return sorted(CommitProtocol(open_storage(root)).committed())


def promote_argv(local: Path, root: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "jaxckpt", "promote", str(local), root, *args]


def promote_cli(local: Path, root: str, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        promote_argv(local, root, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONFAULTHANDLER": "1", **env},  # SIGABRT: every stack
    )


def finish(proc: subprocess.Popen[str], timeout: float = TIMEOUT_S) -> tuple[int, str, str]:
    """Its exit code and output; one that does not exit in time fails the test with the
    stacks of its threads (faulthandler's, on SIGABRT) and its last output."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(
            f"{proc.args} did not exit within {timeout:g}s; stdout:\n{out[-3000:]}\n"
            f"stderr:\n{err[-8000:]}"
        ) from None
    return proc.returncode, out, err


def test_saves_go_local_chosen_steps_become_durable_retention_per_tier(storage_root, tmp_path):
    local = tmp_path / "local"
    mgr = tiered(
        storage_root,
        local,
        promote_policy=policy.EveryNSteps(2),
        local_retention=policy.KeepLast(2),
        retention=policy.KeepLast(2),
    )
    assert mgr.root == open_storage(storage_root).uri and mgr.local_root == str(local)
    for step in range(1, 7):
        assert mgr.save(step, state(step))
        assert mgr.wait_durable(timeout_s=TIMEOUT_S) == (step // 2 * 2 or None)
    mgr.wait_for_deletions(timeout_s=TIMEOUT_S)
    mgr.close()  # joins the promoter: durable retention ran after the last promotion
    assert mgr.steps(tier="local") == [5, 6]  # local KeepLast(2)
    assert mgr.steps(tier="durable") == [4, 6]  # every 2nd step, durable KeepLast(2)
    assert mgr.steps() == [4, 5, 6] and mgr.latest_step() == 6
    stats = {s.step: s for s in mgr.save_stats()}
    assert stats[6].durable_s is not None and stats[6].durable_s >= stats[6].blocking_s
    assert stats[5].durable_s is None  # not chosen for promotion
    with pytest.raises(ValueError, match="tier"):
        mgr.steps(tier="nvme")
    assert durable_steps(storage_root) == [4, 6]
    assert read_requests(CommitProtocol(open_storage(str(local)))) == {}
    # A plain manager of the durable root sees an ordinary root.
    with jaxckpt.CheckpointManager(storage_root, read_only=True) as plain:
        assert_tree_bitexact(plain.restore(4), state(4))


def test_a_packed_local_tier_promotes_by_copying_its_packs(object_root, tmp_path):
    local = tmp_path / "local"
    mgr = tiered(object_root, local, layout="packed", promote_policy=policy.EveryNSteps(1))
    assert mgr.save(1, state(1))
    assert mgr.wait_durable(timeout_s=TIMEOUT_S) == 1
    mgr.close()
    local_objects = [k.rsplit("/", 2)[-2:] for k in data_objects(str(local), 1)]
    durable_objects = [k.rsplit("/", 2)[-2:] for k in data_objects(object_root, 1)]
    assert durable_objects == local_objects and all(d == "packs" for d, _ in durable_objects)
    assert 1 <= len(durable_objects) <= 4
    with jaxckpt.CheckpointManager(object_root, read_only=True) as durable:
        assert_tree_bitexact(durable.restore(1), state(1))
        assert durable.verify(1).ok


@pytest.mark.usefixtures("plain_by_default")
def test_restore_falls_back_to_durable_for_a_corrupt_or_wiped_local_tier(
    storage_root, tmp_path, caplog
):
    local = tmp_path / "local"
    with tiered(storage_root, local) as mgr:  # every step promoted
        for step in (1, 2):
            mgr.save(step, state(step))
        assert mgr.wait_durable(timeout_s=TIMEOUT_S) == 2
    path = Path(chunk_path(str(local), 2, "w", 1, 0))
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="jaxckpt"), tiered(storage_root, local) as mgr:
        assert mgr.steps(tier="local") == [1, 2] and mgr.steps(tier="durable") == [1, 2]
        assert_tree_bitexact(mgr.restore(), state(2))  # step 2, from the durable copy
        assert_tree_bitexact(mgr.restore(2), state(2))
    assert "local copy of step 2 is corrupt" in caplog.text
    shutil.rmtree(local)  # a replaced node: an empty local tier
    with tiered(storage_root, local) as mgr:
        assert mgr.steps(tier="local") == [] and mgr.latest_step() == 2
        assert_tree_bitexact(mgr.restore(), state(2))
        assert_tree_bitexact(mgr.restore(1), state(1))
        with pytest.raises(jaxckpt.StepNotFoundError):
            mgr.restore(3)


def trainer(root: str, local: Path, resume: Path, *args: str) -> harness.Child:
    env = harness.child_env(inherit_jaxckpt=True, resume_dir=resume, pause_s=600)
    return harness.Child([sys.executable, CHILD, root, str(local), *args], env=env)


def kill_at(proc: harness.Child, resume: Path, phase: str, step: int) -> None:
    """SIGKILLs ``proc`` once it pauses at ``phase`` of ``step``."""
    try:
        proc.wait_reached(resume, phase, step, timeout=TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.proc.returncode == -signal.SIGKILL


def test_trainer_killed_right_after_a_local_commit_loses_nothing(s3_server, tmp_path):
    """The promotion request is written before the local marker: a trainer
    SIGKILLed right after its local commit leaves it, and `jaxckpt promote`
    finishes the job; one killed between the request and the marker leaves a
    request that waits, and is dropped once the next job collected the attempt."""
    root = f"s3://{s3_server.bucket}/{tmp_path.name}"
    local, resume = tmp_path / "local", tmp_path / "resume"
    resume.mkdir()
    child = trainer(root, local, resume, "--steps", "3", "--arm-last", "marker_written")
    kill_at(child, resume, "marker_written", 3)  # step 3's local marker is written
    assert durable_steps(root) == []  # external promotion: nothing durable yet
    local_protocol = CommitProtocol(open_storage(str(local)))
    assert sorted(local_protocol.committed()) == [1, 2, 3]  # waiting steps outlive KeepLast(1)
    assert sorted(read_requests(local_protocol)) == [1, 2, 3]
    rc, out, err = finish(promote_cli(local, root))
    assert rc == 0, err
    assert "promoted 3 steps" in out
    assert durable_steps(root) == [1, 2, 3] and read_requests(local_protocol) == {}
    with jaxckpt.CheckpointManager(root, read_only=True) as mgr:
        for step in (1, 2, 3):
            assert_tree_bitexact(mgr.restore(step), state(step))
            assert mgr.verify(step).ok
    rc, out, _ = finish(promote_cli(local, root))  # nothing left to do
    assert rc == 0 and "promoted 0 steps" in out

    child = trainer(root, local, resume, "--start", "4", "--steps", "1", "--arm-last",
                    "promotion_requested")  # fmt: skip
    kill_at(child, resume, "promotion_requested", 4)  # request written, no marker
    assert 4 in read_requests(local_protocol) and 4 not in local_protocol.committed()
    rc, out, err = finish(promote_cli(local, root))
    assert rc == 0 and "step 4: local save under way" in out, err  # never promoted half a save
    assert sorted(read_requests(local_protocol)) == [4]
    tiered(root, local, promotion="external").close()  # the next job collects the attempt
    rc, out, err = finish(promote_cli(local, root))
    assert rc == 0 and "step 4: not committed locally" in out, err
    assert read_requests(local_protocol) == {} and durable_steps(root) == [1, 2, 3]


def test_promoter_killed_mid_upload_leaves_nothing_listed_and_rerun_completes(
    object_root, tmp_path
):
    local = tmp_path / "local"
    with tiered(object_root, local, promotion="external") as mgr:
        for step in (1, 2):
            mgr.save(step, state(step))
    resume = tmp_path / "resume"
    resume.mkdir()
    env = harness.child_env(
        inherit_jaxckpt=True, pause_at="before_marker", resume_dir=resume, pause_s=600
    )
    with harness.running(promote_argv(local, object_root), env=env) as proc:
        proc.wait_reached(resume, "before_marker", 2, timeout=TIMEOUT_S)  # newest first
    storage = open_storage(object_root)
    assert data_steps(storage) == {2}  # every chunk of step 2 uploaded ...
    assert durable_steps(object_root) == []  # ... and nothing listed without its marker
    rc, _, err = finish(promote_cli(local, object_root))
    assert rc == 0, err
    assert durable_steps(object_root) == [1, 2]
    with jaxckpt.CheckpointManager(object_root, read_only=True) as mgr:
        assert_tree_bitexact(mgr.restore(), state(2))
        assert_tree_bitexact(mgr.restore(1), state(1))
    assert len(_attempts(storage, 2)) == 2  # the killed promoter's attempt is left over ...
    tiered(object_root, local, promotion="external").close()  # ... until the next job's open
    assert len(_attempts(storage, 2)) == 1


def _attempts(storage: Any, step: int) -> set[str]:
    locs = (parse_data_key(k) for k in storage.list(ATTEMPTS) + storage.list(DATA))
    return {loc.attempt for loc in locs if loc is not None and loc.step == step and loc.attempt}


def test_promoter_of_a_fenced_job_stops_and_a_restarted_job_takes_over(tmp_path, capfd):
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    with tiered(root, local, promotion="external") as mgr:
        mgr.save(1, state(1))
    jaxckpt.CheckpointManager(root).close()  # another job takes over the durable root
    rc, out, _ = finish(promote_cli(local, root))
    assert rc == 0 and "step 1: fenced" in out
    assert durable_steps(root) == []
    with tiered(root, local, promotion="external") as mgr:  # the restarted job re-stamps
        assert mgr.steps() == [1]
    rc, out, err = finish(promote_cli(local, root))
    assert rc == 0 and "promoted 1 step" in out, err
    assert durable_steps(root) == [1]


def test_sidecar_watches_serves_metrics_and_stops_on_sigterm(tmp_path):
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    mgr = tiered(root, local, promotion="external")
    mgr.save(1, state(1))
    mgr.wait()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = promote_cli(
        local, root, "--watch", "--interval", "0.2", "--metrics-port", str(port),
        "--metrics-addr", "127.0.0.1", "--keep-last", "1",
    )  # fmt: skip
    try:
        assert mgr.wait_durable(1, timeout_s=TIMEOUT_S) == 1
        mgr.save(2, state(2))
        assert mgr.wait_durable(timeout_s=TIMEOUT_S) == 2
        metrics = _scrape(port, lambda m: m.get("jaxckpt_newest_durable_step") == 2.0)
        assert metrics["jaxckpt_newest_local_step"] == 2.0
        assert metrics["jaxckpt_promoted_steps_total"] == 2.0
        assert metrics["jaxckpt_promoted_bytes_total"] > 0
        assert metrics["jaxckpt_promotion_lag_steps"] == 0.0
        assert metrics["jaxckpt_promotion_failures_total"] == 0.0
        assert durable_steps(root) == [2]  # --keep-last 1 on the durable root
        mgr.close()  # external promotion: close does not wait for the sidecar
    finally:
        proc.send_signal(signal.SIGTERM)
        rc, out, err = finish(proc, timeout=60)
    assert rc == 0, err
    assert "step 1: promoted" in out and "step 2: promoted" in out and "stopped" in out


def test_a_sidecar_started_before_its_job_waits_for_the_local_root(tmp_path):
    """A sidecar starts with its pod, before the trainer creates its local root (and on a
    replaced node, whose disk is empty): it waits for the root instead of exiting with
    "not a jaxckpt root" (which left a game day's job with nothing promoted), then
    promotes the job's steps; a SIGTERM before the root appears stops it cleanly."""
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    early = promote_cli(tmp_path / "never", root, "--watch", "--interval", "0.2")
    assert early.stdout is not None
    assert "waiting for" in early.stdout.readline()  # it waits (and says so) ...
    early.send_signal(signal.SIGTERM)
    assert finish(early, timeout=60)[0] == 0  # ... until told to stop
    proc = promote_cli(local, root, "--watch", "--interval", "0.2")
    try:
        assert proc.stdout is not None
        assert "waiting for" in proc.stdout.readline()
        with tiered(root, local, promotion="external") as mgr:
            mgr.save(1, state(1))
            assert mgr.wait_durable(1, timeout_s=TIMEOUT_S) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        rc, out, err = finish(proc, timeout=60)
    assert rc == 0, err
    assert "step 1: promoted" in out
    assert not (tmp_path / "never").exists()  # waiting wrote nothing


def _scrape(port: int, ready: Any) -> dict[str, float]:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
            metrics = {
                name: float(value)
                for line in text.splitlines()
                if line.startswith("jaxckpt_") and " " in line
                for name, value in [line.rsplit(" ", 1)]
            }
            if ready(metrics):
                return metrics
        except OSError:
            pass
        assert time.monotonic() < deadline, "metrics never showed the expected values"
        time.sleep(0.2)


def test_ls_shows_which_tiers_hold_each_step(tmp_path, capsys):
    from jaxckpt import cli

    root, local = str(tmp_path / "durable"), tmp_path / "local"
    with tiered(root, local, promote_policy=policy.EveryNSteps(2)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
    # close() waited for the background promotion of step 2
    assert cli.main(["ls", root, "--local-root", str(local), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {c["step"]: c["tiers"] for c in listed["committed"]} == {
        1: ["local"],
        2: ["local", "durable"],
        3: ["local"],
    }
    assert cli.main(["ls", root, "--local-root", str(local)]) == 0
    out = capsys.readouterr().out
    assert "TIERS" in out and "local+durable" in out


def test_wait_durable_and_options_report_misuse(tmp_path):
    with pytest.raises(ValueError, match="promotion"):
        jaxckpt.CheckpointManager(
            str(tmp_path / "a"), local_root=str(tmp_path / "b"), promotion="x"
        )
    with pytest.raises(jaxckpt.CheckpointError, match="same root"):
        jaxckpt.CheckpointManager(str(tmp_path / "a"), local_root=str(tmp_path / "a"))
    with (
        jaxckpt.CheckpointManager(str(tmp_path / "plain")) as mgr,
        pytest.raises(jaxckpt.CheckpointError, match="no local tier"),
    ):
        mgr.wait_durable()
    with tiered(str(tmp_path / "d"), tmp_path / "l", promotion="external") as mgr:
        assert mgr.wait_durable() is None
        mgr.save(1, {"x": np.arange(3)})
        with pytest.raises(jaxckpt.PromotionTimeoutError, match="step 1"):
            mgr.wait_durable(timeout_s=0.3)  # nobody promotes
        with pytest.raises(jaxckpt.PromotionError, match="neither durable"):
            mgr.wait_durable(7, timeout_s=5)
    with pytest.raises(ValueError, match="need a local_root"):
        jaxckpt.CheckpointManager(str(tmp_path / "a"), local_retention=policy.KeepLast(1))


def test_promote_archives_old_milestones_with_zstd(tmp_path, capsys):
    from jaxckpt import cli

    root, local, archive = str(tmp_path / "durable"), tmp_path / "local", str(tmp_path / "arch")
    with tiered(root, local, promotion="external") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step), keep=step == 3)
    args = ["promote", str(local), root, "--archive", archive, "--archive-milestones", "2"]
    assert cli.main([*args, "--archive-after-hours", "1"]) == 0  # promoted, too new to archive
    assert durable_steps(root) == [1, 2, 3] and durable_steps(archive) == []
    assert cli.main([*args, "--archive-after-hours", "0"]) == 0
    out = capsys.readouterr().out
    assert "step 2: archived" in out and "step 3: archived" in out  # the milestone and the pin
    assert durable_steps(archive) == [2, 3]
    with jaxckpt.CheckpointManager(archive, read_only=True) as mgr:
        assert_tree_bitexact(mgr.restore(2), state(2))
        assert mgr.verify(3).ok
    meta = json.loads((tmp_path / "arch").joinpath(_array_meta(archive, 2, "w")).read_text())
    assert any(c["name"] == "zstd" for c in meta["codecs"])


def _array_meta(root: str, step: int, name: str) -> str:
    marker = CommitProtocol(open_storage(root)).require_marker(step)
    return marker.location.array_prefix(name) + "zarr.json"


def test_promote_copies_without_importing_jax(tmp_path):
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    with tiered(root, local, promotion="external") as mgr:
        mgr.save(1, state(1))
    code = (
        "import sys; from jaxckpt import cli; "
        f"assert cli.main(['promote', {str(local)!r}, {root!r}]) == 0; "
        "assert 'jax' not in sys.modules, 'jax was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "step 1: promoted" in proc.stdout
    assert durable_steps(root) == [1]


@pytest.mark.parametrize(("flag", "nice"), [([], 10), (["--nice", "13"], 13), (["--nice", "0"], 0)])
def test_the_promoter_lowers_its_priority_below_the_trainer_s(tmp_path, flag, nice):
    """The sidecar shares the node with the trainer: it runs at nice 10 unless told."""
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    with tiered(root, local, promotion="external") as mgr:
        mgr.save(1, state(1))
    code = (
        "import os, threading; from jaxckpt import cli; "
        "me = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()); "
        f"before = me(); assert cli.main(['promote', {str(local)!r}, {root!r}, *{flag!r}]) == 0; "
        f"print('NICE', before, me())"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    before, after = (int(w) for w in proc.stdout.split("NICE")[1].split())
    assert after == max(before, nice), proc.stdout
    assert durable_steps(root) == [1]


def test_the_promoter_refuses_a_nice_value_out_of_range(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["promote", str(tmp_path / "local"), str(tmp_path / "durable"), "--nice", "20"])
    assert "--nice: must be an integer 0-19, got '20'" in capsys.readouterr().err


def test_packed_local_tier_promotes_its_pack_objects(s3_server, tmp_path):
    root = f"s3://{s3_server.bucket}/{tmp_path.name}"
    with tiered(root, tmp_path / "local", layout="packed") as mgr:
        for step in (1, 2):
            mgr.save(step, state(step))
        assert mgr.wait_durable(timeout_s=TIMEOUT_S) == 2
    local = CommitProtocol(open_storage(str(tmp_path / "local")))
    durable = CommitProtocol(open_storage(root))
    for step in (1, 2):
        here, there = local.require_marker(step), durable.require_marker(step)
        names = [here.location.name_of(k) or k for k in list_attempt(local.storage, here.location)]
        packs = sorted(n for n in names if n.startswith("packs/"))
        assert packs == ["packs/0.0.bin"]  # every chunk of the step in one pack object
        loc = there.location
        listed = list_attempt(durable.storage, loc)
        assert [k for k in listed if "/packs/" in k] == [loc.key(n) for n in packs]
        for name in packs:
            assert durable.storage.read(loc.key(name)) == local.storage.read(
                here.location.key(name)
            )
        chunk_objects = [k for k in durable.storage.list(loc.arrays_prefix) if "/c/" in k]
        assert chunk_objects == []  # no chunk objects: the packs were copied whole
        assert {p.layout for p in durable.read_manifest(there)} == {"packed"}
    with jaxckpt.CheckpointManager(root, read_only=True) as plain:
        for step in (1, 2):
            assert_tree_bitexact(plain.restore(step), state(step))
            assert plain.verify(step).ok


@pytest.mark.parametrize("durable", ["s3:///run", "gs://", "http://x"])
def test_an_invalid_durable_root_is_refused_before_the_local_root_is_written(tmp_path, durable):
    local = tmp_path / "local"
    with pytest.raises(jaxckpt.CheckpointError, match="root"):
        jaxckpt.CheckpointManager(durable, local_root=str(local))
    assert not local.exists()  # no root record, no local epoch, no directory


def test_promote_from_a_plain_root_is_an_error(tmp_path, capsys):
    """A root without a local tier (no tier.json, no promotion requests): exit 2 with one
    line, and the destination is not created (before: exit 0, "promoted 0 steps")."""
    from jaxckpt import cli

    plain, dest = tmp_path / "plain", tmp_path / "dest"
    with jaxckpt.CheckpointManager(plain) as mgr:
        mgr.save(1, {"x": np.arange(4)})
    assert cli.main(["promote", str(plain), str(dest)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"jaxckpt: error: {plain} is not a local tier"), err
    assert not dest.exists()
