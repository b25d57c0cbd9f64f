"""The promotion of a manager without a local tier (see :mod:`jaxckpt.lifecycle._promotion`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxckpt.errors import CheckpointError

if TYPE_CHECKING:
    from jaxckpt.records import PromotionRequest, PromotionResult
    from jaxckpt.saving import SaveRecorder

__all__ = ["NoPromotion"]


class NoPromotion:
    """The promotion of a manager without a local tier: nothing is ever requested."""

    on_result: Callable[[PromotionResult], None] | None = None  # never called: nothing promotes

    def __init__(self, root: str) -> None:
        self._root = root

    def request(self, step: int) -> PromotionRequest | None:
        return None

    def committed(self, marker: object = None) -> None:
        return None

    def pending_steps(self) -> set[int]:
        return set()

    def kept_waiting(self, full: int | None = None) -> set[int]:
        return set()

    def withdraw(self, step: int) -> None:
        return None

    def record_durable(self, recorder: SaveRecorder) -> None:
        return None

    def start(self, on_promoted: Callable[[], None]) -> None:
        return None

    def wait_durable(self, step: int | None, timeout_s: float) -> int | None:
        raise CheckpointError(f"the manager of {self._root} has no local tier (local_root)")

    def check_lost(self) -> None:
        return None

    def lost_error(self) -> None:
        return None

    def close(self, timeout_s: float) -> None:
        return None
