"""The root an import writes into: refused while this process writes it, and left as it
was when the import fails.

An import is all or nothing. Before the first write it notes what the destination
held: nothing (a new root), files that are not a root yet, or a jaxckpt root. When
the import fails (a source that cannot be read, a save that fails, an interrupt),
it removes exactly what it made: the whole root it created, the files it added to a
directory that was not a root, or the steps it committed to an existing root. A
guard such as "import unless the root exists" then sees no root and tries again.

An open :class:`~jaxckpt.CheckpointManager` of this process that writes the root
would be fenced by the import's writer (the commit protocol gives each writer an
epoch, and a newer one fences the older): that is refused before anything is
written, naming the order that works, or the import goes through that manager.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxckpt import _openroots
from jaxckpt.errors import CheckpointError
from jaxckpt.records import ROOT_RECORD
from jaxckpt.storage import LocalStorage, Storage, open_storage

__all__ = ["Destination", "refuse_held"]

log = logging.getLogger("jaxckpt")


def refuse_held(uri: str) -> None:
    """Refuses ``uri`` when an open writing manager of this process holds it."""
    if _openroots.holder(uri) is not None:
        raise CheckpointError(
            f"an open CheckpointManager of this process writes {uri}; importing with a "
            "second writer would fence it (its next save would fail with WriterFencedError). "
            "Import before opening the manager, or import through it: "
            "import_orbax(src, manager, ...)"
        )


def _local_entries(path: str) -> set[str]:
    entries: set[str] = set()
    for top, dirs, files in os.walk(path):
        entries.update(os.path.join(top, name) for name in (*dirs, *files))
    return entries


@dataclass(kw_only=True)
class Destination:
    """What the destination held before the import, to undo exactly what it adds."""

    uri: str
    storage: Storage
    is_root: bool  # a jaxckpt root already: a failed import deletes its own steps only
    existed: bool  # a local directory that existed (False: the import created it)
    before: frozenset[str]  # what a directory that was not a root held (paths or keys)

    @classmethod
    def note(cls, root: str | os.PathLike[str], storage_options: dict[str, Any]) -> Destination:
        """Notes what ``root`` holds (one read, a listing when it is not a root yet)."""
        storage = open_storage(root, storage_options)
        refuse_held(storage.uri)
        if isinstance(storage, LocalStorage):
            path = storage.uri
            existed = os.path.lexists(path)
            is_root = existed and os.path.isfile(os.path.join(path, ROOT_RECORD))
            before = frozenset() if is_root or not existed else frozenset(_local_entries(path))
            return cls(uri=path, storage=storage, is_root=is_root, existed=existed, before=before)
        is_root = storage.read(ROOT_RECORD) is not None
        before = frozenset() if is_root else frozenset(storage.list(""))
        return cls(uri=storage.uri, storage=storage, is_root=is_root, existed=True, before=before)

    def undo(self, delete_step: Callable[[int], None], committed: list[int]) -> None:
        """Removes what the import made; never raises (the import's error is the one shown)."""
        try:
            if self.is_root:
                for step in committed:
                    delete_step(step)
            elif isinstance(self.storage, LocalStorage):
                self._undo_local()
            else:
                added = [k for k in self.storage.list("") if k not in self.before]
                self.storage.delete_many(added)
        except Exception as e:  # the import's own failure is what the caller sees
            log.error("a failed import could not remove what it wrote under %s: %s", self.uri, e)
            return
        made = f"steps {committed}" if self.is_root else "what it wrote"
        log.warning("the import into %s failed; removed %s", self.uri, made)

    def _undo_local(self) -> None:
        if not self.existed:
            shutil.rmtree(self.uri, ignore_errors=True)
            return
        added = sorted(_local_entries(self.uri) - self.before, key=len, reverse=True)
        for path in added:  # deepest first: files, then the directories they emptied
            if not os.path.lexists(path):
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
