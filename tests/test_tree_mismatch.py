"""Tree mismatches on restore: short messages that name systematic differences and the fix."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt

MAX_LINES = 20


def _mismatch(mgr: jaxckpt.CheckpointManager, step: int, target, **kwargs) -> str:
    with pytest.raises(jaxckpt.TreeMismatchError) as info:
        mgr.restore(step, target=target, **kwargs)
    text = str(info.value)
    assert len(text.splitlines()) <= MAX_LINES, text
    return text


def _suggested_rename(text: str):
    (code,) = re.findall(r"restore\(\.\.\., rename=(.*)\) supplies", text)
    return eval(code, {"re": re})  # the message's suggestion, as a user would paste it


def test_flax_train_state_against_its_state_dict(tmp_path):
    optax = pytest.importorskip("optax")
    nn = pytest.importorskip("flax.linen")
    from flax import serialization
    from flax.training import train_state

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.relu(nn.Dense(4)(x)))

    model = Mlp()
    params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    with jaxckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(1, serialization.to_state_dict(state))  # what an import or Orbax gives
        text = _mismatch(mgr, 1, state)
        n = len(jax.tree.leaves(state))
        assert text.splitlines()[0] == (
            f"restore target does not match the saved tree: {n} target leaves, 0 found in the "
            f"checkpoint, {n} not in it, {n} saved leaves not in the target, 0 shape mismatches"
        )
        assert "dict key vs attribute (checkpoint ['" in text
        assert "string key vs list index (checkpoint ['0'], target [0])" in text
        assert f"supplies {n} of the {n} missing" in text and "partial=True" not in text
        restored = mgr.restore(1, target=state, rename=_suggested_rename(text))
    assert isinstance(restored, train_state.TrainState)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_value_attribute_against_value_key_and_plain_arrays(tmp_path):
    nnx = pytest.importorskip("flax.nnx")

    class Layer(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(jnp.arange(3.0))
            self.bias = nnx.Param(jnp.ones(2))

    target = nnx.state(Layer())
    with jaxckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(1, {"kernel": {"value": jnp.arange(3.0)}, "bias": {"value": jnp.ones(2)}})
        text = _mismatch(mgr, 1, target)
        assert "dict key vs attribute (checkpoint ['value'], target .value)" in text
        assert "rename=lambda p: p.replace(\"['value']\", '.value')" in text
        restored = mgr.restore(1, target=target, rename=_suggested_rename(text))
        np.testing.assert_array_equal(restored["kernel"].value, np.arange(3.0))
        mgr.save(2, {"kernel": jnp.arange(3.0), "bias": jnp.ones(2)})  # a pure dict
        text = _mismatch(mgr, 2, target)
        assert "saved without the target's trailing .value" in text
        restored = mgr.restore(2, target=target, rename=_suggested_rename(text))
        np.testing.assert_array_equal(restored["bias"].value, np.ones(2))


def test_thousands_of_leaves_stay_short_and_partial_only_when_it_helps(tmp_path):
    layers = 1500  # 3,000 leaves
    saved = {"layers": {str(i): {"w": i, "b": -i} for i in range(layers)}, "extra": "x"}
    with jaxckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(1, saved)
        listed = [{"w": 0, "b": 0} for _ in range(layers)]  # list indices, not string keys
        text = _mismatch(mgr, 1, {"layers": listed})
        assert "... and 2997 more not in checkpoint" in text
        assert "... and 2998 more not in target" in text
        assert f"{2 * layers} of them name the same keys in another form" in text
        assert 'rename=lambda p: re.sub(r"\\[\'(\\d+)\'\\]", r"[\\1]", p)' in text
        assert "partial=True) with that rename restores the target" in text
        rename = _suggested_rename(text)
        restored = mgr.restore(1, target={"layers": listed}, rename=rename, partial=True)
        assert restored["layers"][1234] == {"w": 1234, "b": -1234}
        # Nothing in common: no rename, and no partial=True (it would restore nothing).
        text = _mismatch(mgr, 1, {"other": [0] * 5000})
        assert "rename=" not in text and "partial=True" not in text
        assert "... and 4997 more not in checkpoint" in text
        # Only extra saved leaves: partial=True is the fix.
        text = _mismatch(mgr, 1, {"extra": ""})
        assert text.splitlines()[-1] == (
            "  restore(..., partial=True) restores the target and skips the "
            f"{2 * layers} saved leaves it lacks"
        )


def test_lossy_casts_are_counted_not_all_listed(tmp_path):
    with jaxckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(1, {f"w{i}": np.ones(2, np.float32) for i in range(500)})
        text = _mismatch(mgr, 1, {f"w{i}": np.ones(2, np.float16) for i in range(500)})
    assert text.startswith("restore target converts 500 saved arrays to dtypes")
    assert text.splitlines()[-1] == "  ... and 497 more" and len(text.splitlines()) == 5


@pytest.mark.parametrize("scalar", [1.0, 1, True, "w"])
def test_a_python_scalar_is_no_target_for_an_array_leaf(tmp_path, scalar):
    """A Python scalar has no shape or dtype to restore into: refused, naming the path,
    instead of quietly handing back a numpy array of the saved shape."""
    with jaxckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(1, {"w": jnp.arange(4.0), "z": jnp.float32(1.5), "lr": 0.1})
        mgr.wait()
        for path in ("w", "z"):
            target = {"w": jnp.zeros(4), "z": jnp.float32(0), "lr": 0.0, path: scalar}
            text = _mismatch(mgr, 1, target)
            assert f"type mismatch at ['{path}']: saved " in text, text
            assert f"target a Python {type(scalar).__name__}" in text, text
        # A saved Python value still restores into a Python scalar target.
        restored = mgr.restore(1, target={"w": jnp.zeros(4), "z": jnp.float32(0), "lr": 0.0})
    assert restored["lr"] == 0.1 and float(restored["z"]) == 1.5
