"""A restore target of another dtype: lossless conversions happen, lossy ones need consent."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxckpt
from jaxckpt.restoring import lossy_cast

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize(
    ("saved", "target", "lossy"),
    [
        ("float32", "float32", False),
        ("float16", "float32", False),
        (BF16, "float32", False),
        ("int8", BF16, False),
        ("int16", "float32", False),
        ("int32", "float64", False),
        ("uint8", "int16", False),
        ("bool", "int8", False),
        ("float32", "float16", True),
        ("float32", BF16, True),
        ("float16", BF16, True),
        (BF16, "float16", True),
        ("int32", "float32", True),
        ("int64", "int32", True),
        ("uint32", "int32", True),
        ("float32", "int32", True),
        ("int64", "float64", True),  # numpy calls it safe; 2**53 + 1 is not a float64
        ("uint64", "float64", True),
        ("uint32", "float64", False),
        ("uint8", BF16, False),
        ("int16", BF16, True),
        ("int8", np.dtype(ml_dtypes.float8_e4m3fn), True),  # ml_dtypes calls it safe
        (np.dtype(ml_dtypes.float8_e4m3fn), BF16, False),
        ("bool", BF16, False),
        ("int8", "complex64", False),
        ("float32", "complex64", False),
        ("int32", "complex64", True),
    ],
)
def test_lossy_is_decided_by_the_dtype_pair(saved, target, lossy):
    assert lossy_cast(np.dtype(saved), np.dtype(target)) is lossy


@pytest.fixture
def root(tmp_path) -> str:
    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(
            1,
            {
                "big": np.full(4, 70000.0, np.float32),
                "count": np.full(3, 16777217, np.int32),
                "small": np.arange(5, dtype=np.int16),
            },
        )
    return root


def _target(big, count, small="float32"):
    return {
        "big": np.zeros(4, big),
        "count": np.zeros(3, count),
        "small": jax.ShapeDtypeStruct((5,), jnp.dtype(small)),
    }


def test_a_lossy_conversion_is_an_error_naming_path_and_dtypes(root):
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    with pytest.raises(jaxckpt.TreeMismatchError) as info:
        mgr.restore(1, target=_target("float16", "float32"))
    text = str(info.value)
    assert "['big']: saved float32, target float16" in text
    assert "['count']: saved int32, target float32" in text
    assert "['small']" not in text  # int16 -> float32 is exact
    assert "allow_lossy_cast=True" in text


def test_lossless_conversions_need_no_consent(root):
    restored = jaxckpt.CheckpointManager(root, read_only=True).restore(
        1, target=_target("float64", "float64")
    )
    assert restored["big"].dtype == np.float64 and restored["big"][0] == 70000.0
    assert restored["count"][0] == 16777217
    assert restored["small"].dtype == jnp.float32
    np.testing.assert_array_equal(restored["small"], np.arange(5))


def test_lossy_conversion_by_consent(root):
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    restored = mgr.restore(1, target=_target("float16", "float32"), allow_lossy_cast=True)
    assert np.isinf(restored["big"]).all() and restored["count"][0] == 16777216
    by_options = jaxckpt.CheckpointManager(
        root, read_only=True, options=jaxckpt.CheckpointOptions(allow_lossy_cast=True)
    )
    assert np.isinf(by_options.restore(1, target=_target("float16", "float32"))["big"]).all()
    with pytest.raises(jaxckpt.TreeMismatchError):  # the keyword overrides the options
        by_options.restore(1, target=_target("float16", "float32"), allow_lossy_cast=False)
