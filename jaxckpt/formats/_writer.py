"""What every data format's writer implements (:class:`StepWriter`) and returns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from jaxckpt.records import ChunkRecord, StepLocation


class Written(NamedTuple):
    """What a :class:`StepWriter` wrote for one process and step."""

    records: dict[str, tuple[ChunkRecord, ...]]
    """The chunk records per array name."""
    packs: dict[str, int] | None
    """Every pack object written (name relative to the attempt) and its size; None when
    the format writes no pack objects."""


Planned = Callable[[dict[str, tuple["ChunkRecord", ...]], dict[str, int]], None]
"""Called with the records and pack sizes as soon as they are known, while the last
objects may still be uploading (a writer that cannot tell early never calls it)."""


class StepWriter(Protocol):
    """Writes one process's host arrays of one step in a data format."""

    def write_step(
        self, loc: StepLocation, arrays: Sequence[Any], *, planned: Planned | None = None
    ) -> Written:
        """Writes every chunk of ``arrays`` (``_tsio.HostArray``) under ``loc``; returns what was
        written."""
        ...
