"""The writing managers this process holds open, by root, so that a second writer of the
same process (an import, a second manager) can be refused before it fences the first.

Opening a root for writing takes a new epoch, which fences every earlier writer of
that root (the commit protocol's rule, right across processes). Within one process
that is nearly always a mistake: ``import_orbax(src, root)`` while the trainer's
manager of ``root`` is open makes the trainer's next save fail. A manager registers
its roots here when it opens them and leaves when it closes; nothing is kept alive
by the registry (weak references).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["any_open", "holder", "register", "unregister"]

_open: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def register(manager: Any, roots: tuple[str, ...]) -> None:
    """``manager`` writes ``roots`` (normalised URIs) until :func:`unregister`."""
    with _lock:
        _open[manager] = roots


def unregister(manager: Any) -> None:
    with _lock:
        _open.pop(manager, None)


def holder(root: str) -> Any:
    """The open manager of this process that writes ``root`` (a normalised URI), or None."""
    with _lock:
        return next((m for m, roots in _open.items() if root in roots), None)


def any_open() -> bool:
    """Whether any manager of this process writes a root now."""
    return bool(_open)
