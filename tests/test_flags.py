"""jaxckpt.flags: opt-in absl flags that build the manager's options."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from absl import flags
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


@flagsaver.flagsaver(checkpoint_keep_milestones=["1", "ten"])
def test_bad_milestones_name_the_flag():
    with pytest.raises(ValueError, match="--checkpoint_keep_milestones"):
        jaxckpt.flags.retention_from_flags()


def test_command_line_parsing_through_as_parsed(tmp_path):
    with flagsaver.as_parsed(
        checkpoint_root=str(tmp_path),
        checkpoint_every_steps="5",
        checkpoint_keep_last="2",
        checkpoint_timeout_seconds="30",
    ):
        opts = jaxckpt.flags.options_from_flags()
    assert opts.save_policy == policy.EveryNSteps(5) | policy.OnPreemption()
    assert opts.retention == policy.KeepLast(2)
    assert opts.save_timeout_s == 30.0


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
    with pytest.raises(ValueError, match="--checkpoint_root"):
        jaxckpt.flags.manager_from_flags()


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
    with flagsaver.flagsaver(checkpoint_promote_every_seconds=60.0, checkpoint_on_preemption=False):
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
        flagsaver.flagsaver(checkpoint_local_root=None, checkpoint_local_replicas=2),
        pytest.raises(ValueError, match="--checkpoint_local_replicas need --checkpoint_local_root"),
    ):
        jaxckpt.flags.options_from_flags()


@flagsaver.flagsaver(checkpoint_local_root=None, checkpoint_local_keep_last=2)
def test_tier_flags_without_a_local_root_name_the_flags():
    with pytest.raises(
        ValueError, match="--checkpoint_local_keep_last need --checkpoint_local_root"
    ):
        jaxckpt.flags.options_from_flags()
