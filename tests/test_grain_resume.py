"""A Linen ``TrainState`` loop fed by grain (``scripts/train_linen.py``) resumes its model
and its exact batch sequence after a SIGKILL, the iterator's state saved as ``process_state``.

The SIGKILL test runs the real script in fresh processes on two CPU devices with a
``grain.DataLoader`` (its state is bytes): one run straight through, one killed while
a save is in flight and then started again; the resumed run must train on exactly the
batches the straight run trained on from there, and end bit-identical. A
``DatasetIterator`` (its state is a dict) is resumed in this process.
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
import train_linen  # scripts/ is on the test path

import jaxckpt

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_linen.py"

STEPS = 20
TIMEOUT_S = 120.0

pytestmark = pytest.mark.timeout(300)


class Run(harness.Child):
    """``scripts/train_linen.py`` in a child process; its ``BATCH`` lines by step."""

    def __init__(self, root: Path, cache: Path, env: dict[str, str] | None = None) -> None:
        argv = [
            sys.executable,
            str(SCRIPT),
            f"--checkpoint_root={root}",
            f"--compilation_cache={cache}",
            f"--steps={STEPS}",
            "--data=loader",
            "--checkpoint_every_steps=5",
        ]
        env = harness.child_env(
            XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu", **(env or {})
        )
        super().__init__(argv, env=env, timeout_s=TIMEOUT_S)

    def batches(self) -> dict[int, str]:
        found = (re.fullmatch(r"BATCH (\d+) (\d+)", line) for line in self.stdout)
        return {int(m.group(1)): m.group(2) for m in found if m}

    def log(self) -> str:
        return "\n".join(self.stderr[-60:])


def _bits(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def test_loader_resumes_the_exact_batch_sequence_after_sigkill(tmp_path):
    cache = tmp_path / "jax-cache"
    straight = Run(tmp_path / "straight", cache)
    resume = tmp_path / "resume"
    resume.mkdir()
    for step in (5, 10):  # these saves pass; the save of step 15 pauses until the kill
        harness.resume(resume, "data_written", step)
    pause = {
        harness.PAUSE_AT: "data_written",
        harness.RESUME_DIR: str(resume),
        harness.PAUSE_S: str(TIMEOUT_S),
    }
    killed = Run(tmp_path / "resumed", cache, env=pause)
    killed.wait_phase("data_written", 15)
    assert killed.kill() == -signal.SIGKILL
    mgr = jaxckpt.CheckpointManager(tmp_path / "resumed", read_only=True)
    assert mgr.latest_step() == 10, killed.log()
    assert isinstance(mgr.process_states(10)[0], bytes)  # the DataLoader iterator's state

    resumed = Run(tmp_path / "resumed", cache)
    assert resumed.finish() == 0, resumed.log()
    assert straight.finish() == 0, straight.log()
    assert "resumed from step 10" in resumed.log()
    expected = straight.batches()
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert resumed.batches() == {s: expected[s] for s in range(11, STEPS + 1)}
    assert all(expected[s] == b for s, b in killed.batches().items())
    assert len(set(expected.values())) > STEPS // 2  # the batches do differ

    target = jax.eval_shape(lambda: train_linen.create_state(0))
    a = jaxckpt.CheckpointManager(tmp_path / "straight", read_only=True).restore(
        STEPS, target=target
    )
    b = jaxckpt.CheckpointManager(tmp_path / "resumed", read_only=True).restore(
        STEPS, target=target
    )
    assert int(a.step) == int(b.step) == STEPS
    assert _bits(a) == _bits(b)


def test_dataset_iterator_resumes_from_its_saved_state(tmp_path):
    data = train_linen.make_iterator("dataset", seed=1, batch=4)
    for _ in range(7):
        next(data)
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(7, {"w": np.zeros(2)}, process_state=data.get_state())
    expected = [train_linen.fingerprint(next(data)) for _ in range(30)]  # across epochs

    mgr = jaxckpt.CheckpointManager(tmp_path, read_only=True)
    mgr.restore()
    assert isinstance(mgr.restored_process_state, dict)
    fresh = train_linen.make_iterator("dataset", seed=1, batch=4)
    fresh.set_state(mgr.restored_process_state)
    assert [train_linen.fingerprint(next(fresh)) for _ in range(30)] == expected
