"""The writing of one step: its records, manifest parts and (agreed) commit.

:class:`SaveSession` (:mod:`jaxckpt.saving._session`) keeps the session's state (the
checkpointer, failures, fencing, agreement); for each save's background part
it makes one :class:`StepWrite`, which writes this process's part through the
format's :class:`~jaxckpt.formats.StepWriter`, its manifest part and, on the
primary or a local tier, the tree record, then commits: the primary of a
shared tier commits every part, each host of its own (local) tier commits its
own part there after the step's promotion request.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import jax

from jaxckpt import _pools
from jaxckpt._options import CheckpointOptions
from jaxckpt.commit import Agreement, CommitProtocol, Listing, reached, watched
from jaxckpt.errors import CheckpointError, SaveTimeoutError, StepAlreadyExistsError
from jaxckpt.formats import ArrayWriter, HostArray, StepWriter
from jaxckpt.records import (
    TREE_FILE,
    ChunkRecord,
    CommitMarker,
    ManifestPart,
    PartSummary,
    PromotionRequest,
    StepLocation,
    describe_state,
    held_manifest_name,
    manifest_name,
    new_attempt,
    request_promotion,
)
from jaxckpt.saving._helpers import (
    check_object_bound,
    listing_and_announce,
    replace_corrupt,
    split_held,
    tree_record,
)
from jaxckpt.saving._telemetry import SaveRecorder
from jaxckpt.tiers import Tier


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
    announced: bool = False
    """``save`` wrote the pending record while it took ``listing``."""
    agreement: Agreement | None = None
    """The save's background part agrees through this (None: one process)."""
    written: dict[str, bytes] = field(default_factory=dict)
    """The records this process wrote for the attempt, by name: its commit does not read
    them back."""
    process_state: dict[str, Any] | None = None
    """This process's ``process_state`` record, carried in its manifest part."""
    summary: PartSummary | None = None
    """This process's manifest part as the commit checks it, sent to the primary (which
    does not read the part back)."""
    released: threading.Event = field(default_factory=threading.Event)
    """Set when ``save`` returns (or fails): the background write waits for it."""
    abandoned: bool = False
    """The blocking phase failed: the background write writes nothing."""

    @property
    def step(self) -> int:
        return self.loc.step

    def release(self, *, abandoned: bool = False) -> None:
        """Ends the save's blocking phase: its background write starts (or, when
        ``abandoned``, returns without writing)."""
        self.abandoned = self.abandoned or abandoned
        self.released.set()

    def wait_released(self, timeout_s: float, root: str) -> bool:
        """Waits for :meth:`release`; whether the background write is to write.

        Raises:
          SaveTimeoutError: the blocking phase did not end within ``timeout_s``.
        """
        if not self.released.wait(timeout_s):
            raise SaveTimeoutError(
                f"save of step {self.step} under {root}: its blocking phase did not end "
                f"within save_timeout_s={timeout_s:g}s"
            )
        return not self.abandoned


class StepWrite:
    """The background part of one save on this process (made per save by the session).

    Args:
      tier: the tier the save commits to.
      writer: the data format's writer of the tier.
      options: the manager's options.
      agreement: the save's agreement (every process's outcome of each phase).
      primary: this process is the primary host.
      recorder: the session's save telemetry.
      notify: told each marker this process commits (the session's listeners).
      root: the manager's root, for messages.
    """

    def __init__(
        self,
        tier: Tier,
        writer: StepWriter,
        options: CheckpointOptions,
        agreement: Agreement,
        *,
        primary: bool,
        recorder: SaveRecorder,
        notify: Callable[[CommitMarker], None],
        root: str,
    ) -> None:
        self._tier = tier
        self._protocol: CommitProtocol = tier.protocol
        self._arrays: ArrayWriter = tier.arrays
        self._writer = writer
        self._options = options
        self._agreement = agreement
        self._primary = primary
        self._per_host = tier.own
        self.recorder = recorder
        self._notify = notify
        self._root = root

    def run(self, inflight: Inflight, arrays: Sequence[HostArray]) -> None:
        """Writes this process's part, agrees that every process wrote its own, and
        commits (the primary of a shared tier; each host of its own tier): a process
        that fails makes every process's save fail at once, naming it.

        It starts once ``save`` has returned (:meth:`Inflight.release`): it never competes
        with the blocking phase, and a save whose blocking phase failed writes nothing.
        """
        if not inflight.wait_released(self._options.save_timeout_s, self._root):
            return
        step = inflight.step
        what = f"save of step {step} under {self._root}"
        failure: Exception | None = None
        extra: list[str] = []
        try:
            extra = self._write(inflight, arrays)
        except Exception as e:
            failure = e
        agreement = self._agreement
        # a shared tier's primary commits every part from their summaries (an own tier's
        # host commits its own part: it sends none)
        summary = None
        if inflight.summary is not None and not self._per_host:
            summary = inflight.summary.to_json()
        try:
            summaries = agreement.settle("written", failure, what=what, share=summary)
        except CheckpointError:
            if self._primary and not self._per_host:  # every process is done with it
                with contextlib.suppress(Exception):  # else collected as a stale attempt
                    self._protocol.abandon(inflight.loc)
            raise
        failure = None
        try:
            if self._per_host:  # every host wrote (and replicated) its part: commit it
                self._commit_local(inflight, extra)
            elif self._primary:
                self._commit_shared(inflight, summaries)
        except Exception as e:
            failure = e
        agreement.settle("committed", failure, what=what)

    def _write(self, inflight: Inflight, arrays: Sequence[HostArray]) -> list[str]:
        """Writes this process's part (and replicates it to its peers: a local tier);
        returns the extra files its local marker lists."""
        step, loc = inflight.step, inflight.loc
        # The primary's small records go out beside the chunks, and a packed save's
        # manifest part beside its last packs (a round trip less each), unless a crash
        # test watches the phases: then each in order, so that every phase's
        # post-condition holds when it is announced.
        ordered = watched()
        if ordered:
            self._write_records(inflight)
        with _pools.borrow("records", 2) as pool:
            records_written = None if ordered else pool.submit(self._write_records, inflight)
            manifest: list[Future[tuple[ManifestPart, list[str]]]] = []

            def planned(records: dict[str, tuple[ChunkRecord, ...]], packs: dict[str, int]) -> None:
                manifest.append(pool.submit(self._write_manifest, inflight, arrays, records, packs))

            records, packs = self._writer.write_step(
                loc, arrays, planned=None if ordered else planned
            )
            if records_written is not None:
                records_written.result()
            if manifest:
                part, extra = manifest[0].result()
            else:
                part, extra = self._write_manifest(inflight, arrays, records, packs)
        reached("manifest_written", step)
        inflight.nbytes = part.nbytes
        if self._per_host:
            request = None if inflight.request is None else inflight.request.to_bytes()
            replicas = self._tier.peers
            replicas.replicate(loc, metrics=inflight.metrics, keep=inflight.keep, request=request)
        return extra

    def _write_manifest(
        self,
        inflight: Inflight,
        arrays: Sequence[HostArray],
        records: dict[str, tuple[ChunkRecord, ...]],
        packs: dict[str, int] | None,
    ) -> tuple[ManifestPart, list[str]]:
        """Writes this process's manifest part (``packs`` None: the plain layout) and, on a
        local tier, its held part; returns the part and the extra files the marker lists."""
        loc = inflight.loc
        records, held = split_held(records, arrays)

        def manifest_part(
            records: dict[str, tuple[ChunkRecord, ...]], state: dict[str, Any] | None = None
        ) -> ManifestPart:
            return ManifestPart(
                step=loc.step,
                process=jax.process_index(),
                num_processes=jax.process_count(),
                arrays=records,
                layout=self._options.layout,  # the format this session writes
                packs=packs or {},
                plain_codecs=packs is None,  # ArrayWriter's chain: zarr_metadata()
                process_state=state,
            )

        extra = []
        if held:  # a local tier's replicas of other hosts' shards, for this host's restores
            name = held_manifest_name(jax.process_index())
            inflight.written[name] = self._protocol.write_manifest_part(
                loc, manifest_part(held), name=name
            )
            extra.append(name)
        part = manifest_part(records, inflight.process_state)
        data = self._protocol.write_manifest_part(loc, part)
        inflight.written[manifest_name(part.process)] = data
        inflight.summary = PartSummary.of(data, part, loc)
        return part, extra

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
            written=inflight.written,
        )
        self.recorder.committed(inflight.step, inflight.nbytes)
        self._notify(marker)

    def _write_records(self, inflight: Inflight) -> None:
        if self._primary or self._per_host:
            self._arrays.write_group(inflight.loc)
            self._protocol.write_tree(inflight.loc, inflight.tree)
            inflight.written[TREE_FILE] = inflight.tree

    def _commit_shared(self, inflight: Inflight, summaries: dict[int, Any]) -> None:
        """The primary commits a shared tier's attempt: every part is written (agreed), and
        ``summaries`` holds the other processes' summaries of theirs (by process)."""
        step, me = inflight.step, jax.process_index()
        where = f"save of step {step}: the summary of process"
        marker = self._protocol.commit(
            inflight.loc,
            num_processes=jax.process_count(),
            metrics=inflight.metrics,
            keep=inflight.keep,
            written=inflight.written,
            summaries={
                manifest_name(p): PartSummary.from_json(value, f"{where} {p}")
                for p, value in summaries.items()
                if p != me
            },
        )
        self.recorder.committed(step, inflight.nbytes)
        self._notify(marker)


def prepare_step(
    tier: Tier,
    options: CheckpointOptions,
    step: int,
    state: Any,
    metadata: Any,
    *,
    begins: bool,
    corrupt: set[int],
    root: str,
    ready: Callable[[], Any],
) -> tuple[Any, Any, bytes, StepLocation, Listing | None, bool]:
    """This process's checks and preparation of ``step``'s save, before any collective:
    its leaves and tree record, and, where this process ``begins`` the attempt (the
    primary of a shared tier; every host of its own tier), the step's absence, the
    fence and the pending record. Returns ``(leaves, values, tree, location, listing,
    announced)``; on a shared tier the location's attempt is agreed afterwards.

    Args:
      corrupt: steps a restore found corrupt everywhere (a save replaces one).
      ready: makes the session's checkpointer, once the state is described.

    Raises:
      StepAlreadyExistsError, WriterFencedError, UnsupportedLeafError, CheckpointError.
    """
    protocol: CommitProtocol = tier.protocol
    tier.revive(root)  # an own tier removed under this job is recreated
    leaves, values = describe_state(state, chunk_bytes=options.stored_chunk_bytes)
    check_object_bound(leaves, options.max_object_bytes, step)
    tree = tree_record(step, leaves, metadata, state)
    ready()
    loc = StepLocation(step, new_attempt(protocol.write_epoch()))
    listing, announced = None, False
    if begins:  # only the primary looks at a shared tier
        announce = not tier.own and not watched()
        try:
            listing, announced = listing_and_announce(protocol, loc, announce=announce)
        except StepAlreadyExistsError:
            if not replace_corrupt(protocol, step, corrupt, root):
                raise
            listing, announced = listing_and_announce(protocol, loc, announce=announce)
        try:
            protocol.begin_save(loc, listing, announced=announced)
        except BaseException:
            if announced:
                with contextlib.suppress(Exception):
                    protocol.storage.delete(loc.pending_key)
            raise
        announced = True
    return leaves, values, tree, loc, listing, announced
