"""Output helpers shared by every command: tables, human units, progress bars, JSON."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from jaxckpt.saving import human_bytes

__all__ = [
    "Progress",
    "ago",
    "dotted_paths",
    "err",
    "human_bytes",
    "human_duration",
    "json_out",
    "local_time",
    "number",
    "print_table",
]


def human_duration(seconds: float) -> str:
    """``90`` -> ``'1.5 min'``.

    >>> human_duration(0.25), human_duration(42), human_duration(3600), human_duration(2e5)
    ('250 ms', '42.0 s', '1.0 h', '2.3 d')
    """
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 90:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def number(x: float | None) -> str:
    """A statistic in 4 significant digits; ``-`` for None.

    >>> number(1234567.0), number(0.000123456), number(None), number(float("nan"))
    ('1.235e+06', '0.0001235', '-', 'nan')
    """
    return "-" if x is None else f"{x:.4g}"


def local_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def ago(t: float) -> str:
    return f"{human_duration(max(0.0, time.time() - t))} ago"


# A keystr tree path: a dict key first, then keys, indices and attributes.
_KEYSTR = re.compile(r"\['(?:[^'\\\]]|\\.)*'\](?:\['(?:[^'\\\]]|\\.)*'\]|\[\d+\]|\.[A-Za-z_]\w*)*")


def dotted_paths(text: str) -> str:
    """``text`` with keystr tree paths (errors raised by the library) in the dotted form
    every command prints (``['params']['w']`` -> ``params.w``).

    >>> dotted_paths("step 3: ['params']['w'][0].mu: chunk c/0 of /r/x.y: missing")
    'step 3: params.w.0.mu: chunk c/0 of /r/x.y: missing'
    """

    def dotted(m: re.Match[str]) -> str:
        keys = re.findall(r"\['((?:[^'\\]|\\.)*)'\]|\[(\d+)\]|\.([A-Za-z_]\w*)", m.group(0))
        return ".".join(a or b or c for a, b, c in keys)

    return _KEYSTR.sub(dotted, text)


def err(message: str) -> None:
    """Prints ``jaxckpt: error: MESSAGE`` on one line of stderr."""
    print(f"jaxckpt: error: {' '.join(message.split())}", file=sys.stderr)


def print_table(
    rows: Sequence[Sequence[str]], out: TextIO | None = None, right: Sequence[int] = ()
) -> None:
    """Prints rows in columns two spaces apart; columns in ``right`` are right-aligned.

    >>> print_table([["STEP", "SIZE"], ["1", "1.0 KiB"], ["100", "12 B"]], right=(0, 1))
    STEP     SIZE
       1  1.0 KiB
     100     12 B
    """
    out = sys.stdout if out is None else out
    if not rows:
        return
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip(), file=out)


def json_out(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, allow_nan=True))


class Progress:
    """A one-line progress bar with human sizes, redrawn at most every ``interval`` s."""

    def __init__(
        self, label: str, total: int, *, stream: TextIO, enabled: bool, interval: float = 0.1
    ) -> None:
        self.label, self.total, self.done = label, total, 0
        self._stream, self._enabled, self._interval = stream, enabled, interval
        self._start = self._last = time.monotonic()

    @classmethod
    def on_stderr(cls, label: str, total: int, *, quiet: bool = False) -> Progress:
        """A bar on stderr, drawn only when stderr is a terminal and not ``quiet``."""
        return cls(label, total, stream=sys.stderr, enabled=not quiet and sys.stderr.isatty())

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self._enabled and now - self._last >= self._interval:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        bar = "#" * round(30 * frac)
        rate = self.done / max(now - self._start, 1e-9)
        self._stream.write(
            f"\r{self.label} [{bar:<30}] {100 * frac:5.1f}% "
            f"{human_bytes(self.done)} / {human_bytes(self.total)} ({human_bytes(rate)}/s)"
        )
        self._stream.flush()

    def finish(self) -> float:
        """Draws the final state and ends the line; returns the elapsed seconds."""
        now = time.monotonic()
        if self._enabled:
            self._draw(now)
            self._stream.write("\n")
            self._stream.flush()
        return now - self._start
