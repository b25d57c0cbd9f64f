"""Promotion, retention, archiving and publishing of committed steps: the promoter that
makes local steps durable, the retention pass that deletes what the policy no longer keeps,
the archive copy of chosen durable steps, and the publisher of weights as safetensors.

Other packages import from this face only; the ``_modules`` are this package's own
(and its unit tests').
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxckpt._lazy import lazy_names
from jaxckpt.lifecycle._archive import archive_once as archive_once
from jaxckpt.lifecycle._keep import retention_decision as retention_decision
from jaxckpt.lifecycle._promoter import Promoter as Promoter

if TYPE_CHECKING:
    from jaxckpt.lifecycle._promotion import open_promotion as open_promotion
    from jaxckpt.lifecycle._publish import Publisher as Publisher
    from jaxckpt.lifecycle._publish import PublishResult as PublishResult
    from jaxckpt.lifecycle._publish import open_publisher as open_publisher
    from jaxckpt.lifecycle._retention import Retention as Retention

# Names whose modules import jax or TensorStore load on first use, so that
# the light modules of this package (and ``jaxckpt ls``) stay free of them.
_LAZY = {
    "open_promotion": "jaxckpt.lifecycle._promotion",
    "Retention": "jaxckpt.lifecycle._retention",
    "Publisher": "jaxckpt.lifecycle._publish",
    "PublishResult": "jaxckpt.lifecycle._publish",
    "open_publisher": "jaxckpt.lifecycle._publish",
}


__getattr__ = lazy_names(__name__, _LAZY, globals())


__all__ = [
    "Promoter",
    "PublishResult",
    "Publisher",
    "Retention",
    "archive_once",
    "open_promotion",
    "open_publisher",
    "retention_decision",
]
