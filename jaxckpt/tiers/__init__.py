"""Tiers and peers: the roots a manager saves to (shared or per-host local), where each
save commits, and the peer replicas of local tiers.

Other packages import from this face only; the ``_modules`` are this package's own
(and its unit tests').
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxckpt._lazy import lazy_names
from jaxckpt.tiers._placement import heal_target as heal_target

if TYPE_CHECKING:
    from jaxckpt.tiers._open import join_tiers as join_tiers
    from jaxckpt.tiers._open import open_tier as open_tier
    from jaxckpt.tiers._open import open_tiers as open_tiers
    from jaxckpt.tiers._tier import Tier as Tier
    from jaxckpt.tiers._tier import reading_tier as reading_tier

# Names whose modules import jax or TensorStore load on first use, so that
# the light modules of this package (and ``jaxckpt ls``) stay free of them.
_LAZY = {
    "open_tier": "jaxckpt.tiers._open",
    "join_tiers": "jaxckpt.tiers._open",
    "open_tiers": "jaxckpt.tiers._open",
    "Tier": "jaxckpt.tiers._tier",
    "reading_tier": "jaxckpt.tiers._tier",
}


__getattr__ = lazy_names(__name__, _LAZY, globals())


__all__ = [
    "Tier",
    "heal_target",
    "join_tiers",
    "open_tier",
    "open_tiers",
    "reading_tier",
]
