"""At interpreter exit, saves still in flight commit before their threads are stopped.

A script that falls off its end, calls ``sys.exit`` or drops its manager
without ``close()`` would otherwise lose its last save: the interpreter shuts
down the thread pools the background write uses (``cannot schedule new
futures after shutdown``) and the step stays partial. Each save in flight is
tracked here (by a strong reference, so ``del manager`` keeps it), and a hook
that runs before the thread pools are shut down waits for each, bounded by its
save timeout, logging one line.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("jaxckpt")


class Finishing(Protocol):
    """A save session whose in-flight save can be waited for at exit."""

    def finish_at_exit(self) -> None: ...


_live: set[Finishing] = set()
_lock = threading.Lock()
_installed = False


def track(session: Finishing) -> None:
    """``session`` has a save in flight: exit waits for it."""
    global _installed
    with _lock:
        _live.add(session)
        if _installed:
            return
        _installed = True
    # Runs before concurrent.futures' own exit hook (registered earlier, at its import:
    # these hooks run newest first), so the save's pools still take work.
    threading._register_atexit(_finish_all)  # type: ignore[attr-defined]


def untrack(session: Finishing) -> None:
    """``session``'s save committed or failed."""
    with _lock:
        _live.discard(session)


def _finish_all() -> None:
    with _lock:
        sessions = list(_live)
    for session in sessions:
        session.finish_at_exit()


def finish(wait: Callable[[], None], step: int, root: str) -> None:
    """Waits for the save of ``step`` under ``root`` (``wait``), logging one line."""
    try:
        wait()
    except Exception as e:
        log.error(
            "at exit: the save of step %d under %s did not commit (%s); close() the manager "
            "(or use `with`) to wait for its last save before exiting and see this error",
            step,
            root,
            e,
        )
        return
    log.warning(
        "at exit: waited for the save of step %d under %s to commit (the manager was not "
        "closed; close() or `with` waits for the last save)",
        step,
        root,
    )
