"""Lowering the CPU priority of checkpoint work that shares a node with training."""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["lower_thread_priority"]

_log = logging.getLogger("jaxckpt")


def lower_thread_priority(nice: int, what: str = "the save thread") -> None:
    """Raises the calling thread's nice value to ``nice`` (Linux: per thread; never lowers it).

    Threads it starts inherit the value. Elsewhere, or without permission, logs (naming
    ``what``) and goes on.
    """
    if nice <= 0:
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (AttributeError, OSError) as e:
        _log.warning("could not lower %s's priority to nice %d: %s", what, nice, e)
