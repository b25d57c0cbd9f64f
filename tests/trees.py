"""Sample training states and bit-exact tree comparison, shared by the test modules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def sample_state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": jnp.asarray(rng.standard_normal((64, 32), dtype=np.float32)),
            "b": jnp.asarray(rng.standard_normal(32), dtype=jnp.bfloat16),
        },
        "f16": jnp.asarray(rng.standard_normal(7), dtype=jnp.float16),
        "i8": jnp.asarray(rng.integers(-128, 127, (5, 3)), dtype=jnp.int8),
        "np_i8": np.asarray(rng.integers(-128, 127, (5, 3)), dtype=np.int8),
        "u16": jnp.asarray(rng.integers(0, 65535, 9), dtype=jnp.uint16),
        "mask": jnp.asarray(rng.integers(0, 2, (4, 4)).astype(bool)),
        "scalar": jnp.float32(seed + 0.5),
        "empty": jnp.zeros((0, 3), jnp.float32),
        "np_empty": np.zeros((2, 0), np.int16),
        "step": seed,
        "lr": 0.125,
        "name": "run-α",
        "flag": True,
        "nothing": None,
        "layers": [jnp.ones(3) * seed, {"k": jnp.arange(4, dtype=jnp.int32)}],
    }


def _bits(x) -> bytes:
    a = np.asarray(x)
    return a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()


def assert_tree_bitexact(a, b) -> None:
    la, ta = jax.tree_util.tree_flatten(a, is_leaf=lambda x: x is None)
    lb, tb = jax.tree_util.tree_flatten(b, is_leaf=lambda x: x is None)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if hasattr(x, "dtype"):
            assert np.asarray(x).dtype == np.asarray(y).dtype
            assert _bits(x) == _bits(y)
        else:
            assert x == y and type(x) is type(y)
