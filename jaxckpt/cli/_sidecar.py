"""``jaxckpt promote --watch`` started before its job: waiting for the local tier to appear.

A sidecar starts with its pod, often before the trainer has created its local root
(and again on a replaced node, whose local disk is empty): it waits for the root to
become a tiered job's local tier instead of exiting, until SIGTERM/SIGINT.
"""

from __future__ import annotations

import signal
import threading

from jaxckpt.records import PROMOTE, ROOT_RECORD, TIER_RECORD
from jaxckpt.storage import open_storage


def is_local_tier(uri: str) -> bool:
    """Whether ``uri`` holds a root record and a tier record or promotion requests."""
    storage = open_storage(uri)
    if storage.read(ROOT_RECORD) is None:
        return False
    return storage.read(TIER_RECORD) is not None or bool(storage.list(PROMOTE))


def wait_for_local_tier(uri: str, interval_s: float) -> bool:
    """Polls every ``interval_s`` until ``uri`` is a local tier (True), saying once that
    it waits; False if SIGTERM or SIGINT came first (the handlers are restored after)."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        said = False
        while not is_local_tier(uri):
            if not said:
                print(f"waiting for {uri} to become a tiered job's local root", flush=True)
                said = True
            if stop.wait(interval_s):
                return False
        return True
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
