"""scripts/train.py resumes exactly after SIGKILL, and saves then exits 0 on SIGTERM.

Each test runs the real training script in fresh processes on four CPU devices, a 2x2
(data, model) mesh: the parameters are sharded FSDP over ``data`` and tensor parallel over
``model``, as in Flax's gemma example. The processes share a JAX compilation cache, so only
the first ones compile.
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import harness
import jax
import numpy as np
import pytest

import jaxckpt

TRAIN = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
STEPS = 30
TINY = [
    "--batch_size=4",
    "--seq_len=16",
    "--d_model=32",
    "--num_heads=2",
    "--num_layers=2",
    "--log_every=5",
    "--checkpoint_every_steps=5",
    "--checkpoint_keep_last=2",
    "--simulated_step_seconds=0.05",
    "--model_parallel=2",
]
TIMEOUT_S = 120.0

pytestmark = pytest.mark.timeout(300)


class Run(harness.Child):
    """``scripts/train.py`` in a child process, its log lines collected as they come."""

    def __init__(
        self, root: Path, cache: Path, *extra: str, env: dict[str, str] | None = None
    ) -> None:
        argv = [
            sys.executable,
            str(TRAIN),
            f"--checkpoint_root={root}",
            f"--compilation_cache={cache}",
            *TINY,
            *extra,
        ]
        env = harness.child_env(
            XLA_FLAGS="--xla_force_host_platform_device_count=4",
            JAX_PLATFORMS="cpu",
            **(env or {}),
        )
        super().__init__(argv, env=env, stdout=False, timeout_s=TIMEOUT_S)

    def wait_for(self, pattern: str) -> re.Match[str]:
        """The first new log line matching ``pattern``."""
        return self.search(pattern)

    def log(self) -> str:
        return "".join(line + "\n" for line in self.stderr)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("jax-cache")


def _final(root: Path, step: int = STEPS) -> dict:
    return jaxckpt.CheckpointManager(root, read_only=True).restore(step)


def _bits(tree: dict) -> dict[str, bytes]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        a = np.asarray(leaf)
        out[jax.tree_util.keystr(path)] = a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()
    return out


def test_resume_after_sigkill_is_bit_identical(tmp_path, cache):
    straight = Run(tmp_path / "straight", cache, f"--steps={STEPS}")
    # The saves of steps 5 and 10 pass; the save of step 15 pauses after its
    # data until the kill, so the kill lands mid-run whatever the machine's speed.
    resume = tmp_path / "resume"
    resume.mkdir()
    for step in (5, 10):
        harness.resume(resume, "data_written", step)
    pause = {
        harness.PAUSE_AT: "data_written",
        harness.RESUME_DIR: str(resume),
        harness.PAUSE_S: str(TIMEOUT_S),
    }
    killed = Run(tmp_path / "resumed", cache, f"--steps={STEPS}", env=pause)
    killed.wait_phase("data_written", 15)
    assert killed.kill() == -signal.SIGKILL
    assert re.search(r"checkpoint: step 10 committed", killed.log()), killed.log()
    latest = jaxckpt.CheckpointManager(tmp_path / "resumed", read_only=True).latest_step()
    assert latest == 10, killed.log()

    resumed = Run(tmp_path / "resumed", cache, f"--steps={STEPS}")
    resumed_from = int(resumed.wait_for(r"resumed from step (\d+)").group(1))
    assert resumed_from == latest
    assert resumed.finish() == 0, resumed.log()
    assert straight.finish() == 0, straight.log()
    assert "fresh start" in straight.log() and "resumed" not in straight.log()

    a, b = _final(tmp_path / "straight"), _final(tmp_path / "resumed")
    assert a["step"] == b["step"] == STEPS
    assert a["data_position"] == b["data_position"] == STEPS * 4
    bits_a, bits_b = _bits(a), _bits(b)
    assert bits_a.keys() == bits_b.keys()
    assert any("['optimizer']['opt_state']" in k and "mu" in k for k in bits_a)
    assert any(k.startswith("['model']") for k in bits_a) and "['rng']" in bits_a
    different = [k for k in bits_a if bits_a[k] != bits_b[k]]
    assert not different, different


def test_sigterm_saves_the_current_step_and_exits_zero(tmp_path, cache):
    run = Run(tmp_path / "root", cache, "--steps=100000")
    seen = int(run.wait_for(r"step (\d+): loss").group(1))
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 0, run.log()
    preempted = re.search(r"preempted: step (\d+) saved and committed", run.log())
    assert preempted is not None, run.log()
    saved = int(preempted.group(1))
    assert saved >= seen
    mgr = jaxckpt.CheckpointManager(tmp_path / "root", read_only=True)
    assert mgr.latest_step() == saved
    assert mgr.restore(saved)["step"] == saved
    assert mgr.verify(saved).ok
    assert re.search(r"checkpoint overhead [\d.]+ s of [\d.]+ s wall = [\d.]+%", run.log())
    assert re.search(rf"checkpoint: step {saved} committed, [\d.]+ KiB in [\d.]+ s", run.log())
