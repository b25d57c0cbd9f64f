"""jaxckpt.check_resume: a resume pre-flight that passes on a clean step and fails on leaks."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl import flags
from flax import nnx

import jaxckpt
import jaxckpt.flags


def _state() -> dict:
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
        "b": jnp.zeros(4, jnp.bfloat16),
        "rng": jax.random.key(0),
        "count": jnp.zeros((), jnp.int32),
        "pos": 0,
        "name": "run",
    }


BATCHES = [jnp.full((2, 8), 0.1 * (i + 1), jnp.float32) for i in range(6)]


ARRAYS = ("w", "b", "rng", "count")


def _update(state: dict, x: jax.Array, lr: jax.Array) -> tuple[dict, jax.Array]:
    """One SGD step with weight noise on the array leaves; Python leaves pass through."""
    new, loss = _jitted_update({k: state[k] for k in ARRAYS}, x, lr)
    return {**state, **new}, loss


@jax.jit
def _jitted_update(state: dict, x: jax.Array, lr: jax.Array) -> tuple[dict, jax.Array]:
    rng, noise_key = jax.random.split(state["rng"])
    noise = 1e-3 * jax.random.normal(noise_key, state["w"].shape)
    y = x @ state["w"] + state["b"].astype(jnp.float32)
    loss = jnp.mean(y**2)
    w = state["w"] - lr * (x.T @ y) / x.shape[0] + noise
    b = state["b"] - (lr * y.mean(0)).astype(jnp.bfloat16)
    new = {**state, "w": w, "b": b, "rng": rng, "count": state["count"] + 1}
    return new, loss


def clean_step(state: dict, batch: jax.Array) -> tuple[dict, jax.Array]:
    """Everything it depends on is in the state: the RNG key and the step count."""
    lr = 0.01 / (1.0 + state["count"].astype(jnp.float32))
    new, loss = _update(state, batch, lr)
    return {**new, "pos": state["pos"] + 1}, loss


def test_a_clean_step_fn_resumes_exactly_and_the_state_stays_usable():
    state = _state()
    report = jaxckpt.check_resume(clean_step, state, BATCHES, steps=5)
    assert report.ok and report.verdict == "ok", str(report)
    assert report.steps == 5 and report.mismatches == () and report.repeat_mismatches == ()
    assert report.first_divergent_step is None
    assert str(report).startswith("check_resume: OK")
    clean_step(state, BATCHES[0])  # the caller's state was never donated or changed
    np.testing.assert_array_equal(state["w"], _state()["w"])


def test_a_python_counter_outside_the_state_is_caught():
    calls = [0]

    def leaky(state, batch):
        calls[0] += 1  # the learning-rate schedule reads a Python counter, not the state
        new, loss = _update(state, batch, jnp.float32(0.5 / calls[0]))
        return new, loss

    report = jaxckpt.check_resume(leaky, _state(), BATCHES, steps=5)
    assert not report.ok and report.verdict == "nondeterministic"
    first = report.repeat_mismatches[0]
    assert first.step == 1 and first.kind == "value"
    assert {m.path for m in report.repeat_mismatches} == {"['w']", "['b']"}
    w = next(m for m in report.repeat_mismatches if m.path == "['w']")
    assert w.count == w.size == 32 and w.max_abs_diff > 1e-3
    text = str(report)
    assert "not repeatable" in text and "Python counter" in text and "['w']" in text
    assert "large" in text


def test_aux_values_are_compared_too():
    calls = [0]

    def leaky_loss(state, batch):
        calls[0] += 1
        new, loss = clean_step(state, batch)
        return new, {"loss": loss, "logged_step": calls[0]}

    report = jaxckpt.check_resume(leaky_loss, _state(), BATCHES, steps=2)
    assert report.verdict == "nondeterministic"
    (m,) = report.repeat_mismatches
    assert (m.path, m.kind, m.detail, m.max_abs_diff) == (
        "aux['logged_step']",
        "value",
        "1 vs 2",
        1,
    )


def test_an_rng_key_kept_outside_the_state_is_caught():
    key = [jax.random.key(1)]

    def leaky(state, batch):
        key[0], sub = jax.random.split(key[0])  # advances outside the checkpoint
        new, loss = clean_step(state, batch)
        return {**new, "w": new["w"] + 1e-2 * jax.random.normal(sub, new["w"].shape)}, loss

    report = jaxckpt.check_resume(leaky, _state(), BATCHES, steps=3)
    assert report.verdict == "nondeterministic" and report.repeat_mismatches[0].path == "['w']"


def test_a_data_position_outside_the_state_is_caught_and_one_inside_passes():
    data = iter(BATCHES * 3)
    report = jaxckpt.check_resume(clean_step, _state(), lambda state: next(data), steps=3)
    assert report.verdict == "nondeterministic"
    assert report.repeat_mismatches[0].step == 1

    def batch_of(state):  # the position is a leaf of the state, so it is saved
        return BATCHES[state["pos"] % len(BATCHES)]

    assert jaxckpt.check_resume(clean_step, _state(), batch_of, steps=3).ok


def test_tiny_nondeterminism_is_reported_as_such():
    signs = itertools.cycle([1, -1])  # consecutive calls differ: never by luck equal

    def jittery(state, batch):
        new, loss = clean_step(state, batch)
        wobble = jnp.float32(1 + next(signs) * 1e-6)  # a few ulps, as reductions do
        return {**new, "w": new["w"] * wobble}, loss

    report = jaxckpt.check_resume(jittery, _state(), BATCHES, steps=2)
    assert report.verdict == "nondeterministic"
    assert "tiny" in str(report)


def test_a_restore_target_that_casts_a_dtype_is_a_checkpoint_problem():
    state = _state()
    target = jaxckpt.workflows._preflight.abstract_target(state)
    target["w"] = jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=state["w"].sharding)
    report = jaxckpt.check_resume(clean_step, state, BATCHES, steps=2, target=target)
    assert report.verdict == "checkpoint" and report.first_divergent_step == 0
    (m,) = report.mismatches
    assert (m.path, m.kind, m.count, m.size) == ("['w']", "dtype", 32, 32)
    assert m.detail == "float32 vs bfloat16" and 0 < m.max_abs_diff < 0.1
    assert "differs from the state that was saved" in str(report)


def test_a_restore_target_that_loses_a_leaf_is_a_checkpoint_problem():
    target = jaxckpt.workflows._preflight.abstract_target(_state())
    del target["rng"]
    target["extra"] = jnp.zeros(2)
    report = jaxckpt.check_resume(clean_step, _state(), BATCHES, steps=2, target=target)
    assert report.verdict == "checkpoint"
    kinds = {(m.path, m.kind) for m in report.mismatches}
    assert kinds == {("['rng']", "lost"), ("['extra']", "extra")}


def test_a_weak_typed_leaf_resumes_weakly_typed_and_a_strong_target_is_blamed():
    # jnp.asarray(2.0) is weakly typed: bfloat16 * weak float32 stays bfloat16. The
    # restore keeps the target's weak type, so the resumed run matches; a target that
    # asks for a strong float32 makes the resumed step promote to float32.
    state = {"x": jnp.ones(4, jnp.bfloat16), "scale": jnp.asarray(2.0)}
    assert state["scale"].weak_type

    def step(state, batch):
        return {"x": state["x"] * state["scale"], "scale": state["scale"]}

    assert jaxckpt.check_resume(step, state, [None] * 2, steps=2).ok
    strong = jaxckpt.workflows._preflight.abstract_target(state)
    strong["scale"] = jax.ShapeDtypeStruct((), jnp.float32, sharding=state["scale"].sharding)
    report = jaxckpt.check_resume(step, state, [None] * 2, steps=2, target=strong)
    assert report.verdict == "checkpoint" and report.first_divergent_step == 1
    assert report.repeat_mismatches == ()
    assert report.mismatches[0].kind == "dtype" and report.mismatches[0].path == "['x']"
    assert any("weakly typed" in n for n in report.notes)
    assert "while step_fn is repeatable" in str(report)


def test_a_scratch_root_must_be_empty_and_is_left_empty(tmp_path: Path):
    root = str(tmp_path / "scratch")
    report = jaxckpt.check_resume(clean_step, _state(), BATCHES, steps=1, root=root)
    assert report.ok and report.root == root
    assert jaxckpt.CheckpointManager(root, read_only=True).steps() == []
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(5, {"a": 1})
    with pytest.raises(jaxckpt.CheckpointError, match="needs an empty root"):
        jaxckpt.check_resume(clean_step, _state(), BATCHES, steps=1, root=root)
    with pytest.raises(ValueError, match="needs 9 batches"):
        jaxckpt.check_resume(clean_step, _state(), BATCHES, steps=9)


# ------------------------------------------------------------------------------- NNX


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(8, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.down = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        return self.down(self.drop(nnx.relu(self.up(x)), rngs=rngs))


@nnx.jit
def nnx_train_step(
    model: MLP, optimizer: nnx.Optimizer, x: jax.Array, rngs: nnx.Rngs | None = None
) -> jax.Array:
    loss, grads = nnx.value_and_grad(lambda m, r: jnp.mean(m(x, r) ** 2))(model, rngs)
    optimizer.update(model, grads)
    return loss


def _nnx_state() -> tuple[nnx.Optimizer, object, nnx.State]:
    model = MLP(nnx.Rngs(0))  # dropout draws from an RNG stream that is part of the state
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    return optimizer, graphdef, state


def test_nnx_split_state_with_an_nnx_jit_step():
    optimizer, graphdef, state = _nnx_state()
    step_fn = jaxckpt.nnx_step_fn(graphdef, nnx_train_step)
    report = jaxckpt.check_resume(step_fn, state, BATCHES, steps=3)
    assert report.ok, str(report)
    assert int(optimizer.step.value) == 0  # the check trained copies, not the model
    # The step really trains: parameters, optimizer step and dropout stream all move.
    before = jax.tree.leaves(state)
    after, loss = step_fn(jax.tree.map(jnp.copy, state), BATCHES[0])
    changed = sum(
        not np.array_equal(a, b) for a, b in zip(before, jax.tree.leaves(after), strict=True)
    )
    assert changed > 5 and np.isfinite(loss)


def test_nnx_dropout_rngs_outside_the_state_are_caught():
    _, graphdef, state = _nnx_state()
    outside = nnx.Rngs(dropout=7)  # advanced by every call, never saved

    def leaky(model, optimizer, x):
        return nnx_train_step(model, optimizer, x, outside)

    report = jaxckpt.check_resume(jaxckpt.nnx_step_fn(graphdef, leaky), state, BATCHES, steps=2)
    assert report.verdict == "nondeterministic" and report.repeat_mismatches[0].step == 1


# ---------------------------------------------------------------- flags and train.py


def test_preflight_flag_runs_the_check_only_when_set(tmp_path: Path):
    off = flags.FlagValues()
    jaxckpt.flags.define_flags(off)
    off(["prog"])
    assert jaxckpt.flags.preflight_from_flags(clean_step, _state(), BATCHES, off) is None
    on = flags.FlagValues()
    jaxckpt.flags.define_flags(on)
    scratch = str(tmp_path / "scratch")
    on(["prog", "--checkpoint_preflight_steps=2", f"--checkpoint_preflight_root={scratch}"])
    report = jaxckpt.flags.preflight_from_flags(clean_step, _state(), BATCHES, on)
    assert report is not None and report.ok and report.steps == 2 and report.root == scratch


def test_train_script_preflight_prints_the_report_before_training(tmp_path: Path):
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    script = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
    tiny = ["--batch_size=4", "--seq_len=16", "--d_model=32", "--num_heads=2", "--num_layers=1"]
    proc = subprocess.run(
        [sys.executable, str(script), f"--checkpoint_root={tmp_path / 'run'}", "--steps=2",
         "--preflight", "--checkpoint_preflight_steps=2", *tiny],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("check_resume: OK"), proc.stdout
    assert "2 resumed steps matched" in proc.stdout
    # Training ran after the check and committed its last step.
    assert jaxckpt.CheckpointManager(tmp_path / "run", read_only=True).steps() == [2]
