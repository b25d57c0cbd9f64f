"""A checkpoint manager that saves nothing and finds nothing (``--nocheckpoint_enabled``).

A training script written against :class:`jaxckpt.CheckpointManager` runs unchanged
with checkpointing switched off: ``save`` declines (False), ``latest_step`` is None,
``steps`` is empty, ``restore`` raises :class:`jaxckpt.StepNotFoundError` (as on an
empty root) and the waits return at once. Nothing is opened or written, and no signal
handler is installed.
"""

from __future__ import annotations

from typing import Any

from jaxckpt._manager import CheckpointManager
from jaxckpt._options import CheckpointOptions
from jaxckpt.errors import StepNotFoundError
from jaxckpt.records import RestoredStates

DISABLED = "(checkpointing disabled)"


class DisabledCheckpointManager(CheckpointManager):
    """Every public method of :class:`CheckpointManager`, doing nothing and finding nothing.

    Args:
      root: the root the flags named, if any (only shown, never opened).
      options: kept as ``options`` (never used).
    """

    def __init__(self, root: str | None = None, options: CheckpointOptions | None = None) -> None:
        self.options = options or CheckpointOptions()
        self._shown = root or DISABLED
        self._restored_states = RestoredStates()

    def __repr__(self) -> str:
        return f"DisabledCheckpointManager({self._shown!r})"

    @property
    def root(self) -> str:
        return self._shown

    @property
    def local_root(self) -> str | None:
        return None

    @property
    def epoch(self) -> int | None:
        return None

    def compile(self, lowered: Any) -> Any:
        return lowered.compile()  # nothing kept

    def save(self, step: int, state: Any, **kwargs: Any) -> bool:
        return False

    def preempted(self, step: int = 0) -> bool:
        return False

    def wait(self) -> None:
        return None

    @property
    def failed_saves(self) -> int:
        return 0

    def save_stats(self) -> list[Any]:
        return []

    def wait_durable(self, step: int | None = None, timeout_s: float | None = None) -> int | None:
        return None

    def steps(self, tier: str | None = None) -> list[int]:
        return []

    def latest_step(self) -> int | None:
        return None

    def latest_good_step(self) -> int | None:
        return None

    def mark(self, step: int, *, good: bool, reason: str = "") -> None:
        raise _missing(step)

    def rollback(self, target: Any = None, **kwargs: Any) -> Any:
        raise _missing(None)

    def restore(self, step: int | None = None, **kwargs: Any) -> Any:
        raise _missing(step)

    def process_states(self, step: int) -> list[Any]:
        raise _missing(step)

    def metadata(self, step: int) -> Any:
        raise _missing(step)

    def verify(self, step: int, **kwargs: Any) -> Any:
        raise _missing(step)

    def explain(self) -> dict[int, tuple[str, ...]]:
        return {}

    def wait_for_deletions(self, timeout_s: float | None = None) -> None:
        return None

    def delete(self, step: int) -> None:
        raise _missing(step)

    def garbage_collect(self, **kwargs: Any) -> list[int]:
        return []

    def close(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        return None


def _missing(step: int | None) -> StepNotFoundError:
    which = "no committed steps" if step is None else f"no step {step}"
    return StepNotFoundError(f"{which}: checkpointing is disabled (--nocheckpoint_enabled)")
