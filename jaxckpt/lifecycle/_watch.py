"""The promoter's loop: passes of :meth:`Promoter.promote_once` until told to stop."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxckpt.errors import CheckpointError
from jaxckpt.records import PARTS_WAITING, PROMOTE, PROMOTED, PromotionResult, parse_promote_key

if TYPE_CHECKING:
    from jaxckpt.lifecycle._promoter import Promoter

log = logging.getLogger("jaxckpt")

PARTS_POLL_S = 0.2
"""How soon the next pass looks again while the primary's step waits for other parts."""
REQUEST_POLL_S = 0.1
"""How often a sidecar between passes lists its local tier's requests (one local listing):
a new one starts the next pass at once, so a step is not left waiting for the interval."""


def watch(
    promoter: Promoter,
    stop: threading.Event,
    *,
    interval_s: float = 5.0,
    wake: threading.Event | None = None,
    on_pass: Callable[[list[PromotionResult]], None] | None = None,
) -> None:
    """Runs ``promoter``'s :meth:`~Promoter.promote_once` until ``stop`` is set: every
    ``interval_s`` seconds (``PARTS_POLL_S`` while a step waits for other hosts' parts),
    when a step left alone after a failure is due again, or at once when ``wake`` is set
    (a new local commit) or, without ``wake`` (a sidecar), when a new request appears
    in the local tier. A failed pass is logged and retried after a back-off, whatever
    wakes it meanwhile."""
    while not stop.is_set():
        if wake is not None:
            wake.clear()
        seen = None if wake is not None else _requests(promoter)
        try:
            results = promoter.promote_once(stop=stop)
            promoter.backoff.succeeded(None)
        except CheckpointError as e:
            delay = promoter.backoff.failed(None)
            log.error(
                "promotion pass from %s failed (retried in %.1fs): %s",
                promoter.local.where(),
                delay,
                e,
            )
            if on_pass is not None:
                on_pass([])
            stop.wait(delay)
            continue
        if on_pass is not None:
            on_pass(results)
        if results and any(r.outcome == PROMOTED for r in results):
            continue  # more may have arrived meanwhile
        due = promoter.backoff.next_due_s()
        timeout = interval_s if due is None else min(interval_s, due)
        if any(r.outcome == PARTS_WAITING for r in results):
            timeout = min(timeout, PARTS_POLL_S)  # the parts may be there any moment
        if wake is not None:
            wake.wait(timeout)
        else:
            _until_new_request(promoter, stop, timeout, seen)


def _requests(promoter: Promoter) -> set[str] | None:
    """The keys of the local tier's promotion requests (None: not listed; the promoter's
    own receipts beside them are not requests)."""
    try:
        keys = promoter.local.storage.list(PROMOTE)
    except CheckpointError:
        return None
    return {k for k in keys if parse_promote_key(k) is not None}


def _until_new_request(
    promoter: Promoter, stop: threading.Event, timeout_s: float, seen: set[str] | None
) -> None:
    """Waits ``timeout_s``, or until ``stop``, or until a request not in ``seen`` (those
    there when the pass began) is in the local tier."""
    deadline = time.monotonic() + timeout_s
    while not stop.wait(max(0.0, min(REQUEST_POLL_S, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            return
        now = _requests(promoter)
        if seen is not None and now is not None and now - seen:
            return
