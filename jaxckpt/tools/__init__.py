"""Tools over committed steps: copy, verify, diff, stats and safetensors export.

Other packages import from this face only; the ``_modules`` are this package's own
(and its unit tests').
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxckpt._lazy import lazy_names
from jaxckpt.tools._copy import copy_part as copy_part
from jaxckpt.tools._copy import copy_step as copy_step

if TYPE_CHECKING:
    from jaxckpt.tools._diff import IDENTICAL as IDENTICAL
    from jaxckpt.tools._diff import diff_steps as diff_steps
    from jaxckpt.tools._safetensors import export_safetensors as export_safetensors
    from jaxckpt.tools._safetensorsread import SafetensorsFormatError as SafetensorsFormatError
    from jaxckpt.tools._safetensorsread import read_safetensors as read_safetensors
    from jaxckpt.tools._safetensorsread import tree_from_names as tree_from_names
    from jaxckpt.tools._stats import plot as plot
    from jaxckpt.tools._stats import trajectory as trajectory
    from jaxckpt.tools._verify import Problem as Problem
    from jaxckpt.tools._verify import VerifyReport as VerifyReport
    from jaxckpt.tools._verify import verify_step as verify_step

# Names whose modules import jax or TensorStore load on first use, so that
# the light modules of this package (and ``jaxckpt ls``) stay free of them.
_LAZY = {
    "SafetensorsFormatError": "jaxckpt.tools._safetensorsread",
    "IDENTICAL": "jaxckpt.tools._diff",
    "diff_steps": "jaxckpt.tools._diff",
    "export_safetensors": "jaxckpt.tools._safetensors",
    "read_safetensors": "jaxckpt.tools._safetensorsread",
    "tree_from_names": "jaxckpt.tools._safetensorsread",
    "plot": "jaxckpt.tools._stats",
    "trajectory": "jaxckpt.tools._stats",
    "Problem": "jaxckpt.tools._verify",
    "VerifyReport": "jaxckpt.tools._verify",
    "verify_step": "jaxckpt.tools._verify",
}


__getattr__ = lazy_names(__name__, _LAZY, globals())


__all__ = [
    "IDENTICAL",
    "Problem",
    "SafetensorsFormatError",
    "VerifyReport",
    "copy_part",
    "copy_step",
    "diff_steps",
    "export_safetensors",
    "plot",
    "read_safetensors",
    "trajectory",
    "tree_from_names",
    "verify_step",
]
