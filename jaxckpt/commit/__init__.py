"""The commit-marker protocol: markers, writer epochs, agreement among hosts, garbage collection.

A step becomes visible only once all of its data is durable on every host; nothing here
relies on rename. Imports no jax, so listing tools start fast.

Other packages import from this face only; the ``_modules`` are this package's own
(and its unit tests').
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxckpt._lazy import lazy_names
from jaxckpt.commit._fence import EpochReader as EpochReader
from jaxckpt.commit._fence import Listing as Listing
from jaxckpt.commit._gc import collect as collect
from jaxckpt.commit._gc import is_live as is_live
from jaxckpt.commit._gc import scan as scan
from jaxckpt.commit._objects import list_attempt as list_attempt
from jaxckpt.commit._phases import PHASES as PHASES
from jaxckpt.commit._phases import reached as reached
from jaxckpt.commit._phases import watched as watched
from jaxckpt.commit._protocol import CommitProtocol as CommitProtocol
from jaxckpt.commit._readmodel import CommitReader as CommitReader
from jaxckpt.commit._readmodel import brief as brief
from jaxckpt.commit._tidy import TIDY_S as TIDY_S

if TYPE_CHECKING:
    from jaxckpt.commit._agree import Agreement as Agreement
    from jaxckpt.commit._agree import failure as failure

# Names whose modules import jax or TensorStore load on first use, so that
# the light modules of this package (and ``jaxckpt ls``) stay free of them.
_LAZY = {
    "Agreement": "jaxckpt.commit._agree",
    "failure": "jaxckpt.commit._agree",
}


__getattr__ = lazy_names(__name__, _LAZY, globals())


__all__ = [
    "PHASES",
    "TIDY_S",
    "Agreement",
    "CommitProtocol",
    "CommitReader",
    "EpochReader",
    "Listing",
    "brief",
    "collect",
    "failure",
    "is_live",
    "list_attempt",
    "reached",
    "scan",
    "watched",
]
