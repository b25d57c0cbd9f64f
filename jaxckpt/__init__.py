"""jaxckpt: crash-safe, asynchronous, checksummed zarr checkpoints for JAX.

>>> import jaxckpt
>>> sorted(n for n in jaxckpt.__all__ if n.endswith("Error"))[:3]
['CheckpointError', 'CorruptCheckpointError', 'NotACheckpointRootError']
"""

from __future__ import annotations

from jaxckpt._manager import CheckpointManager as CheckpointManager
from jaxckpt._manager import LeafInfo as LeafInfo
from jaxckpt._manager import StepMetadata as StepMetadata
from jaxckpt._options import CheckpointOptions as CheckpointOptions
from jaxckpt._telemetry import SaveStats as SaveStats
from jaxckpt._verify import Problem as Problem
from jaxckpt._verify import VerifyReport as VerifyReport
from jaxckpt.errors import CheckpointError as CheckpointError
from jaxckpt.errors import CorruptCheckpointError as CorruptCheckpointError
from jaxckpt.errors import NotACheckpointRootError as NotACheckpointRootError
from jaxckpt.errors import SaveFailedError as SaveFailedError
from jaxckpt.errors import SaveTimeoutError as SaveTimeoutError
from jaxckpt.errors import StepAlreadyExistsError as StepAlreadyExistsError
from jaxckpt.errors import StepNotFoundError as StepNotFoundError
from jaxckpt.errors import StorageError as StorageError
from jaxckpt.errors import TreeMismatchError as TreeMismatchError
from jaxckpt.errors import UncommittedStepError as UncommittedStepError
from jaxckpt.errors import UnsupportedFormatError as UnsupportedFormatError
from jaxckpt.errors import UnsupportedLeafError as UnsupportedLeafError

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointOptions",
    "CorruptCheckpointError",
    "LeafInfo",
    "NotACheckpointRootError",
    "Problem",
    "SaveFailedError",
    "SaveStats",
    "SaveTimeoutError",
    "StepAlreadyExistsError",
    "StepMetadata",
    "StepNotFoundError",
    "StorageError",
    "TreeMismatchError",
    "UncommittedStepError",
    "UnsupportedFormatError",
    "UnsupportedLeafError",
    "VerifyReport",
]
