"""Where a committed step's data lives, for tests that damage or inspect it directly.

Tests never build storage keys by hand: a step's objects live under the
attempt its commit marker names (``attempts/<step>/<attempt>/`` in formats 2 and 3,
format 4 with its packs and manifest parts under hashed prefixes
``data/<hh>/<step>.<attempt>/``; ``steps/<step>/`` in format 1).
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxckpt.commit import CommitProtocol, list_attempt
from jaxckpt.records import ATTEMPTS, DATA, LEGACY_STEPS, parse_data_key
from jaxckpt.storage import Storage, open_storage


def step_key(root: str, step: int) -> str:
    """The key prefix (ending in ``/``) of the committed attempt of ``step``."""
    return CommitProtocol(open_storage(root)).require_marker(step).location.prefix


def step_object(root: str, step: int, name: str) -> str:
    """The key of the object ``name`` (``packs/0.0.bin``, ``tree.json``) of a committed step."""
    return CommitProtocol(open_storage(root)).require_marker(step).location.key(name)


def step_dir(root: str, step: int, *parts: str) -> str:
    """The local path of the committed attempt of ``step`` (a local root), joined with ``parts``."""
    return os.path.join(root, step_key(root, step), *parts)


def chunk_path(root: str, step: int, array: str, *index: int) -> str:
    """The local path (or URI) of one chunk object of a committed step."""
    key = step_key(root, step) + f"arrays/{array}/c/" + "/".join(map(str, index))
    return f"{root.rstrip('/')}/{key}"


def data_steps(storage: Storage) -> set[int]:
    """Steps with any data object under the root (committed or not)."""
    keys = storage.list(ATTEMPTS) + storage.list(DATA) + storage.list(LEGACY_STEPS)
    return {loc.step for k in keys if (loc := parse_data_key(k))}


def marker_path(root: str, step: int) -> Path:
    """The local path of the (one) commit marker object of ``step``, valid or not."""
    (ref,) = [r for r in CommitProtocol(open_storage(root)).marker_refs() if r.step == step]
    return Path(root, ref.key)


def packed_chunk(root: str, step: int, array: str, *index: int) -> tuple[str, int, int]:
    """``(URI of its pack object, byte offset, size)`` of one chunk of a packed step."""
    protocol = CommitProtocol(open_storage(root))
    marker = protocol.require_marker(step)
    key = "c/" + "/".join(map(str, index)) if index else "c"
    for part in protocol.read_manifest(marker):
        for chunk in part.arrays.get(array, ()):
            if chunk.key == key and chunk.pack is not None:
                uri = f"{root.rstrip('/')}/{marker.location.key(chunk.pack)}"
                return uri, chunk.offset, chunk.size
    raise KeyError(f"no packed chunk {key} of {array} in step {step}")


def data_objects(root: str, step: int) -> list[str]:
    """Keys of the data objects (zarr chunks or pack objects) of a committed step."""
    loc = CommitProtocol(open_storage(root)).require_marker(step).location
    names = {k: loc.name_of(k) or "" for k in list_attempt(open_storage(root), loc)}
    return [
        k
        for k, name in names.items()
        if name.startswith("packs/") or (name.startswith("arrays/") and not k.endswith("zarr.json"))
    ]
