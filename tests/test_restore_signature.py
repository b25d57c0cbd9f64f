"""Restored arrays have the signature of the target: a jitted step needs no recompile.

A jitted function compiles once per signature of its arguments (shape, dtype, weak
type, sharding, committedness). A restore onto the arrays (or the ``jax.eval_shape``)
of the state a step was compiled for must give arrays of the same signature, or the
first step after every restart compiles again; a weak type lost also changes what the
resumed run computes (``test_preflight``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt

COMPILE = "/jax/core/compile/backend_compile_duration"


@pytest.fixture
def compiles() -> Iterator[list[str]]:
    """The backend compilations JAX reports while the test runs."""
    seen: list[str] = []

    def listen(name: str, secs: float, **kwargs: Any) -> None:
        if name == COMPILE:
            seen.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def init() -> dict[str, Any]:
    """A state as a jitted init makes it: the Python float becomes a weakly typed array."""
    return {"w": jnp.ones((8, 4), jnp.bfloat16), "step": jnp.int32(0), "lr": 0.5}


def train_step(state: dict[str, Any]) -> dict[str, Any]:
    return {"w": state["w"] * state["lr"], "step": state["step"] + 1, "lr": state["lr"]}


@pytest.mark.parametrize("kind", ["arrays", "eval_shape"])
def test_a_restored_state_runs_the_compiled_step_without_compiling_again(
    tmp_path: Path, compiles: list[str], kind: str
) -> None:
    state = jax.jit(init)()
    assert state["lr"].weak_type and not state["w"].committed
    step = jax.jit(train_step)
    expected = step(state)
    with jaxckpt.CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, state)
    target = state if kind == "arrays" else jax.eval_shape(jax.jit(init))
    with jaxckpt.CheckpointManager(tmp_path / "root") as mgr:
        restored = jax.block_until_ready(mgr.restore(target=target))
    for name, leaf in restored.items():
        assert isinstance(leaf, jax.Array), name
        assert (leaf.dtype, leaf.weak_type, leaf.committed) == (
            state[name].dtype,
            state[name].weak_type,
            state[name].committed,
        ), name
        assert leaf.sharding == state[name].sharding, name
    before = len(compiles)
    resumed = jax.block_until_ready(step(restored))
    assert len(compiles) == before  # the step compiled for the saved state ran as it was
    assert resumed["w"].dtype == jnp.bfloat16  # bfloat16 times a weak float stays bfloat16
    jax.tree.map(np.testing.assert_array_equal, resumed, expected)
