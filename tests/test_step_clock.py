"""``save(state.step)`` with a jax.Array step: a declined save does not wait for the device.

On CPU a computation with a host callback runs synchronously, so a step "still
being computed" is simulated: the clock's readiness check answers False for the
arrays the test holds, and every read of a step's value is recorded. A declined
save must not read its step; a save the policy takes reads it, and stores the
true value. The cost in a real loop is measured by ``bench.py declined``.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt
from jaxckpt import policy
from jaxckpt.saving import _stepclock


class Held:
    """Arrays the clock must treat as still being computed, and the steps it read."""

    def __init__(self, monkeypatch) -> None:
        self.held: set[int] = set()
        self.read: list[int] = []
        ready, check = _stepclock._ready, _stepclock.check_step_value

        def spy_ready(array):
            return id(array) not in self.held and ready(array)

        def spy_check(step):
            value = check(step)
            if isinstance(step, jax.Array):
                self.read.append(value)
            return value

        monkeypatch.setattr(_stepclock, "_ready", spy_ready)
        monkeypatch.setattr(_stepclock, "check_step_value", spy_check)

    def step(self, value: int, *, held: bool = True) -> jax.Array:
        array = jnp.asarray(value, jnp.int32) + 0  # a computed scalar, as state.step is
        if held:
            self.held.add(id(array))
        return array


def test_declined_saves_of_a_computing_step_do_not_read_it_and_saved_steps_are_exact(
    tmp_path, monkeypatch
):
    steps = Held(monkeypatch)
    state = {"w": np.arange(4.0)}
    with jaxckpt.CheckpointManager(tmp_path, save_policy=policy.EveryNSteps(5)) as mgr:
        for value in (1, 2, 3):  # computed steps are read: the stride (1) is confirmed
            mgr.save(steps.step(value, held=False), state)
        assert steps.read == [1, 2, 3]
        assert mgr.save(steps.step(4), state) is False  # predicted, declined, not read
        assert steps.read == [1, 2, 3]
        assert mgr.save(steps.step(5), state) is True  # the policy saves it: read
        assert steps.read == [1, 2, 3, 5]
        mgr.wait()
        assert mgr.steps() == [5]
        for value in range(6, 10):
            assert mgr.save(steps.step(value), state) is False
        assert steps.read == [1, 2, 3, 5]


def test_a_wrong_prediction_warns_once_and_the_clock_then_reads_every_step(
    tmp_path, monkeypatch, caplog
):
    steps = Held(monkeypatch)
    with jaxckpt.CheckpointManager(tmp_path, save_policy=policy.EveryNSteps(10)) as mgr:
        for value in (1, 2, 3):
            mgr.save(steps.step(value, held=False), {"w": np.zeros(2)})
        with caplog.at_level(logging.WARNING, logger="jaxckpt"):
            held = steps.step(9)  # predicted as 4: declined (9 is not saved either)
            assert mgr.save(held, {"w": np.zeros(2)}) is False
            steps.held.clear()  # its computation finished: the next call checks it
            assert mgr.save(steps.step(10), {"w": np.ones(2)}) is True
            assert mgr.save(steps.step(11), {"w": np.ones(2)}) is False
        warnings = [r.getMessage() for r in caplog.records if "predicted as 4" in r.getMessage()]
        assert len(warnings) == 1 and "Pass the loop's own Python int counter" in warnings[0]
        assert steps.read[-2:] == [10, 11]  # read from then on
        mgr.wait()
        assert mgr.steps() == [10]


def test_a_prediction_the_policy_saves_is_checked_before_the_save(tmp_path, monkeypatch):
    steps = Held(monkeypatch)
    with jaxckpt.CheckpointManager(tmp_path, save_policy=policy.EveryNSteps(4)) as mgr:
        for value in (1, 2, 3):
            mgr.save(steps.step(value, held=False), {"w": np.zeros(2)})
        # Predicted 4 (saved by the policy), but it is 6: read, and 6 is declined.
        assert mgr.save(steps.step(6), {"w": np.zeros(2)}) is False
        assert steps.read[-1] == 6
        assert mgr.save(steps.step(8, held=False), {"w": np.zeros(2)}) is True
        mgr.wait()
        assert mgr.steps() == [8]


@pytest.mark.parametrize("step", [np.int64(5), np.uint8(5), 5])
def test_integer_steps_of_any_kind_are_read_as_they_are(tmp_path, step):
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.save(step, {"w": np.zeros(2)}) is True
        mgr.wait()
        assert mgr.steps() == [5]
