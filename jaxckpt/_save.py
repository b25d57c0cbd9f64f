"""The save session: owns the in-flight save and implements the handler's ``StepWriter``.

The Orbax handler calls :meth:`SaveSession.begin` (primary host, blocking
part), :meth:`SaveSession.write` (every host, background thread) and
:meth:`SaveSession.commit` (primary host, after the barrier). The session
knows the attempt's :class:`~jaxckpt._layout.StepLocation`, so every key of
the save comes from one place, and the manager never shares its private state.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax

from jaxckpt._commit import CommitProtocol, Listing
from jaxckpt._layout import StepLocation
from jaxckpt._pack import PackWriter
from jaxckpt._phases import reached, watched
from jaxckpt._records import CommitMarker, ManifestPart
from jaxckpt._telemetry import SaveRecorder
from jaxckpt._tree import SavedLeaf
from jaxckpt._tsio import ArrayWriter, HostArray
from jaxckpt.errors import CheckpointError

log = logging.getLogger("jaxckpt")


@dataclass
class Inflight:
    """The one save in flight: where it goes and what its marker will carry."""

    loc: StepLocation
    tree: bytes
    metrics: dict[str, float] | None
    keep: bool
    nbytes: int = 0
    listing: Listing | None = None
    """The root's listing taken by ``save`` (its begin phase checks against it)."""

    @property
    def step(self) -> int:
        return self.loc.step


class SaveSession:
    """The in-flight save of one manager, shared with the Orbax handler."""

    def __init__(
        self,
        protocol: CommitProtocol,
        arrays: ArrayWriter,
        recorder: SaveRecorder,
        *,
        primary: bool,
        on_commit: Callable[[CommitMarker], None],
        packer: PackWriter | None = None,
    ) -> None:
        self._protocol = protocol
        self._arrays = arrays
        self._recorder = recorder
        self._primary = primary
        self._on_commit = on_commit
        self._packer = packer  # None: the plain layout
        self._lock = threading.Lock()
        self._inflight: Inflight | None = None

    def start(self, inflight: Inflight) -> None:
        with self._lock:
            if self._inflight is not None:
                raise CheckpointError(
                    f"{self._inflight.loc} is still in flight; wait() before the next save"
                )
            self._inflight = inflight
        self._recorder.started(inflight.step)

    def current(self) -> Inflight | None:
        with self._lock:
            return self._inflight

    def end(self, *, failed: bool) -> Inflight | None:
        """Forgets the in-flight save; a failed attempt of a single process is removed."""
        with self._lock:
            inflight, self._inflight = self._inflight, None
        if inflight is not None and failed:
            self._recorder.failed(inflight.step)
            if self._primary and jax.process_count() == 1:
                with contextlib.suppress(Exception):  # leftovers are collected anyway
                    self._protocol.abandon(inflight.loc)
        return inflight

    def _expect(self, step: int) -> Inflight:
        inflight = self.current()
        if inflight is None or inflight.step != step:
            raise CheckpointError(f"no save of step {step} is in flight under {self._where}")
        return inflight

    @property
    def _where(self) -> str:
        return self._protocol.storage.uri

    # -- StepWriter ----------------------------------------------------------

    def begin(self, step: int) -> None:
        inflight = self._expect(step)
        self._protocol.begin_save(inflight.loc, inflight.listing)

    def write(self, step: int, leaves: Sequence[SavedLeaf], arrays: Sequence[HostArray]) -> None:
        inflight = self._expect(step)
        loc = inflight.loc
        # The primary's small records go out beside the chunks (a round trip
        # less), unless a crash test watches the phases: then first, so that
        # the tree record is durable at data_started as documented.
        ordered = watched()
        if ordered:
            self._write_records(inflight)
        with ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-records") as pool:
            records_written = None if ordered else pool.submit(self._write_records, inflight)
            packs: dict[str, int] = {}
            if self._packer is None:
                records, layout = self._arrays.write(loc, arrays), "plain"
            else:
                records, packs = self._packer.write(loc, arrays)
                layout = "packed"
            if records_written is not None:
                records_written.result()
        part = ManifestPart(
            step=step,
            process=jax.process_index(),
            num_processes=jax.process_count(),
            arrays=records,
            layout=layout,
            packs=packs,
        )
        self._protocol.write_manifest_part(loc, part)
        reached("manifest_written", step)
        inflight.nbytes = part.nbytes

    def _write_records(self, inflight: Inflight) -> None:
        if self._primary:
            self._arrays.write_group(inflight.loc)
            self._protocol.write_tree(inflight.loc, inflight.tree)

    def commit(self, step: int) -> None:
        inflight = self._expect(step)
        marker = self._protocol.commit(
            inflight.loc,
            num_processes=jax.process_count(),
            metrics=inflight.metrics,
            keep=inflight.keep,
        )
        self._recorder.committed(step, inflight.nbytes)
        with self._lock:
            self._inflight = None
        self._on_commit(marker)
