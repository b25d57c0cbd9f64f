"""jaxckpt: crash-safe, asynchronous, checksummed zarr checkpoints for JAX.

The public API is re-exported here. Names are imported lazily (PEP 562), so
``import jaxckpt.policy`` and the ``jaxckpt ls`` command do not import jax.

>>> import jaxckpt
>>> errors = [getattr(jaxckpt, n) for n in jaxckpt.__all__ if n.endswith("Error")]
>>> all(issubclass(e, jaxckpt.CheckpointError) for e in errors), len(errors) > 10
(True, True)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from jaxckpt.errors import CheckpointError as CheckpointError
from jaxckpt.errors import CorruptCheckpointError as CorruptCheckpointError
from jaxckpt.errors import LocalRootInUseError as LocalRootInUseError
from jaxckpt.errors import NotACheckpointRootError as NotACheckpointRootError
from jaxckpt.errors import PeerAuthError as PeerAuthError
from jaxckpt.errors import PeerError as PeerError
from jaxckpt.errors import PlacementError as PlacementError
from jaxckpt.errors import PromotionError as PromotionError
from jaxckpt.errors import PromotionTimeoutError as PromotionTimeoutError
from jaxckpt.errors import SaveFailedError as SaveFailedError
from jaxckpt.errors import SaveTimeoutError as SaveTimeoutError
from jaxckpt.errors import StepAlreadyExistsError as StepAlreadyExistsError
from jaxckpt.errors import StepNotFoundError as StepNotFoundError
from jaxckpt.errors import StorageError as StorageError
from jaxckpt.errors import TreeMismatchError as TreeMismatchError
from jaxckpt.errors import UncommittedStepError as UncommittedStepError
from jaxckpt.errors import UnsupportedFormatError as UnsupportedFormatError
from jaxckpt.errors import UnsupportedLeafError as UnsupportedLeafError
from jaxckpt.errors import WriterFencedError as WriterFencedError

if TYPE_CHECKING:
    from jaxckpt import policy as policy
    from jaxckpt._manager import CheckpointManager as CheckpointManager
    from jaxckpt._options import CheckpointOptions as CheckpointOptions
    from jaxckpt.ledger import Report as Report
    from jaxckpt.ledger import report as report
    from jaxckpt.records._metadata import LeafInfo as LeafInfo
    from jaxckpt.records._metadata import StepMetadata as StepMetadata
    from jaxckpt.restoring._lazy import LeafView as LeafView
    from jaxckpt.restoring._lazy import StepView as StepView
    from jaxckpt.restoring._lazy import open_step as open_step
    from jaxckpt.restoring._nnx import nnx_step_fn as nnx_step_fn
    from jaxckpt.restoring._preflight import LeafMismatch as LeafMismatch
    from jaxckpt.restoring._preflight import ResumeReport as ResumeReport
    from jaxckpt.restoring._preflight import check_resume as check_resume
    from jaxckpt.saving._telemetry import SaveStats as SaveStats
    from jaxckpt.storage import ObjectStoreOptions as ObjectStoreOptions
    from jaxckpt.tools._diff import diff_steps as diff_steps
    from jaxckpt.tools._import import import_safetensors as import_safetensors
    from jaxckpt.tools._orbax_export import export_orbax as export_orbax
    from jaxckpt.tools._orbax_import import import_orbax as import_orbax
    from jaxckpt.tools._safetensors import export_safetensors as export_safetensors
    from jaxckpt.tools._verify import Problem as Problem
    from jaxckpt.tools._verify import VerifyReport as VerifyReport

_LAZY = {
    "CheckpointManager": "jaxckpt._manager",
    "LeafInfo": "jaxckpt.records._metadata",
    "StepMetadata": "jaxckpt.records._metadata",
    "CheckpointOptions": "jaxckpt._options",
    "LeafMismatch": "jaxckpt.restoring._preflight",
    "ResumeReport": "jaxckpt.restoring._preflight",
    "check_resume": "jaxckpt.restoring._preflight",
    "nnx_step_fn": "jaxckpt.restoring._nnx",
    "LeafView": "jaxckpt.restoring._lazy",
    "diff_steps": "jaxckpt.tools._diff",
    "export_safetensors": "jaxckpt.tools._safetensors",
    "export_orbax": "jaxckpt.tools._orbax_export",
    "import_orbax": "jaxckpt.tools._orbax_import",
    "import_safetensors": "jaxckpt.tools._import",
    "StepView": "jaxckpt.restoring._lazy",
    "open_step": "jaxckpt.restoring._lazy",
    "SaveStats": "jaxckpt.saving._telemetry",
    "Problem": "jaxckpt.tools._verify",
    "VerifyReport": "jaxckpt.tools._verify",
    "ObjectStoreOptions": "jaxckpt.storage",
    "Report": "jaxckpt.ledger",
    "report": "jaxckpt.ledger",
}


def __getattr__(name: str) -> Any:
    if name == "policy":
        return importlib.import_module("jaxckpt.policy")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointOptions",
    "CorruptCheckpointError",
    "LeafInfo",
    "LeafMismatch",
    "LeafView",
    "LocalRootInUseError",
    "NotACheckpointRootError",
    "ObjectStoreOptions",
    "PeerAuthError",
    "PeerError",
    "PlacementError",
    "Problem",
    "PromotionError",
    "PromotionTimeoutError",
    "Report",
    "ResumeReport",
    "SaveFailedError",
    "SaveStats",
    "SaveTimeoutError",
    "StepAlreadyExistsError",
    "StepMetadata",
    "StepNotFoundError",
    "StepView",
    "StorageError",
    "TreeMismatchError",
    "UncommittedStepError",
    "UnsupportedFormatError",
    "UnsupportedLeafError",
    "VerifyReport",
    "WriterFencedError",
    "check_resume",
    "diff_steps",
    "export_orbax",
    "export_safetensors",
    "import_orbax",
    "import_safetensors",
    "nnx_step_fn",
    "open_step",
    "policy",
    "report",
]
