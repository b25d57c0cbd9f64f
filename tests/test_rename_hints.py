"""Where a port needs ``rename=``, the mismatch error offers one that works: under
``partial=True``, for a renamed top-level key, for a Linen ``TrainState`` imported
without a target (its fields saved as dict keys), and a hint for typed RNG keys
saved as their raw data."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import linen
from flax.training import train_state

import jaxckpt


def _suggested(error: str):
    """The ``rename=`` the message suggests, evaluated."""
    text = re.search(r"restore\(\.\.\., rename=(.*)\) supplies", error)[1]
    return eval(text, {"re": re})


def test_partial_and_renamed_top_level_keys_get_a_rename(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"params": {"w": np.ones(3), "b": np.zeros(2)}, "opt": {"mu": np.ones(3)}})
    mgr = jaxckpt.CheckpointManager(tmp_path)
    target = {"model": {"w": np.zeros(3), "b": np.zeros(2)}}
    for partial in (True, False):
        with pytest.raises(jaxckpt.TreeMismatchError) as e:
            mgr.restore(1, target=target, partial=partial)
        assert "rename={\"['params']\": \"['model']\"}" in str(e.value)
    rename = _suggested(str(e.value))
    restored = mgr.restore(1, target=target, partial=True, rename=rename)
    np.testing.assert_array_equal(restored["model"]["w"], np.ones(3))


def test_a_train_state_imported_without_a_target_gets_one_rename(tmp_path):
    module = linen.Dense(3)
    params = module.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    state = train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)
    src = str(tmp_path / "orbax")
    with ocp.CheckpointManager(src) as orbax:
        orbax.save(1, args=ocp.args.StandardSave(state))
    jaxckpt.import_orbax(src, tmp_path / "run")  # no target: the saved nesting, as dicts
    mgr = jaxckpt.CheckpointManager(tmp_path / "run")
    abstract = jax.eval_shape(lambda: state)
    with pytest.raises(jaxckpt.TreeMismatchError) as e:
        mgr.restore(1, target=abstract)
    rename = _suggested(str(e.value))
    restored = mgr.restore(1, target=abstract, rename=rename, partial=True)
    assert np.asarray(restored.params["kernel"]).tobytes() == np.asarray(params["kernel"]).tobytes()


def test_a_typed_key_saved_as_raw_data_names_wrap_key_data(tmp_path):
    key = jax.random.key(3)
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"rngs": {"default": np.asarray(jax.random.key_data(key))}})
    with pytest.raises(jaxckpt.TreeMismatchError, match=r"jax\.random\.wrap_key_data"):
        jaxckpt.CheckpointManager(tmp_path).restore(1, target={"rngs": {"default": key}})
