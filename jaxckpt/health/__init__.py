"""Whether a committed step is a good place to resume: the verdicts of the health policy,
marks by hand, crash-loop quarantine and rollback, on the manager's side.

``_verdicts`` (:class:`Health`: judging commits, the restore plan that skips bad steps,
the run records that detect crash loops) and ``_access`` (:class:`HealthAccess`: the
manager's ``mark``, ``latest_good_step``, ``rollback`` and ``preempted``). The records
themselves are in :mod:`jaxckpt.records` (``health_records``, ``run_records``); the
policies in :mod:`jaxckpt.policy`.
"""

from __future__ import annotations

from jaxckpt.health._access import HealthAccess as HealthAccess
from jaxckpt.health._verdicts import Health as Health

__all__ = ["Health", "HealthAccess"]
