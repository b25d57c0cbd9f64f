"""The promoter's loop: passes of :meth:`Promoter.promote_once` until told to stop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxckpt.errors import CheckpointError
from jaxckpt.records import PARTS_WAITING, PROMOTED, PromotionResult

if TYPE_CHECKING:
    from jaxckpt.lifecycle._promoter import Promoter

log = logging.getLogger("jaxckpt")

PARTS_POLL_S = 0.2
"""How soon the next pass looks again while the primary's step waits for other parts."""


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
    (a new local commit). A failed pass is logged and retried after a back-off,
    whatever wakes it meanwhile."""
    while not stop.is_set():
        if wake is not None:
            wake.clear()
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
            stop.wait(timeout)
