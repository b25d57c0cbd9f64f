"""Health marks: whether a committed step is a good place to resume, as small records
beside the step (never inside it).

A mark is one create-only object, and the newest mark of a step wins, so marks by hand
are reversible and nothing a commit marker names is ever rewritten::

    health/marks/<step name>/<time ns:020d>-<nonce>.<good|bad>.json

``<step name>`` is the commit marker's (:func:`~jaxckpt.records._keys.marker_step_name`).
The verdict is in the key, so the set of bad steps is one listing; the record (step,
verdict, reason, source, time, host) is read only where a reason is shown. A step
without a mark is *unknown*, which counts as good: steps of every older format, and
steps a health policy found good (only bad verdicts, and verdicts on a step saved
again, are written). Keys and records read from storage are untrusted: names must
match the pattern above, records are read up to :data:`MAX_RECORD_BYTES` and checked
field by field; anything else is ignored with a warning.

Standard library only (the CLI's ``ls`` reads marks without jax).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from jaxckpt.records._keys import check_step, marker_step_name
from jaxckpt.storage import Storage

log = logging.getLogger("jaxckpt")

HEALTH = "health/"
MARKS = "health/marks/"
MAX_RECORD_BYTES = 4096
"""The most bytes of a health record that are read (a reason is cut to fit)."""
MAX_REASON_CHARS = 1000
SOURCES = ("policy", "mark", "crash-loop", "rollback")
_MARK = re.compile(r"health/marks/(\d{12}|w\d{19})/(\d{20}-[0-9a-f]{8})\.(good|bad)\.json")

Health = Literal["good", "bad", "unknown"]


def parse_step_name(name: str) -> int | None:
    """The step a marker-style step name spells (None: not one)."""
    if re.fullmatch(r"\d{12}", name):
        return int(name)
    if re.fullmatch(r"w\d{19}", name) and 10**12 <= int(name[1:]) < 2**63:
        return int(name[1:])
    return None


def stamp(now_ns: int | None = None) -> str:
    """A sortable unique name part: the time in ns, then 8 random hex digits."""
    return f"{time.time_ns() if now_ns is None else now_ns:020d}-{secrets.token_hex(4)}"


def host() -> str:
    """Who writes a record: ``hostname:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"[:200]


@dataclass(frozen=True, kw_only=True)
class Mark:
    """One verdict on a step.

    Attributes:
      step: the step judged.
      good: the verdict.
      reason: why (one line; empty for a plain mark).
      source: ``"policy"`` (the manager's health policy), ``"mark"`` (by hand),
        ``"crash-loop"`` (quarantine) or ``"rollback"``.
      time: seconds since the epoch when it was written.
      host: ``hostname:pid`` of the writer.
    """

    step: int
    good: bool
    reason: str = ""
    source: str = "mark"
    time: float = 0.0
    host: str = ""

    def __post_init__(self) -> None:
        check_step(self.step)
        if not isinstance(self.good, bool):
            raise ValueError(f"good must be a bool, got {self.good!r}")
        if not isinstance(self.reason, str):
            raise ValueError(f"reason must be a str, got {self.reason!r}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        if not (isinstance(self.time, int | float) and math.isfinite(self.time)):
            raise ValueError(f"time must be a finite number, got {self.time!r}")
        if not isinstance(self.host, str):
            raise ValueError(f"host must be a str, got {self.host!r}")
        reason = " ".join(self.reason.split())[:MAX_REASON_CHARS]  # one line, bounded
        object.__setattr__(self, "reason", reason)

    @property
    def health(self) -> Health:
        return "good" if self.good else "bad"

    def to_bytes(self) -> bytes:
        record = {
            "step": self.step,
            "good": self.good,
            "reason": self.reason,
            "source": self.source,
            "time": self.time,
            "host": self.host[:200],
        }
        return json.dumps(record, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, what: str) -> Mark:
        """Parses a record read from storage.

        Raises:
          ValueError: too large, malformed or of the wrong types (``what`` named).
        """
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(f"{what} is over {MAX_RECORD_BYTES} bytes")
        try:
            obj = json.loads(data)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
            fields = {k: obj[k] for k in ("step", "good", "reason", "source", "time", "host")}
            return cls(**fields)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ValueError(f"{what} is malformed: {e}") from e


@dataclass(frozen=True)
class MarkKey:
    """A mark's key, parsed: its step, its stamp (the order of marks) and its verdict."""

    key: str
    step: int
    stamp: str
    good: bool


def parse_mark_key(key: str) -> MarkKey | None:
    """The parts of a mark's key (None: not a mark's key)."""
    m = _MARK.fullmatch(key)
    step = None if m is None else parse_step_name(m[1])
    if m is None or step is None:
        return None
    return MarkKey(key, step, m[2], m[3] == "good")


def mark_key(mark: Mark, now_ns: int | None = None) -> str:
    verdict = "good" if mark.good else "bad"
    return f"{MARKS}{marker_step_name(mark.step)}/{stamp(now_ns)}.{verdict}.json"


def write_mark(storage: Storage, mark: Mark) -> str:
    """Writes ``mark`` (create-only, under a new key); returns its key."""
    key = mark_key(mark)
    storage.write(key, mark.to_bytes(), exclusive=True)
    return key


def newest_marks(keys: Iterable[str]) -> dict[int, MarkKey]:
    """The newest mark of each step among listed ``keys`` (others ignored)."""
    newest: dict[int, MarkKey] = {}
    for key in keys:
        parsed = parse_mark_key(key)
        if parsed is None:
            continue
        old = newest.get(parsed.step)
        if old is None or parsed.stamp > old.stamp:
            newest[parsed.step] = parsed
    return newest


def list_marks(storage: Storage) -> dict[int, MarkKey]:
    """The newest mark of every marked step: one listing, nothing read."""
    return newest_marks(storage.list(MARKS))


def bad_steps(storage: Storage) -> set[int]:
    """The steps whose newest mark is bad (one listing)."""
    return {s for s, k in list_marks(storage).items() if not k.good}


def read_mark(storage: Storage, key: MarkKey) -> Mark:
    """The record of a listed mark; a missing or malformed record gives a mark with the
    key's verdict and a reason saying so (logged), never an error."""
    what = f"health mark {storage.uri}/{key.key}"
    try:
        data = storage.read_range(key.key, 0, MAX_RECORD_BYTES + 1)
        if data is None:
            raise ValueError(f"{what} was removed")
        mark = Mark.from_bytes(bytes(data), what)
        if mark.step != key.step or mark.good != key.good:
            raise ValueError(f"{what} does not match its key")
        return mark
    except ValueError as e:
        log.warning("%s", e)
        return Mark(step=key.step, good=key.good, reason=f"(unreadable mark: {e})")


def read_marks(storage: Storage, steps: Iterable[int] | None = None) -> dict[int, Mark]:
    """The newest mark of each marked step (of ``steps`` only, when given)."""
    listed = list_marks(storage)
    wanted = listed if steps is None else {s: listed[s] for s in steps if s in listed}
    return {s: read_mark(storage, k) for s, k in sorted(wanted.items())}


def drop_marks(storage: Storage, step: int) -> None:
    """Deletes every mark of ``step`` (after the step itself was deleted)."""
    storage.delete_prefix(f"{MARKS}{marker_step_name(step)}/")


def describe(mark: Mark | None) -> tuple[Health, str]:
    """``(health, reason)`` of a step whose newest mark is ``mark`` (None: unknown)."""
    if mark is None:
        return "unknown", ""
    return mark.health, mark.reason


def mark_now(step: int, good: bool, reason: str, source: str) -> Mark:
    """A mark written now by this host."""
    return Mark(step=step, good=good, reason=reason, source=source, time=time.time(), host=host())


def as_json(mark: Mark | None) -> dict[str, Any]:
    """The ``health`` and ``health_reason`` fields of ``jaxckpt ls --json``."""
    health, reason = describe(mark)
    return {"health": health, "health_reason": reason or None}
