"""The run ledger's on-storage form: its keys and its events, checked when read.

Each process of each writer epoch (one run of the job: a restart takes a new epoch)
appends bounded objects under the durable root::

    ledger/<epoch:012d>/<process:06d>/<seq:08d>.json

Each object holds a batch of events of that process, oldest first
(``{"version": 1, "epoch": E, "process": P, "processes": N, "seq": K, "events": [...]}``);
an object is at most :data:`MAX_OBJECT_BYTES` and is never rewritten once a later
``seq`` exists. An event is a JSON object with its ``kind``, its wall-clock time ``t``
and the fields :data:`FIELDS` names. What is read is untrusted: a key that does not
parse is skipped, an object over the cap is refused before it is parsed, and an event
whose fields are not what its kind says is dropped (counted by the reader).
Imports neither jax nor numpy.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

LEDGER = "ledger/"
VERSION = 1
MAX_OBJECT_BYTES = 256 << 10
"""The largest ledger object a writer writes (a batch is split to fit)."""
MAX_READ_BYTES = 1 << 20
"""The largest ledger object a reader accepts (anything larger is not ours)."""
MAX_EVENT_BYTES = 4 << 10
"""The largest single event (a longer error text is cut)."""

_KEY = re.compile(r"ledger/(\d{1,12})/(\d{1,6})/(\d{1,8})\.json")

# kind -> {field: (types, required)}; every event also has "t" (wall-clock seconds).
_INT, _NUM, _STR = (int,), (int, float), (str,)
_OPT_INT, _OPT_NUM, _OPT_STR = (int, type(None)), (int, float, type(None)), (str, type(None))
FIELDS: Mapping[str, Mapping[str, tuple[type, ...]]] = {
    # a manager opened: the startup phases so far
    "open": {"process_start": _OPT_NUM, "open_start": _NUM, "tiers": (list,), "pid": _INT},
    "restore": {
        "step": _INT,
        "tier": _OPT_STR,
        "seconds": _NUM,
        "newest": _OPT_INT,
        "why": _OPT_STR,
        "nbytes": _INT,
    },
    # CheckpointManager.compile: loaded (a kept executable), compiled (none kept, or no
    # compilation_cache) or recompiled (the kept one failed to load)
    "compile": {"outcome": _STR, "seconds": _NUM},
    "first_save": {"step": _INT},  # the first save() call of the run (startup's end)
    "reached": {"step": _INT},  # the newest step the loop called save() with, at t
    # a save() call that started a save, on every process: the seconds the loop waited
    # (the previous save's end included)
    "save_call": {"step": _INT, "seconds": _NUM},
    # a committed save, where this process committed it (the primary; every process on
    # a local tier): nbytes is the commit marker's (the step's bytes on a shared root)
    "save": {
        "step": _INT,
        "blocking_s": _NUM,
        "total_s": _NUM,
        "nbytes": _INT,
        "tier": _STR,
        "started": _NUM,
    },
    "save_failed": {"step": _OPT_INT, "error": _STR},
    "promoted": {"step": _INT, "nbytes": _INT, "seconds": _NUM, "durable_s": _OPT_NUM},
    "deleted": {"step": _INT, "tier": _STR, "nbytes": _INT},
    # published weights (the primary): outcome published, failed, skipped or gone
    "publish": {"step": _INT, "outcome": _STR, "nbytes": _INT, "seconds": _NUM, "error": _OPT_STR},
    "preemption": {"step": _OPT_INT},
    # the manager closed (closed) or was open at interpreter exit; error: while an
    # exception unwound the training loop (a failed run)
    "exit": {"closed": (bool,), "error": _OPT_STR},
}
WHY = (None, "fallback", "healing", "quarantine", "bad")
"""Why a restore took an older step than the newest committed one (None: it did not)."""


def ledger_key(epoch: int, process: int, seq: int) -> str:
    """The key of one ledger object.

    >>> ledger_key(7, 0, 3)
    'ledger/000000000007/000000/00000003.json'
    """
    return f"{LEDGER}{epoch:012d}/{process:06d}/{seq:08d}.json"


def parse_key(key: str) -> tuple[int, int, int] | None:
    """``(epoch, process, seq)`` of a ledger key, or None for any other key.

    >>> parse_key("ledger/000000000007/000000/00000003.json"), parse_key("ledger/../x.json")
    ((7, 0, 3), None)
    """
    m = _KEY.fullmatch(key)
    return None if m is None else (int(m[1]), int(m[2]), int(m[3]))


def _valid(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False
    if not isinstance(value, types):
        return False
    if isinstance(value, float):
        return math.isfinite(value) and value >= 0
    if isinstance(value, int) and not isinstance(value, bool):
        return 0 <= value < 2**63
    return True


def check_event(event: Any) -> dict[str, Any] | None:
    """``event`` when it is a well-formed event of a known kind, else None."""
    if not isinstance(event, dict):
        return None
    kind, t = event.get("kind"), event.get("t")
    fields = FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None or not _valid(t, _NUM):
        return None
    for name, types in fields.items():
        if not _valid(event.get(name), types):
            return None
    if kind == "restore" and event["why"] not in WHY:
        return None
    return event


@dataclass(frozen=True, kw_only=True)
class LedgerObject:
    """One ledger object as read: whose, and its valid events.

    Attributes:
      epoch, process, seq: from its key (the body must agree).
      processes: the job's process count in that run.
      events: its events that passed :func:`check_event`, in order.
      dropped: events that did not.
    """

    epoch: int
    process: int
    seq: int
    processes: int
    events: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    dropped: int = 0

    def to_bytes(self) -> bytes:
        body = {
            "version": VERSION,
            "epoch": self.epoch,
            "process": self.process,
            "processes": self.processes,
            "seq": self.seq,
            "events": list(self.events),
        }
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_bytes(cls, key: str, data: bytes) -> LedgerObject | None:
        """The object stored under ``key``, or None when it is not a valid ledger object
        (oversized, not JSON, another version, or a body that disagrees with its key)."""
        parsed = parse_key(key)
        if parsed is None or len(data) > MAX_READ_BYTES:
            return None
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(body, dict) or body.get("version") != VERSION:
            return None
        epoch, process, seq = parsed
        processes: Any = body.get("processes")
        events = body.get("events")
        if (body.get("epoch"), body.get("process"), body.get("seq")) != (epoch, process, seq):
            return None
        if not _valid(processes, _INT) or not 0 < processes <= 1 << 20:
            return None
        if not isinstance(events, list):
            return None
        valid = [e for e in map(check_event, events) if e is not None]
        return cls(
            epoch=epoch,
            process=process,
            seq=seq,
            processes=processes,
            events=tuple(valid),
            dropped=len(events) - len(valid),
        )
