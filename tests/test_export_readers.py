"""``export_orbax`` output read back by the readers a Flax port uses: Orbax's plain
``StandardRestore`` (also when the step has a data-iterator item) and Flax's legacy
``flax.training.checkpoints.restore_checkpoint`` (which silently returned the
initial state when pointed at the export)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import linen
from flax.training import checkpoints as flax_checkpoints
from flax.training import train_state

import jaxckpt
from jaxckpt import cli


def _states() -> tuple[train_state.TrainState, train_state.TrainState]:
    module = linen.Dense(3)
    params = module.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    initial = train_state.TrainState.create(
        apply_fn=module.apply, params=params, tx=optax.adam(1e-2)
    )
    grads = jax.tree.map(jnp.ones_like, params)
    update = jax.jit(lambda s, g: s.apply_gradients(grads=g))  # step: an int32 array
    initial = initial.replace(step=jnp.int32(0))
    return initial, update(update(initial, grads), grads)


def _same(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb, strict=True)
    )


def test_manager_export_restores_with_standard_restore_and_flax_reader(tmp_path):
    initial, trained = _states()
    root, dest = str(tmp_path / "run"), str(tmp_path / "orbax")
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(2, trained, process_state={"pos": 64})  # a data_iter item beside it
    result = jaxckpt.export_orbax(root, dest, target=jax.eval_shape(lambda: initial))
    assert result.path == os.path.join(dest, "2", "default")
    abstract = jax.eval_shape(lambda: initial)
    with ocp.CheckpointManager(dest) as orbax:  # before: "Must provide args of type Composite"
        restored = orbax.restore(2, args=ocp.args.StandardRestore(abstract))
    assert int(restored.step) == 2 and _same(restored, trained)
    flax = flax_checkpoints.restore_checkpoint(result.path, target=initial)
    assert int(flax.step) == 2 and _same(flax, trained)


def test_flax_layout_is_found_by_flax_legacy_reader(tmp_path, capsys):
    initial, trained = _states()
    root, dest = str(tmp_path / "run"), str(tmp_path / "flax")
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(2, trained)
    abstract = jax.eval_shape(lambda: initial)
    result = jaxckpt.export_orbax(root, dest, target=abstract, layout="flax")
    assert result.path == os.path.join(dest, "checkpoint_2")
    flax = flax_checkpoints.restore_checkpoint(dest, target=initial)  # before: step 0
    assert int(flax.step) == 2 and _same(flax, trained)
    with ocp.StandardCheckpointer() as checkpointer:
        assert _same(checkpointer.restore(result.path, abstract), trained)
    # The command line writes the same layout (the saved nesting, no target).
    assert cli.main(["export", f"{root}:2", str(tmp_path / "cli"), "--format", "orbax",
                     "--layout", "flax"]) == 0  # fmt: skip
    assert "checkpoint_2 (Orbax)" in capsys.readouterr().out
    raw = flax_checkpoints.restore_checkpoint(str(tmp_path / "cli"), target=None)
    assert int(raw["step"]) == 2
