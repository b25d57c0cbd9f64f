"""Cost models, pure: the time and requests of a save and a restore, and at cluster scale.

Other packages import from this face only; the ``_modules`` are this package's own
(and its unit tests').
"""

from __future__ import annotations

from jaxckpt.planning._assumptions import STORES as STORES
from jaxckpt.planning._assumptions import assumptions as assumptions
from jaxckpt.planning._costs import PlanResult as PlanResult
from jaxckpt.planning._costs import object_plan as object_plan
from jaxckpt.planning._costs import plan as plan
from jaxckpt.planning._costs import process_share as process_share
from jaxckpt.planning._floors import Link as Link
from jaxckpt.planning._floors import floor as floor
from jaxckpt.planning._floors import floors as floors
from jaxckpt.planning._measured import measured_profile as measured_profile
from jaxckpt.planning._measured import named_profiles as named_profiles
from jaxckpt.planning._profiles import PROFILES as PROFILES
from jaxckpt.planning._profiles import Linear as Linear
from jaxckpt.planning._profiles import fit_profile as fit_profile
from jaxckpt.planning._scale import PhaseCost as PhaseCost
from jaxckpt.planning._scale import scale_plan as scale_plan
from jaxckpt.planning._scale import to_dict as to_dict

__all__ = [
    "PROFILES",
    "STORES",
    "Linear",
    "Link",
    "PhaseCost",
    "PlanResult",
    "assumptions",
    "fit_profile",
    "floor",
    "floors",
    "measured_profile",
    "named_profiles",
    "object_plan",
    "plan",
    "process_share",
    "scale_plan",
    "to_dict",
]
