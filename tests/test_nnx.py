"""Flax state through jaxckpt: NNX models with optimizers, Linen TrainState, PRNG keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


def _bits(x) -> bytes:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.asarray(x)
    return a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()


def assert_bitexact(a, b) -> None:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    assert [_bits(x) for x in la] == [_bits(y) for y in lb]


@pytest.fixture
def mesh() -> Mesh:
    devices = np.array(jax.devices())
    return Mesh(devices.reshape(-1, 1), ("data", "model"))


# ------------------------------------------------------------------------------- NNX


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.down = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(nnx.relu(self.norm(self.up(x))))


def _model_and_optimizer(seed: int) -> tuple[MLP, nnx.Optimizer]:
    model = MLP(nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


@nnx.jit
def _train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array) -> None:
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)


def _train(model: MLP, optimizer: nnx.Optimizer, steps: int) -> None:
    x = jnp.linspace(-1, 1, 16 * 8).reshape(16, 8)
    for _ in range(steps):
        _train_step(model, optimizer, x)


def _spec(shape: tuple[int, ...]) -> P:
    """Kernels split their input axis over ``data`` and output axis over ``model``."""
    return P("data", "model") if len(shape) == 2 else P("model") if len(shape) == 1 else P()


def test_nnx_model_and_optimizer_restore_into_an_abstract_sharded_state(tmp_path, mesh):
    model, optimizer = _model_and_optimizer(0)
    _train(model, optimizer, 3)
    state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(3, state)

    abstract_model, abstract_opt = nnx.eval_shape(lambda: _model_and_optimizer(1))
    graphdef, abstract_model_state = nnx.split(abstract_model)
    opt_graphdef, abstract_opt_state = nnx.split(abstract_opt)
    # nnx.eval_shape gives ShapeDtypeStructs without shardings: attach them explicitly.
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, _spec(x.shape))
        ),
        {"model": abstract_model_state, "optimizer": abstract_opt_state},
    )
    restored = jaxckpt.CheckpointManager(tmp_path, read_only=True).restore(target=target)

    flat_target, _ = jax.tree_util.tree_flatten_with_path(target)
    flat_restored = jax.tree.leaves(restored)
    assert len(flat_target) == len(flat_restored) > 10
    for (path, t), r in zip(flat_target, flat_restored, strict=True):
        assert isinstance(r, jax.Array), path
        assert r.sharding == t.sharding, jax.tree_util.keystr(path)
        assert (r.shape, r.dtype) == (t.shape, t.dtype)
    assert restored["model"]["up"]["kernel"].value.sharding.spec == P("data", "model")
    assert_bitexact(restored, state)

    # The restored state rebuilds a working model and optimizer.
    model2 = nnx.merge(graphdef, restored["model"])
    optimizer2 = nnx.merge(opt_graphdef, restored["optimizer"])
    x = jnp.ones((2, 8))
    np.testing.assert_allclose(model2(x), model(x), rtol=1e-6)
    _train(model2, optimizer2, 1)
    assert int(optimizer2.step.value) == 4


def test_nnx_update_into_an_existing_model(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    _train(model, optimizer, 1)
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, nnx.state(model))
    fresh = MLP(nnx.Rngs(5))
    target = nnx.state(fresh)
    nnx.update(fresh, jaxckpt.CheckpointManager(tmp_path, read_only=True).restore(target=target))
    x = jnp.ones((2, 8))
    np.testing.assert_array_equal(fresh(x), model(x))


# ----------------------------------------------------------------------------- Linen


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return linen.Dense(4)(linen.relu(linen.Dense(16)(x)))


def test_linen_train_state_with_optax_state(tmp_path, mesh):
    module = LinenMLP()
    x = jnp.ones((4, 8))
    params = module.init(jax.random.key(0), x)["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    state = train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)
    grad_fn = jax.jit(jax.grad(lambda p: jnp.sum(module.apply({"params": p}, x) ** 2)))
    update = jax.jit(lambda s, g: s.apply_gradients(grads=g))
    for _ in range(2):
        grads = grad_fn(state.params)
        state = update(state, grads)
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(2, state)

    replicated = NamedSharding(mesh, P())
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
        jax.eval_shape(lambda: state),
    )
    restored = jaxckpt.CheckpointManager(tmp_path, read_only=True).restore(target=abstract)
    assert isinstance(restored, train_state.TrainState)
    assert restored.apply_fn is state.apply_fn and restored.tx is state.tx
    assert restored.step == 2
    assert_bitexact(restored, state)
    arrays = [x for x in jax.tree.leaves(restored) if isinstance(x, jax.Array)]
    assert len(arrays) > 5 and all(x.sharding == replicated for x in arrays)
    mu = restored.opt_state[1][0].mu["Dense_0"]["kernel"]
    np.testing.assert_array_equal(mu, state.opt_state[1][0].mu["Dense_0"]["kernel"])
    # It trains on from where it was saved.
    assert_bitexact(update(restored, grads), update(state, grads))


# -------------------------------------------------------------------------------- keys


def test_typed_and_legacy_prng_keys_round_trip(tmp_path):
    keys = {
        "typed": jax.random.key(42),
        "typed_batch": jax.random.split(jax.random.key(1), 4),
        "rbg": jax.random.key(3, impl="rbg"),
        "legacy": jax.random.PRNGKey(7),
    }
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, keys)
    reader = jaxckpt.CheckpointManager(tmp_path, read_only=True)
    for restored in (reader.restore(target=jax.eval_shape(lambda: keys)), reader.restore()):
        for name in ("typed", "typed_batch", "rbg"):
            assert jax.dtypes.issubdtype(restored[name].dtype, jax.dtypes.prng_key), name
            assert jax.random.key_impl(restored[name]) == jax.random.key_impl(keys[name])
            assert restored[name].shape == keys[name].shape
            assert _bits(restored[name]) == _bits(keys[name])
        legacy = restored["legacy"]
        assert legacy.dtype == np.uint32 and legacy.shape == (2,)
        np.testing.assert_array_equal(legacy, keys["legacy"])
        # The restored keys draw the same numbers.
        for name in ("typed", "rbg", "legacy"):
            np.testing.assert_array_equal(
                jax.random.normal(restored[name], (3,)), jax.random.normal(keys[name], (3,))
            )
