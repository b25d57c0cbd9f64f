"""Saving a step: the save session, the Orbax handler, the writing of one step and its
commit, failed saves (raised or tolerated), save telemetry, the step a save names
(``_stepclock``), Orbax's log lines, and the exit hook that commits a save still in
flight.

Other packages import from this face only; the ``_modules`` are this package's own
(and its unit tests').
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxckpt._lazy import lazy_names
from jaxckpt.saving._telemetry import SaveRecorder as SaveRecorder
from jaxckpt.saving._telemetry import SaveStats as SaveStats
from jaxckpt.saving._telemetry import human_bytes as human_bytes

if TYPE_CHECKING:
    from jaxckpt.saving._failures import FailedSaves as FailedSaves
    from jaxckpt.saving._session import SaveSession as SaveSession
    from jaxckpt.saving._stepclock import StepClock as StepClock
    from jaxckpt.saving._stepclock import check_step_value as check_step_value

# Names whose modules import jax or TensorStore load on first use, so that
# the light modules of this package (and ``jaxckpt ls``) stay free of them.
_LAZY = {
    "FailedSaves": "jaxckpt.saving._failures",
    "SaveSession": "jaxckpt.saving._session",
    "StepClock": "jaxckpt.saving._stepclock",
    "check_step_value": "jaxckpt.saving._stepclock",
}


__getattr__ = lazy_names(__name__, _LAZY, globals())


__all__ = [
    "FailedSaves",
    "SaveRecorder",
    "SaveSession",
    "SaveStats",
    "StepClock",
    "check_step_value",
    "human_bytes",
]
