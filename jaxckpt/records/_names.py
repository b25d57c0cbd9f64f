"""Names read from records, checked before they become keys or paths.

Every name a record carries (a manifest's array names, chunk keys and pack
names, a marker's file names, a tree record's array names, a replica index's
file names) ends up in an object key or a local path. A record is checked
with a CRC32C, which a hostile writer recomputes, so these names are
untrusted: ``../../OUTSIDE.bin`` would read or write outside the step. Each
kind has one check here, and a record with a name that fails it is corrupt
(``CorruptCheckpointError`` naming the record). Imports neither jax nor numpy.
"""

from __future__ import annotations

import re

from jaxckpt.errors import CorruptCheckpointError

_CHUNK_KEY = re.compile(r"c(/(0|[1-9][0-9]{0,17}))*")
_PACK_NAME = re.compile(r"packs/(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})\.bin")
_STEP_FILE = re.compile(r"tree\.json|manifest/(0|[1-9][0-9]{0,8})(\.held)?\.json")
MAX_KEY_CHARS = 1024  # S3's and GCS's limit on an object name (bytes)


def key_problem(name: object) -> str | None:
    """Why ``name`` is not a safe relative key (``a/b/c``), or None if it is one.

    Safe: a non-empty str of at most 1,024 characters, ``/``-separated segments
    none of which is empty, ``.`` or ``..``; no backslash, NUL or other control
    character (so no absolute path, no dot segment an HTTP client or ``os.path``
    would resolve, no separator another system reads).

    >>> key_problem("arrays/params.w/c/0/1") is None
    True
    >>> key_problem("../../OUTSIDE.bin")
    "segment '..'"
    >>> key_problem("/etc/passwd")
    'an absolute path'
    """
    if not isinstance(name, str):
        return f"not a string ({type(name).__name__})"
    if not name:
        return "empty"
    if len(name) > MAX_KEY_CHARS:
        return f"{len(name)} characters (at most {MAX_KEY_CHARS})"
    if name.startswith("/"):
        return "an absolute path"
    if "\\" in name:
        return "a backslash"
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        return "a control character"
    for segment in name.split("/"):
        if segment in ("", ".", ".."):
            return f"segment {segment!r}" if segment else "an empty segment"
    return None


def _problem(name: object, kind: str) -> str | None:
    problem = key_problem(name)
    if problem is not None:
        return problem
    assert isinstance(name, str)
    if kind == "array":
        return "a '/'" if "/" in name else None
    pattern = {"chunk": _CHUNK_KEY, "pack": _PACK_NAME, "file": _STEP_FILE}.get(kind)
    if pattern is not None and not pattern.fullmatch(name):
        expected = {
            "chunk": "c/<i>/<j>/...",
            "pack": "packs/<process>.<index>.bin",
            "file": "tree.json or manifest/<process>[.held].json",
        }[kind]
        return f"not of the form {expected}"
    return None


KINDS = ("key", "array", "chunk", "pack", "file")
"""``key``: any safe relative key; ``array``: one segment (an array's name); ``chunk``:
a zarr v3 default chunk key; ``pack``: a pack object's name; ``file``: a step record
a commit marker names."""


def checked_name(name: object, kind: str, what: str) -> str:
    """``name`` if it is a safe name of ``kind`` (one of :data:`KINDS`).

    Args:
      name: the name as read from a record.
      kind: what it names.
      what: the record it was read from (named in the error).

    Raises:
      CorruptCheckpointError: naming the record, the name and what is wrong with it.

    >>> checked_name("packs/0.3.bin", "pack", "manifest/0.json")
    'packs/0.3.bin'
    >>> checked_name("../x", "array", "tree.json")
    Traceback (most recent call last):
    ...
    jaxckpt.errors.CorruptCheckpointError: tree.json: unsafe array name '../x' (segment '..')
    """
    assert kind in KINDS, kind
    problem = _problem(name, kind)
    if problem is not None:
        shown = repr(name)[:200]
        raise CorruptCheckpointError(f"{what}: unsafe {kind} name {shown} ({problem})")
    assert isinstance(name, str)
    return name


def joined_key(prefix: str, name: str, what: str) -> str:
    """``prefix + name`` after checking ``name`` is a safe relative key (a copy's write side).

    Raises:
      CorruptCheckpointError: ``name`` would leave ``prefix``.
    """
    return prefix + checked_name(name, "key", what)
