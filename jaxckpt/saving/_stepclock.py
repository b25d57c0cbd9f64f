"""The step a ``save`` was given, read without waiting for the device where that is safe.

``save(state.step, ...)`` passes a scalar ``jax.Array`` that the training step is
still computing (JAX dispatches asynchronously). Reading it (``int(step)``) waits
for that computation: one whole training step on every call, declined ones
included, and the loop loses its asynchronous dispatch. Most calls are declined by
the save policy, so the clock predicts the value instead:

* a Python or numpy integer, and an array that is already computed, are read as is;
* once two calls in a row have advanced by the same stride (1 for a loop that
  calls ``save`` every step), an array still being computed is taken to be the
  last step plus that stride. The policy decides on that prediction; when it says
  save, the array is read (the save needs the state anyway, so that wait is free);
* every prediction is checked when its array has been computed (a copy is kept,
  so a donated ``state`` does not lose it). A prediction that was wrong turns the
  clock off for good and logs one warning naming the cost and the fix (pass the
  loop's own counter); so does a job of several processes, where every process
  must decide alike and so reads the value.
"""

from __future__ import annotations

import collections
import logging
import operator
from collections.abc import Callable
from typing import Any, cast

import jax
import numpy as np

from jaxckpt.records import check_step

__all__ = ["StepClock", "check_step_value"]

log = logging.getLogger("jaxckpt")

_MAX_PENDING = 256  # predictions awaiting their check; the oldest is then read (long done)


@jax.jit
def _copy(step: jax.Array) -> jax.Array:
    """A copy of a scalar, dispatched without waiting (~30 us on CPU)."""
    return step + 0


def _ready(array: jax.Array) -> bool:
    """Whether the computation of ``array`` is done (``ArrayImpl.is_ready``; the
    ``jax.Array`` protocol does not declare it)."""
    return bool(array.is_ready())  # type: ignore[attr-defined]


def _check_array(step: jax.Array) -> None:
    if step.ndim != 0 or not np.issubdtype(step.dtype, np.integer):
        raise ValueError(f"step must be an integer scalar, got an array {step.dtype}{step.shape}")


def check_step_value(step: object) -> int:
    """``step`` as a step id: any integer (a Python int, a numpy integer, an integer
    scalar ``jax.Array`` such as ``state.step``, read by waiting for it), from 0 to 2**63 - 1.

    Raises:
      ValueError: anything else (a bool, a float, a non-scalar array, out of range).
    """
    if isinstance(step, jax.Array):
        _check_array(step)
        step = int(step)
    elif not isinstance(step, (bool, int)) and hasattr(step, "__index__"):
        step = operator.index(step)  # numpy integers
    return check_step(step)


class StepClock:
    """Predicts the steps of ``save`` calls from the ones before (see the module)."""

    def __init__(self, *, predict: bool) -> None:
        self._predict = predict
        self._last: int | None = None
        self._stride: int | None = None
        self._confirmed = False
        self._pending: collections.deque[tuple[jax.Array, int]] = collections.deque()
        self._warned = False

    def read(self, step: object) -> tuple[int, bool]:
        """``(value, exact)``: the step's value, or (``exact`` False) its prediction."""
        self._check_pending(wait=False)
        if not isinstance(step, jax.Array):
            return self._seen(check_step_value(step)), True
        _check_array(step)
        if _ready(step) or not (self._predict and self._confirmed):
            if self._predict is False and not _ready(step):
                self._warn("this job has several processes, which must all decide alike")
            return self._seen(check_step_value(step)), True
        assert self._last is not None and self._stride is not None
        guess = check_step(self._last + self._stride)
        self._pending.append((_copy(step), guess))  # a state donated later keeps it
        if len(self._pending) > _MAX_PENDING:
            self._check_pending(wait=True)
        self._last = guess
        return guess, False

    def decide(
        self, step: object, force: bool, policy: Callable[..., bool], *context: Any
    ) -> tuple[int, bool]:
        """The step's value and whether to save it (``policy(step, *context)``: the save
        policy's answer); a step still being computed is predicted, and read only to be saved."""
        if force:
            return check_step_value(step), True

        def says(value: int) -> bool:
            return bool(policy(value, *context))

        value, exact = self.read(step)
        saving = says(value)
        if not exact and saving:
            guess, value = value, self.exact(cast(jax.Array, step), value)
            saving = saving if value == guess else says(value)
        return value, saving

    def exact(self, step: jax.Array, guess: int) -> int:
        """The value of a predicted ``step`` (waits for it); a wrong guess stops predicting."""
        value = check_step_value(step)
        if value != guess:
            self._wrong(guess, value)
        self._last = value
        return value

    def _seen(self, value: int) -> int:
        if self._last is not None:
            stride = value - self._last
            self._confirmed = stride > 0 and stride == self._stride
            self._stride = stride
        self._last = value
        return value

    def _check_pending(self, *, wait: bool) -> None:
        while self._pending and (wait or _ready(self._pending[0][0])):
            array, guess = self._pending.popleft()
            value = int(array)
            if value != guess:
                self._wrong(guess, value)
            wait = False

    def _wrong(self, guess: int, value: int) -> None:
        self._predict = self._confirmed = False
        self._pending.clear()
        self._warn(
            f"a save() step was predicted as {guess} from the calls before but was {value}, "
            "so the save policy may have decided on the wrong step once"
        )

    def _warn(self, why: str) -> None:
        if self._warned:
            return
        self._warned = True
        log.warning(
            "save(step) got a jax.Array step that is still being computed, and %s: reading "
            "it now waits for that computation (about one training step) on every save() "
            "call, declined ones too. Pass the loop's own Python int counter instead "
            "(e.g. `for step in range(...)`: mgr.save(step, state)).",
            why,
        )
