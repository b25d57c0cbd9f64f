"""The save session: owns the in-flight save and implements the handler's ``StepWriter``.

The Orbax handler calls :meth:`SaveSession.begin` (primary host, blocking
part), :meth:`SaveSession.write` (every host, background thread) and
:meth:`SaveSession.commit` (primary host, after the barrier). On a local tier
(``per_host``) every host is the writer of its own local root: ``write``
begins, writes and commits the host's own part there (after writing the
step's promotion request, if it is to be promoted), and ``commit`` only ends
the session. The session
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
from jaxckpt._layout import StepLocation, held_manifest_name
from jaxckpt._pack import PackWriter
from jaxckpt._phases import reached, watched
from jaxckpt._promote import PromotionRequest, request_promotion, withdraw
from jaxckpt._records import ChunkRecord, CommitMarker, ManifestPart
from jaxckpt._telemetry import SaveRecorder
from jaxckpt._tree import SavedLeaf
from jaxckpt._tsio import ArrayWriter, HostArray, chunk_key, chunks_of
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
    request: PromotionRequest | None = None
    """Local tier: the promotion request, written before the local marker."""
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
        per_host: bool = False,
    ) -> None:
        self._protocol = protocol
        self._arrays = arrays
        self._recorder = recorder
        self._primary = primary
        self._on_commit = on_commit
        self._packer = packer  # None: the plain layout
        self._per_host = per_host
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
            if self._per_host or (self._primary and jax.process_count() == 1):
                with contextlib.suppress(Exception):  # leftovers are collected anyway
                    removed = self._protocol.abandon(inflight.loc)  # kept if committed here
                    # A failed save is never promoted; on several hosts also when this
                    # host committed its part (another host's part may never come).
                    several = jax.process_count() > 1
                    if (removed or several) and inflight.request is not None:
                        withdraw(self._protocol, inflight.step)
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
        if self._per_host and not self._primary:
            self._protocol.begin_save(loc)  # this host's own local root
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
        records, held = _split_held(records, arrays)

        def manifest_part(records: dict[str, tuple[ChunkRecord, ...]]) -> ManifestPart:
            return ManifestPart(
                step=step,
                process=jax.process_index(),
                num_processes=jax.process_count(),
                arrays=records,
                layout=layout,
                packs=packs,
                plain_codecs=layout == "plain",  # ArrayWriter's chain: zarr_metadata()
            )

        extra = []
        if held:  # a local tier's replicas of other hosts' shards, for this host's restores
            name = held_manifest_name(jax.process_index())
            self._protocol.write_manifest_part(loc, manifest_part(held), name=name)
            extra.append(name)
        part = manifest_part(records)
        self._protocol.write_manifest_part(loc, part)
        reached("manifest_written", step)
        inflight.nbytes = part.nbytes
        if self._per_host:
            self._commit_local(inflight, extra)

    def _commit_local(self, inflight: Inflight, extra: Sequence[str]) -> None:
        """Commits this host's part on its own local root; the promotion request first."""
        if inflight.request is not None:
            request_promotion(self._protocol, inflight.request)
            reached("promotion_requested", inflight.step)
        marker = self._protocol.commit(
            inflight.loc,
            num_processes=jax.process_count(),
            metrics=inflight.metrics,
            keep=inflight.keep,
            processes=[jax.process_index()],
            extra=extra,
        )
        self._recorder.committed(inflight.step, inflight.nbytes)
        self._on_commit(marker)

    def _write_records(self, inflight: Inflight) -> None:
        if self._primary or self._per_host:
            self._arrays.write_group(inflight.loc)
            self._protocol.write_tree(inflight.loc, inflight.tree)

    def commit(self, step: int) -> None:
        inflight = self._expect(step)
        if self._per_host:  # committed in write(); Orbax's barrier passed: every host has
            with self._lock:
                self._inflight = None
            return
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


def _split_held(
    records: dict[str, tuple[ChunkRecord, ...]], arrays: Sequence[HostArray]
) -> tuple[dict[str, tuple[ChunkRecord, ...]], dict[str, tuple[ChunkRecord, ...]]]:
    """Splits chunk records into this host's own (``replica_id == 0``) and ``held`` ones."""
    held_keys: dict[str, set[str]] = {}
    for host in arrays:
        if host.held and host.leaf.name is not None:
            shape = host.leaf.chunk_shape
            held_keys[host.leaf.name] = {
                chunk_key(c, shape) for region in host.held for c in chunks_of(region, shape)
            }
    if not held_keys:
        return records, {}
    own: dict[str, tuple[ChunkRecord, ...]] = {}
    held: dict[str, tuple[ChunkRecord, ...]] = {}
    for name, chunks in records.items():
        keys = held_keys.get(name, set())
        own[name] = tuple(c for c in chunks if c.key not in keys)
        if mine := tuple(c for c in chunks if c.key in keys):
            held[name] = mine
    return own, held
