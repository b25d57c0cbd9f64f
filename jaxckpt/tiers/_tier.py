"""A tier: one root a manager saves to or restores from, with everything that reads and writes it.

A tier bundles a root's storage, its commit protocol, the TensorStore
context, the array writer, the step reader and the retention rule that
applies there. A plain manager holds one tier (``"durable"``, the job's shared
root); a tiered manager holds two, nearest first: ``"local"`` (each host's own
root) and ``"durable"``. Everything else (the save session, the restore
selection, retention, promotion) works on tiers and never builds this bundle
itself; :func:`~jaxckpt.tiers._open.open_tier` is the one place that does.

A tier is one of two kinds (:data:`~jaxckpt.tiers._open.KINDS`), chosen once when it
is opened, each a class of :mod:`jaxckpt.tiers._kinds`: an ``OwnTier`` (each host is
the only writer of its own root and lists it itself; its copies on other nodes are its
``peers``) or a ``SharedTier`` (one root for the whole job: the primary takes its
epoch and lists it for everyone). Both answer the :class:`Tier` Protocol, and what
differs between them is behaviour of the kind (who takes the epoch, who prunes, which
steps a host may read, which checks a root must pass, where a save commits), not a
branch on the kind; a new kind is one more class there and its entry in ``KINDS``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar, Protocol

import tensorstore as ts

from jaxckpt import policy
from jaxckpt._options import CheckpointOptions
from jaxckpt.commit import Agreement, CommitProtocol
from jaxckpt.formats import ArrayWriter
from jaxckpt.records import CommitMarker, MarkerRef
from jaxckpt.storage import Storage
from jaxckpt.tiers._commitpoint import CommitPoint
from jaxckpt.tiers._kinds import SharedTier
from jaxckpt.tiers._peers import Replicas

Listed = Callable[["Tier"], dict[int, MarkerRef]]
"""A tier's visible steps with their marker keys (a listing, or each tier's newest marker)."""


class Tier(Protocol):
    """One root and its storage → protocol → context → writer → reader bundle.

    What both kinds do alike is documented on ``_Root``; what differs, on
    :class:`~jaxckpt.tiers._kinds.OwnTier` and :class:`~jaxckpt.tiers._kinds.SharedTier`
    (:mod:`jaxckpt.tiers._kinds`).
    """

    name: ClassVar[str]
    """``"local"`` or ``"durable"``: the kind's name, in logs and agreement keys."""
    own: ClassVar[bool]
    """Each host writes and lists a root of its own (else the primary does, for the job)."""
    commit_point: ClassVar[CommitPoint]
    """Where a save of this tier commits: on every host, or once for the job."""
    storage: Storage
    protocol: CommitProtocol
    context: ts.Context
    arrays: ArrayWriter
    reads_in_flight: int
    """How many chunk reads a restore from this tier keeps in flight."""
    retention: policy.RetentionPolicy | None
    peers: Replicas
    """Where this tier's parts are replicated, and the replicas it holds for others."""

    @property
    def uri(self) -> str: ...

    def committed(self) -> dict[int, CommitMarker]: ...
    def visible(self) -> list[int]: ...
    def refs(self) -> dict[int, MarkerRef]: ...
    def marker(self, step: int, ref: MarkerRef | None = None) -> CommitMarker: ...
    def latest(self) -> CommitMarker | None: ...
    def holds(self, step: int) -> bool: ...
    def everywhere(self, agreement: Agreement, steps: Iterable[int]) -> set[int]: ...
    def newest(self, agreement: Agreement, *, primary: bool, wait: bool = True) -> int | None: ...
    def readable(
        self, agreement: Agreement, listed: Listed, *, primary: bool, wait: bool = True
    ) -> tuple[dict[int, MarkerRef | None], set[int]]: ...
    def ensure(self, *, create: bool) -> None: ...
    def open_read_only(self, serves: str) -> None: ...
    def refusal(self, durable: str) -> str | None: ...
    def take_epoch(
        self,
        agreement: Agreement,
        *,
        primary: bool,
        gc_grace_s: float | None,
        serves: str | None = None,
        wait_s: float | None = None,
    ) -> int | None: ...
    def revive(self, serves: str | None) -> bool: ...
    def check_served(self, agreement: Agreement, durable: str) -> None: ...
    def check_alone(self, agreement: Agreement) -> None: ...
    def prunes(self, *, primary: bool) -> bool: ...
    def collect(self, grace_s: float, commit_keys: list[str] | None = None) -> None: ...
    def garbage_collect(self, grace_s: float, *, force: bool = False) -> list[int]: ...
    def delete(self, step: int) -> None: ...

    deferred: bool
    """The open went on without this root's writer epoch (see ``tiers._durablejoin``)."""

    def answers(self) -> bool: ...
    def learned(self) -> int | None: ...
    def catch_up(self, agreement: Agreement, *, closing: bool = False) -> None: ...
    def adopt(self, epoch: int) -> None: ...
    def on_adopt(self, told: Callable[[int], None]) -> None: ...
    def stop_joining(self) -> None: ...
    def begin_join(self, *, gc_grace_s: float | None) -> None: ...


def reading_tier(storage: Storage) -> Tier:
    """``storage`` as a tier to read outside a manager (``open_step``, the CLI)."""
    return SharedTier(storage, CheckpointOptions())
