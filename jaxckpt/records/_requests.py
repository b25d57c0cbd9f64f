"""Promotion requests and results: what a local save asks a promoter to make durable
(``promote/<step>.json`` in the local root, written before the local marker), and
what one pass of the promoter did with each requested step.

See :mod:`jaxckpt.lifecycle._promoter` for the promotion itself. Imports no jax.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from jaxckpt.errors import CheckpointError, CorruptCheckpointError
from jaxckpt.records._keys import (
    PROMOTE,
    parse_attempt,
    parse_promote_key,
    parse_receipt_key,
    promote_key,
    receipt_key,
)
from jaxckpt.records._step import json_record, load_json_record

if TYPE_CHECKING:
    from jaxckpt.commit import CommitProtocol

log = logging.getLogger("jaxckpt")

PROMOTED = "promoted"
ALREADY_DURABLE = "already durable"
GONE = "not committed locally"
WAITING = "local save under way"
UPLOADED = "part uploaded"
PARTS_WAITING = "waiting for other hosts' parts"
SUPERSEDED = "superseded by a newer durable step"
FENCED = "fenced"
FAILED = "failed"
ARCHIVED = "archived"

MAX_RECEIPTS = 8
"""Receipts a promoter keeps (the newest steps'): a trainer awaits one or two steps."""

UNSTAMPED = 0
"""The epoch of a request written before its job learned the durable root's writer epoch
(epochs start at 1; the durable root was in an outage when the job opened): no
promoter copies it until the job stamps it with the epoch."""


@dataclass(frozen=True, kw_only=True)
class PromotionRequest:
    """A local tier's request to make ``step`` durable (``promote/<step>.json``).

    Written by the trainer *before* the step's local commit marker, so a
    trainer killed right after its local commit still leaves the request; a
    request whose step has no local marker waits while the local save is
    under way and is dropped once nothing of it is left.

    Attributes:
      step: the step committed on the local tier.
      epoch: the durable root's writer epoch of the job that asked; the copy is
        committed in that epoch (:data:`UNSTAMPED`: not known yet, left alone).
      requested: wall-clock time the request was written.
      saved: wall-clock time the save of the step started (for time-to-durable).
      attempt: multi-host: the durable attempt every host uploads its part
        into (agreed at the save); None: a fresh attempt at promotion time.
      process: multi-host: the process whose local tier this is (its manifest part).
      processes: how many processes saved the step (1: single-host).
      primary: the process whose promoter writes the tree record and commits.
    """

    step: int
    epoch: int
    requested: float
    saved: float | None = None
    attempt: str | None = None
    process: int = 0
    processes: int = 1
    primary: int = 0

    def to_bytes(self) -> bytes:
        fields: dict[str, object] = {
            "step": self.step,
            "epoch": self.epoch,
            "requested": self.requested,
            "saved": self.saved,
        }
        if self.processes > 1:
            fields.update(
                attempt=self.attempt,
                process=self.process,
                processes=self.processes,
                primary=self.primary,
            )
        return json_record(**fields)

    def restamped(self, epoch: int, now: float) -> PromotionRequest:
        """This request taken over by the job of ``epoch``; its attempt id is derived
        from the old one (the same on every host, without talking to them)."""
        attempt = self.attempt
        if attempt is not None:
            attempt = f"e{epoch}-" + attempt.split("-", 1)[1]
        return replace(self, epoch=epoch, requested=now, attempt=attempt)

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> PromotionRequest:
        obj = load_json_record(data, where)
        try:
            saved = obj.get("saved")
            attempt = obj.get("attempt")
            request = cls(
                step=int(obj["step"]),
                epoch=int(obj["epoch"]),
                requested=float(obj["requested"]),
                saved=None if saved is None else float(saved),
                attempt=None if attempt is None else str(attempt),
                process=int(obj.get("process", 0)),
                processes=int(obj.get("processes", 1)),
                primary=int(obj.get("primary", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"invalid promotion request {where}: {e}") from e
        if request.processes > 1 and (
            request.attempt is None or parse_attempt(request.attempt) is None
        ):
            raise CorruptCheckpointError(f"invalid promotion request {where}: no valid attempt")
        return request


@dataclass(frozen=True, kw_only=True)
class PromotionResult:
    """What one pass did with one requested step.

    Attributes:
      step: the step.
      outcome: ``promoted``, ``already durable``, ``not committed locally``
        (the request is dropped), ``local save under way`` (kept), ``part
        uploaded`` (multi-host, not the primary: the primary's promoter
        commits), ``fenced`` (the job's epoch was fenced: nothing written),
        ``failed``, or ``archived`` (:func:`archive_once`).
      nbytes: chunk bytes copied.
      seconds: time spent on the step.
      durable_time: wall-clock time of the durable commit (``promoted`` only).
      request: the request that asked for it.
      error: why it failed or was fenced.
    """

    step: int
    outcome: str
    nbytes: int = 0
    seconds: float = 0.0
    durable_time: float | None = None
    request: PromotionRequest | None = None
    error: str | None = None


def request_promotion(local: CommitProtocol, request: PromotionRequest) -> None:
    """Writes (or re-stamps) the promotion request of ``request.step`` into the local root;
    a receipt of an earlier promotion of that step (an earlier run's) goes first, so that
    a receipt answers only a request written before it."""
    local.storage.delete(receipt_key(request.step))
    local.storage.write(promote_key(request.step), request.to_bytes())


def read_requests(
    local: CommitProtocol, *, receipts: set[int] | None = None
) -> dict[int, PromotionRequest]:
    """Every readable promotion request of a local root, by step (an invalid one is logged).

    ``receipts``: filled with the steps a promoter's receipt says are durable (from the
    same listing: :func:`withdraw_durable`).
    """
    requests: dict[int, PromotionRequest] = {}
    for key in local.storage.list(PROMOTE):
        step = parse_promote_key(key)
        if step is None:
            done = parse_receipt_key(key)
            if receipts is not None and done is not None:
                receipts.add(done)
            continue
        data = local.storage.read(key)
        if data is None:
            continue  # removed since the listing: promoted meanwhile
        try:
            requests[step] = PromotionRequest.from_bytes(data, local.where(key))
        except CheckpointError as e:
            log.warning("%s", e)
    return dict(sorted(requests.items()))


def withdraw(local: CommitProtocol, step: int) -> None:
    """Removes the promotion request of ``step`` (done, or can never succeed)."""
    local.storage.delete(promote_key(step))


def withdraw_durable(local: CommitProtocol, step: int) -> None:
    """Withdraws the request of ``step``, which is durable, leaving a receipt that says
    so: the trainer that asked learns it from its local root, not from the durable one.
    The receipt goes first: a request seen gone has its receipt (unless pruned)."""
    local.storage.write(receipt_key(step), b"")
    withdraw(local, step)


def prune_receipts(local: CommitProtocol, receipts: set[int]) -> None:
    """Deletes all but the newest :data:`MAX_RECEIPTS` of ``receipts`` (listed ones)."""
    for step in sorted(receipts)[:-MAX_RECEIPTS]:
        local.storage.delete(receipt_key(step))
