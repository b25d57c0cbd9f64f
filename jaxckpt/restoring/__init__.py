"""Reading committed steps back: the restore selection agreed by every host, the step
reader, step metadata, lazy views, replicated leaves read once and exchanged, restore
targets and the comparison of trees.

Other packages import from this face only; the ``_modules`` are this package's own
(and its unit tests').
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxckpt._lazy import lazy_names
from jaxckpt.restoring._nnx import nnx_step_fn as nnx_step_fn
from jaxckpt.restoring._resumereport import CHECKPOINT as CHECKPOINT
from jaxckpt.restoring._resumereport import NONDETERMINISTIC as NONDETERMINISTIC
from jaxckpt.restoring._resumereport import OK as OK
from jaxckpt.restoring._resumereport import LeafMismatch as LeafMismatch
from jaxckpt.restoring._resumereport import ResumeReport as ResumeReport

if TYPE_CHECKING:
    from jaxckpt.restoring._compare import compare_trees as compare_trees
    from jaxckpt.restoring._compare import paths_of as paths_of
    from jaxckpt.restoring._compare import restore_notes as restore_notes
    from jaxckpt.restoring._compare import tree_structure as tree_structure
    from jaxckpt.restoring._lazy import DEFAULT_BLOCK_BYTES as DEFAULT_BLOCK_BYTES
    from jaxckpt.restoring._lazy import LeafView as LeafView
    from jaxckpt.restoring._lazy import StepView as StepView
    from jaxckpt.restoring._lazy import dotted_path as dotted_path
    from jaxckpt.restoring._lazy import open_step as open_step
    from jaxckpt.restoring._match import PathMap as PathMap
    from jaxckpt.restoring._match import lossy_cast as lossy_cast
    from jaxckpt.restoring._metadata import LeafInfo as LeafInfo
    from jaxckpt.restoring._metadata import StepMetadata as StepMetadata
    from jaxckpt.restoring._metadata import step_metadata as step_metadata
    from jaxckpt.restoring._select import Selection as Selection
    from jaxckpt.restoring._stepreader import LoadedStep as LoadedStep
    from jaxckpt.restoring._stepreader import load_step as load_step
    from jaxckpt.restoring._stepreader import tier_reader as tier_reader
    from jaxckpt.restoring._targets import concrete_targets as concrete_targets

# Names whose modules import jax or TensorStore load on first use, so that
# the light modules of this package (and ``jaxckpt ls``) stay free of them.
_LAZY = {
    "tier_reader": "jaxckpt.restoring._stepreader",
    "compare_trees": "jaxckpt.restoring._compare",
    "paths_of": "jaxckpt.restoring._compare",
    "restore_notes": "jaxckpt.restoring._compare",
    "tree_structure": "jaxckpt.restoring._compare",
    "DEFAULT_BLOCK_BYTES": "jaxckpt.restoring._lazy",
    "LeafView": "jaxckpt.restoring._lazy",
    "StepView": "jaxckpt.restoring._lazy",
    "dotted_path": "jaxckpt.restoring._lazy",
    "open_step": "jaxckpt.restoring._lazy",
    "PathMap": "jaxckpt.restoring._match",
    "lossy_cast": "jaxckpt.restoring._match",
    "LeafInfo": "jaxckpt.restoring._metadata",
    "StepMetadata": "jaxckpt.restoring._metadata",
    "step_metadata": "jaxckpt.restoring._metadata",
    "Selection": "jaxckpt.restoring._select",
    "LoadedStep": "jaxckpt.restoring._stepreader",
    "load_step": "jaxckpt.restoring._stepreader",
    "concrete_targets": "jaxckpt.restoring._targets",
}


__getattr__ = lazy_names(__name__, _LAZY, globals())


__all__ = [
    "CHECKPOINT",
    "DEFAULT_BLOCK_BYTES",
    "NONDETERMINISTIC",
    "OK",
    "LeafInfo",
    "LeafMismatch",
    "LeafView",
    "LoadedStep",
    "PathMap",
    "ResumeReport",
    "Selection",
    "StepMetadata",
    "StepView",
    "compare_trees",
    "concrete_targets",
    "dotted_path",
    "load_step",
    "lossy_cast",
    "nnx_step_fn",
    "open_step",
    "paths_of",
    "restore_notes",
    "step_metadata",
    "tier_reader",
    "tree_structure",
]
