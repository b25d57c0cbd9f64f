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

from jaxckpt._lazy import lazy_names
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
    from jaxckpt._options import PublishOptions as PublishOptions
    from jaxckpt.ledger import Report, report
    from jaxckpt.restoring import (
        LeafInfo,
        LeafMismatch,
        LeafView,
        ResumeReport,
        StepMetadata,
        StepView,
        nnx_step_fn,
        open_step,
    )
    from jaxckpt.saving import SaveStats
    from jaxckpt.storage import ObjectStoreOptions as ObjectStoreOptions
    from jaxckpt.tools import Problem, VerifyReport, diff_steps, export_safetensors
    from jaxckpt.workflows import check_resume, export_orbax, import_orbax, import_safetensors

_LAZY = {
    "CheckpointManager": "jaxckpt._manager",
    "LeafInfo": "jaxckpt.restoring",
    "StepMetadata": "jaxckpt.restoring",
    "CheckpointOptions": "jaxckpt._options",
    "PublishOptions": "jaxckpt._options",
    "LeafMismatch": "jaxckpt.restoring",
    "ResumeReport": "jaxckpt.restoring",
    "check_resume": "jaxckpt.workflows",
    "nnx_step_fn": "jaxckpt.restoring",
    "LeafView": "jaxckpt.restoring",
    "diff_steps": "jaxckpt.tools",
    "export_safetensors": "jaxckpt.tools",
    "export_orbax": "jaxckpt.workflows",
    "import_orbax": "jaxckpt.workflows",
    "import_safetensors": "jaxckpt.workflows",
    "StepView": "jaxckpt.restoring",
    "open_step": "jaxckpt.restoring",
    "SaveStats": "jaxckpt.saving",
    "Problem": "jaxckpt.tools",
    "VerifyReport": "jaxckpt.tools",
    "ObjectStoreOptions": "jaxckpt.storage",
    "Report": "jaxckpt.ledger",
    "report": "jaxckpt.ledger",
}


_lazy = lazy_names(__name__, _LAZY, globals())


def __getattr__(name: str) -> Any:
    if name == "policy":
        return importlib.import_module("jaxckpt.policy")
    return _lazy(name)


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
    "PublishOptions",
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
