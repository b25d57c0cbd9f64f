"""jaxckpt.flags: opt-in absl flags that build the manager's options."""

from __future__ import annotations

import subprocess
import sys

import jax
import numpy as np
import pytest
from absl import app, flags
from absl.testing import flagsaver

import jaxckpt
import jaxckpt.flags
from jaxckpt import policy

FLAGS = flags.FLAGS


@pytest.fixture(autouse=True)
def _defined_and_parsed():
    jaxckpt.flags.define_flags()
    if not FLAGS.is_parsed():
        FLAGS.mark_as_parsed()


def test_importing_defines_no_flags_and_imports_no_jax():
    code = (
        "import sys; import jaxckpt.flags; from absl import flags; "
        "assert 'checkpoint_root' not in flags.FLAGS, 'defined at import'; "
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_define_flags_is_idempotent_and_takes_a_flag_values():
    fv = flags.FlagValues()
    jaxckpt.flags.define_flags(fv)
    jaxckpt.flags.define_flags(fv)
    assert set(jaxckpt.flags.FLAG_NAMES) <= set(fv)
    fv(["prog", "--checkpoint_root=gs://b/run", "--checkpoint_keep_milestones=1,2,5"])
    assert fv.checkpoint_root == "gs://b/run"
    assert jaxckpt.flags.retention_from_flags(fv) == policy.KeepMilestones((1, 2, 5))


@flagsaver.flagsaver
def test_defaults_save_on_every_call_and_keep_everything():
    opts = jaxckpt.flags.options_from_flags()
    assert opts.save_policy is None and opts.retention is None
    assert opts.save_timeout_s == 600.0


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"checkpoint_every_steps": 100},
            policy.AnySave(policies=(policy.EveryNSteps(100), policy.OnPreemption())),
        ),
        (
            {"checkpoint_every_steps": 100, "checkpoint_on_preemption": False},
            policy.EveryNSteps(100),
        ),
        (
            {"checkpoint_every_seconds": 30.0, "checkpoint_on_preemption": False},
            policy.EveryNSeconds(30.0),
        ),
        (
            {"checkpoint_mtbf_hours": 24.0, "checkpoint_max_overhead": 0.05},
            policy.AnySave(
                policies=(policy.Adaptive(24.0, max_overhead=0.05), policy.OnPreemption())
            ),
        ),
        (
            {"checkpoint_every_steps": 10, "checkpoint_every_seconds": 60.0},
            policy.AnySave(
                policies=(
                    policy.EveryNSteps(10),
                    policy.EveryNSeconds(60.0),
                    policy.OnPreemption(),
                )
            ),
        ),
    ],
)
def test_save_policy_from_flags(overrides, expected):
    with flagsaver.flagsaver(**overrides):
        assert jaxckpt.flags.save_policy_from_flags() == expected


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"checkpoint_keep_last": 3}, policy.KeepLast(3)),
        ({"checkpoint_keep_every": 1000}, policy.KeepEvery(1000)),
        (
            {"checkpoint_keep_last": 2, "checkpoint_keep_milestones": ["1", "2", "5"]},
            policy.AnyKeep(policies=(policy.KeepLast(2), policy.KeepMilestones((1, 2, 5)))),
        ),
    ],
)
def test_retention_from_flags(overrides, expected):
    with flagsaver.flagsaver(**overrides):
        assert jaxckpt.flags.retention_from_flags() == expected


def test_bad_milestones_are_a_flag_error_when_parsed():
    fv = flags.FlagValues()
    jaxckpt.flags.define_flags(fv)
    with pytest.raises(flags.IllegalFlagValueError, match="must be positive integers such as"):
        fv(["prog", "--checkpoint_keep_milestones=1,ten"])
    with pytest.raises(jaxckpt.flags.CheckpointFlagError, match="keep_milestones"):
        jaxckpt.flags.options_from_mapping({"keep_milestones": "1,0"})


def test_command_line_parsing_through_as_parsed(tmp_path):
    with flagsaver.as_parsed(
        checkpoint_root=str(tmp_path),
        checkpoint_every_steps="5",
        checkpoint_keep_last="2",
        checkpoint_timeout_seconds="30",
        checkpoint_tolerate_failed_saves="3",
    ):
        opts = jaxckpt.flags.options_from_flags()
    assert opts.save_policy == policy.EveryNSteps(5) | policy.OnPreemption()
    assert opts.retention == policy.KeepLast(2)
    assert (opts.save_timeout_s, opts.tolerate_failed_saves) == (30.0, 3)


def test_restore_memory_and_writer_nice_flags(tmp_path):
    opts = jaxckpt.flags.options_from_flags()
    assert (opts.restore_memory_bytes, opts.writer_nice) == (None, 0)
    with flagsaver.as_parsed(
        checkpoint_root=str(tmp_path),
        checkpoint_restore_memory_mib="64",
        checkpoint_writer_nice="10",
    ):
        opts = jaxckpt.flags.options_from_flags()
    assert (opts.restore_memory_bytes, opts.writer_nice) == (64 << 20, 10)
    with pytest.raises(flags.IllegalFlagValueError, match="checkpoint_writer_nice"):
        FLAGS["checkpoint_writer_nice"].parse("20")
    assert opts.storage_kwargs("s3://bucket/run")["read_ahead_bytes"] == 64 << 20


@flagsaver.flagsaver(checkpoint_root=None)
def test_manager_needs_a_root():
    with pytest.raises(jaxckpt.flags.CheckpointFlagError, match="--checkpoint_root is required"):
        jaxckpt.flags.manager_from_flags()
    error = jaxckpt.flags.CheckpointFlagError
    assert issubclass(error, app.UsageError) and issubclass(error, jaxckpt.CheckpointError)
    assert issubclass(error, ValueError)
    assert all(getattr(jaxckpt.flags, name) for name in jaxckpt.flags.__all__)


def test_async_manager_uses_the_flag_options(tmp_path):
    with flagsaver.flagsaver(checkpoint_root=str(tmp_path), checkpoint_every_steps=2):
        mgr = jaxckpt.flags.manager_from_flags(gc_on_open=False)
    with mgr:
        assert type(mgr) is jaxckpt.CheckpointManager
        assert mgr.options.save_policy == policy.EveryNSteps(2) | policy.OnPreemption()
        assert mgr.options.gc_on_open is False
        assert mgr.save(1, {"x": np.arange(3)}) is False
        assert mgr.save(2, {"x": np.arange(3)}) is True
    assert mgr.steps() == [2]


def test_sync_manager_commits_before_save_returns(tmp_path):
    with flagsaver.flagsaver(checkpoint_root=str(tmp_path), checkpoint_async=False):
        mgr = jaxckpt.flags.manager_from_flags()
    with mgr:
        assert isinstance(mgr, jaxckpt.CheckpointManager)
        for step in (1, 2):
            assert mgr.save(step, {"x": np.full(1000, step)}) is True
            assert mgr.latest_step() == step  # committed: no wait() needed
        assert [s.step for s in mgr.save_stats()] == [1, 2]


def test_tier_flags_build_a_tiered_manager(tmp_path):
    with flagsaver.as_parsed(
        checkpoint_root=str(tmp_path / "durable"),
        checkpoint_local_root=str(tmp_path / "local"),
        checkpoint_promote_every_steps="2",
        checkpoint_local_keep_last="1",
        checkpoint_keep_last="1",
        checkpoint_promotion="external",
    ):
        opts = jaxckpt.flags.options_from_flags()
        mgr = jaxckpt.flags.manager_from_flags()
    assert opts.local_root == str(tmp_path / "local") and opts.promotion == "external"
    assert opts.promote_policy == policy.EveryNSteps(2) | policy.OnPreemption()
    assert opts.local_retention == policy.KeepLast(1) and opts.retention == policy.KeepLast(1)
    with mgr:
        assert mgr.local_root == str(tmp_path / "local")
        for step in (1, 2, 3):
            mgr.save(step, {"x": np.full(10, step)})
        mgr.wait()
        mgr.wait_for_deletions(timeout_s=60)
        assert mgr.steps(tier="local") == [2, 3]  # step 2 waits for the external promoter
        with pytest.raises(jaxckpt.PromotionTimeoutError):
            mgr.wait_durable(2, timeout_s=0.2)
    with flagsaver.flagsaver(
        checkpoint_local_root=str(tmp_path / "local"),
        checkpoint_promote_every_seconds=60.0,
        checkpoint_on_preemption=False,
    ):
        assert jaxckpt.flags.promote_policy_from_flags() == policy.EveryNSeconds(60.0)


def test_local_replicas_flag(tmp_path):
    with flagsaver.as_parsed(
        checkpoint_root=str(tmp_path / "durable"),
        checkpoint_local_root=str(tmp_path / "local"),
        checkpoint_local_replicas="2",
    ):
        assert jaxckpt.flags.options_from_flags().local_replicas == 2
        with pytest.raises(jaxckpt.PlacementError, match="local_replicas=2 needs 2 distinct"):
            jaxckpt.flags.manager_from_flags()  # one process, one node
    with flagsaver.as_parsed(
        checkpoint_root=str(tmp_path / "durable"), checkpoint_local_root=str(tmp_path / "local")
    ):
        assert jaxckpt.flags.options_from_flags().local_replicas == 1
    with (
        pytest.raises(
            flags.IllegalFlagValueError,
            match="--checkpoint_local_replicas need --checkpoint_local_root",
        ),
        flagsaver.flagsaver(checkpoint_local_root=None, checkpoint_local_replicas=2),
    ):
        pass


def test_tier_flags_without_a_local_root_name_the_flags():
    fv = flags.FlagValues()
    jaxckpt.flags.define_flags(fv)
    with pytest.raises(flags.IllegalFlagValueError, match="--checkpoint_local_keep_last need"):
        fv(["prog", "--checkpoint_root=/r", "--checkpoint_local_keep_last=2"])
    with pytest.raises(
        jaxckpt.flags.CheckpointFlagError,
        match="--checkpoint_local_keep_last need --checkpoint_local_root",
    ):
        jaxckpt.flags.options_from_mapping({"root": "/r", "local_keep_last": 2})


# ------------------------------------------------------------ an absl script, for real

SCRIPT = """
from absl import app
import jaxckpt.flags

jaxckpt.flags.define_flags()


def main(argv):
    with jaxckpt.flags.manager_from_flags() as mgr:
        print("MANAGER", type(mgr).__name__, mgr.latest_step(), mgr.save(1, {"x": 1.0}))


if __name__ == "__main__":
    app.run(main)
"""


def _run_script(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "trainer.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )


def test_help_of_an_absl_script_lists_the_checkpoint_flags(tmp_path):
    done = _run_script(tmp_path, "--help")
    assert "Traceback" not in done.stderr, done.stderr
    for name in ("checkpoint_root", "checkpoint_every_steps", "[no]checkpoint_enabled"):
        assert f"--{name}" in done.stdout, done.stdout
    assert "--checkpoint_init_from" in done.stdout and "--checkpoint_keep_last" in done.stdout
    fv = flags.FlagValues()  # the caller of define_flags gets them as key flags
    jaxckpt.flags.define_flags(fv)
    keys = {f.name for f in fv.get_key_flags_for_module(__name__)}
    assert set(jaxckpt.flags.FLAG_NAMES) <= keys


def test_missing_or_inconsistent_flags_are_usage_errors_without_traceback(tmp_path):
    missing = _run_script(tmp_path)
    assert missing.returncode == 1
    assert "--checkpoint_root is required" in missing.stderr, missing.stderr
    assert "Traceback" not in missing.stderr and "USAGE" in missing.stdout + missing.stderr
    tier = _run_script(tmp_path, f"--checkpoint_root={tmp_path}", "--checkpoint_local_keep_last=2")
    assert tier.returncode == 1
    assert "--checkpoint_local_keep_last need --checkpoint_local_root" in tier.stderr
    assert "Traceback" not in tier.stderr and "FATAL Flags parsing error" in tier.stderr
    off = _run_script(tmp_path, "--nocheckpoint_enabled")
    assert off.returncode == 0, off.stderr
    assert "MANAGER DisabledCheckpointManager None False" in off.stdout


# ------------------------------------------------------------------ on/off, init, mapping


def test_disabled_manager_saves_nothing_and_finds_nothing(tmp_path):
    mgr = jaxckpt.flags.manager_from_mapping({"enabled": False, "root": str(tmp_path / "r")})
    public = {n for n in dir(jaxckpt.CheckpointManager) if not n.startswith("_")}
    assert public <= {n for n in vars(type(mgr)) if not n.startswith("_")} | {
        "restored_step",
        "restored_process_state",
    }, "every public method of CheckpointManager must be overridden"
    with mgr:
        assert isinstance(mgr, jaxckpt.CheckpointManager)
        assert mgr.save(1, {"x": np.arange(3)}, force=True) is False
        assert (mgr.latest_step(), mgr.steps(), mgr.save_stats()) == (None, [], [])
        assert mgr.restored_step is None and mgr.restored_process_state is None
        with pytest.raises(jaxckpt.StepNotFoundError, match="disabled"):
            mgr.restore()
        mgr.wait()
        lowered = jax.jit(lambda v: v + 1).lower(np.zeros(3, np.float32))
        assert list(mgr.compile(lowered)(np.zeros(3, np.float32))) == [1, 1, 1]
    assert not (tmp_path / "r").exists()  # nothing was opened or written


def test_init_from_restores_params_or_the_full_state_at_step_0(tmp_path):
    pretrained = tmp_path / "pretrained"
    saved = {"params": {"w": np.arange(4.0)}, "opt": {"mu": np.ones(4)}, "step": 7}
    with jaxckpt.CheckpointManager(pretrained) as src:
        src.save(3, {**saved, "step": 3})
        src.save(7, saved)
    params_only = {"model": {"w": np.zeros(4)}}
    config = {
        "root": str(tmp_path / "run"),
        "init_from": f"{pretrained}:3",
        "init_partial": True,
        "init_rename": ["['params']=['model']"],
    }
    fv = jaxckpt.flags.flags_from_mapping(config)
    with jaxckpt.flags.manager_from_flags(fv) as mgr:
        got = jaxckpt.flags.init_from_flags(mgr, params_only, fv)
        assert got["model"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
        mgr.save(1, got)
    with jaxckpt.flags.manager_from_flags(fv) as mgr:  # a restart resumes its own step
        assert jaxckpt.flags.init_from_flags(mgr, params_only, fv) is None
    full = jaxckpt.flags.flags_from_mapping(
        {"root": str(tmp_path / "run2"), "init_from": str(pretrained)}
    )
    with jaxckpt.flags.manager_from_flags(full) as mgr:
        state = jaxckpt.flags.init_from_flags(mgr, saved, full)  # the newest step, whole
        assert state["step"] == 7 and state["opt"]["mu"].tolist() == [1.0] * 4
        with pytest.raises(jaxckpt.TreeMismatchError):  # without partial: every path
            jaxckpt.flags.init_from_flags(mgr, params_only, full)
    with pytest.raises(jaxckpt.flags.CheckpointFlagError, match="need --checkpoint_init_from"):
        jaxckpt.flags.flags_from_mapping({"root": str(tmp_path), "init_partial": True})
    with pytest.raises(jaxckpt.flags.CheckpointFlagError, match="names --checkpoint_root"):
        jaxckpt.flags.manager_from_mapping({"root": str(pretrained), "init_from": str(pretrained)})
    assert jaxckpt.flags.init_from_flags(mgr, params_only) is None  # the flag is unset


def test_options_from_a_mapping_match_the_flags(tmp_path):
    config = {
        "every_steps": 5,
        "checkpoint_keep_last": "2",
        "keep_milestones": [1, 2, 5],
        "timeout_seconds": 30,
        "local_root": str(tmp_path / "local"),
        "promote_every_steps": None,
    }
    opts = jaxckpt.flags.options_from_mapping(config, gc_on_open=False)
    assert opts.save_policy == policy.EveryNSteps(5) | policy.OnPreemption()
    assert opts.retention == policy.KeepLast(2) | policy.KeepMilestones((1, 2, 5))
    assert (opts.save_timeout_s, opts.local_root, opts.gc_on_open) == (
        30.0,
        str(tmp_path / "local"),
        False,
    )
    with pytest.raises(jaxckpt.flags.CheckpointFlagError, match="unknown checkpoint setting 'evry"):
        jaxckpt.flags.options_from_mapping({"evry_steps": 5})
    with pytest.raises(jaxckpt.flags.CheckpointFlagError, match="checkpoint_keep_last"):
        jaxckpt.flags.options_from_mapping({"keep_last": 0})
