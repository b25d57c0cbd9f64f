"""Orbax's INFO lines about jaxckpt's own saves are kept out of the user's log.

Each jaxckpt save runs through Orbax's ``AsyncCheckpointer``, which logs six INFO
lines per save (thread started, commit done, waiting, no errors, ...) through
absl; a training script run with ``absl.app`` prints them all. jaxckpt logs one
line per committed step itself (``jaxckpt`` logger), so Orbax's lines are
dropped while a jaxckpt manager writes in this process (or a jaxckpt call is on
the stack). Warnings and errors always pass; so does everything while the
``jaxckpt`` logger is at DEBUG.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from jaxckpt import _openroots

__all__ = ["quiet_orbax_info"]

_ORBAX = f"{os.sep}orbax{os.sep}checkpoint{os.sep}"
_OURS = f"{os.sep}jaxckpt{os.sep}"
_installed = threading.Lock()
_done: list[bool] = []


def _from_jaxckpt() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if _OURS in frame.f_code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _OrbaxInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or _ORBAX not in record.pathname:
            return True
        if logging.getLogger("jaxckpt").isEnabledFor(logging.DEBUG):
            return True
        return not (_openroots.any_open() or _from_jaxckpt())


def quiet_orbax_info() -> None:
    """Installs the filter on absl's logger (once per process)."""
    with _installed:
        if not _done:
            logging.getLogger("absl").addFilter(_OrbaxInfo())
            _done.append(True)
