"""The README's resume loop goes on after a fallback, and saves take any integer step.

a. With no save policy and the newest step corrupt at rest, ``restore()`` falls
   back to the step before; ``save()`` of the corrupt step then replaces it
   (its marker retracted first, logged) instead of raising
   ``StepAlreadyExistsError`` on every restart. A step that is not corrupt is
   still refused. (The multi-process loop: ``test_coordination.py``.)
b. ``save()``, ``restore()``, ``metadata()`` and ``delete()`` take Python ints,
   numpy integers and integer scalar ``jax.Array``s; anything else is refused
   naming the value.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from rootpaths import data_objects

import jaxckpt


def flip_a_byte(root: str, step: int) -> None:
    """Damages every data object of ``step`` at rest (one byte in the middle)."""
    for key in data_objects(root, step):
        path = os.path.join(root, key)
        data = bytearray(Path(path).read_bytes())
        data[len(data) // 2] ^= 0xFF
        Path(path).write_bytes(bytes(data))


def state(step: int) -> dict[str, object]:
    return {"w": np.arange(64, dtype=np.float32) + step, "step": step}


def resume_once(root: str, *, steps: int) -> tuple[int | None, list[int]]:
    """One run of the README loop: restore the newest restorable step, save ``steps`` more."""
    with jaxckpt.CheckpointManager(root) as mgr:
        start = None
        if mgr.latest_step() is not None:
            start = mgr.restore()["step"]
        first = 0 if start is None else start + 1
        for s in range(first, first + steps):
            mgr.save(s, state(s))
        mgr.wait()
        return start, mgr.steps()


def test_the_resume_loop_replaces_a_corrupt_newest_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = str(tmp_path / "run")
    assert resume_once(root, steps=3) == (None, [0, 1, 2])
    flip_a_byte(root, 2)
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        assert resume_once(root, steps=2) == (1, [0, 1, 2, 3])  # falls back, saves 2 again
    assert "step 2 is corrupt" in caplog.text
    assert "retracting its marker and data to save it again" in caplog.text
    with jaxckpt.CheckpointManager(root) as mgr:  # the new step 2 is intact
        np.testing.assert_array_equal(mgr.restore(2)["w"], state(2)["w"])
        assert mgr.verify(2).ok
    assert resume_once(root, steps=1) == (3, [0, 1, 2, 3, 4])  # and the loop goes on


def test_a_step_that_is_not_corrupt_is_still_refused(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    resume_once(root, steps=2)
    flip_a_byte(root, 1)
    with jaxckpt.CheckpointManager(root) as mgr:
        assert mgr.restore()["step"] == 0  # the newest (1) is corrupt: falls back to 0
        with pytest.raises(jaxckpt.StepAlreadyExistsError, match="step 0 already exists"):
            mgr.save(0, state(0))  # intact: never replaced
    refused = pytest.raises(jaxckpt.StepAlreadyExistsError, match="step 1 already exists")
    with jaxckpt.CheckpointManager(root) as mgr, refused:  # it did not find step 1 corrupt
        mgr.save(1, state(1))


@pytest.mark.parametrize(
    "step",
    [np.int64(7), np.int32(7), np.uint8(7), jnp.asarray(7), jnp.asarray(7, dtype=jnp.int16)],
    ids=["np.int64", "np.int32", "np.uint8", "jax int32", "jax int16"],
)
def test_save_takes_any_integer_step(tmp_path: Path, step: object) -> None:
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.save(step, state(7)) is True
        mgr.wait()
        assert mgr.steps() == [7]
        assert type(mgr.steps()[0]) is int
        assert mgr.restore(step)["step"] == 7 and mgr.restored_step == 7
        assert mgr.metadata(step).step == 7
        mgr.delete(step)
        assert mgr.steps() == []


@pytest.mark.parametrize(
    "step",
    [7.0, True, np.float32(7), jnp.asarray(7.0), jnp.asarray([7]), "7", -1],
    ids=["float", "bool", "np.float32", "jax float", "jax vector", "str", "negative"],
)
def test_save_refuses_what_is_not_an_integer_step(tmp_path: Path, step: object) -> None:
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ValueError, match="step must be"):
            mgr.save(step, state(7))
        assert mgr.steps() == []
