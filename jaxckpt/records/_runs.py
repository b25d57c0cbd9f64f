"""Restore attempts and how their runs ended: what crash-loop quarantine counts.

One folder per run of a writing manager that restored, its facts in the key names so
that one listing answers everything (the records hold the same facts, plus time and
host, for people)::

    health/runs/<run>/restore.<step name>.json    written when the run's first restore
                                                  picks its step, before any data is read
    health/runs/<run>/progress.<step name>.json   the run committed a newer step
    health/runs/<run>/exit.<clean|preempted>.json the run closed its manager cleanly, or
                                                  got a preemption notice

``<run>`` is ``<time ns:020d>-<nonce>``, so runs sort by start. A run whose folder has
a restore but neither progress nor an exit ended some other way: killed, crashed,
an exception out of the ``with`` block. :func:`crash_loop` counts the newest such runs
that restored the same step. The primary keeps the newest :data:`KEEP_RUNS` runs and
deletes older folders. Untrusted like every record read: keys that do not match are
ignored, and at most :data:`KEEP_RUNS` times 4 runs are looked at.

These records are self-contained (nothing else reads or writes ``health/runs/``).
Standard library only.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from jaxckpt.records._health import host, parse_step_name, stamp
from jaxckpt.records._keys import marker_step_name
from jaxckpt.storage import Storage

RUNS = "health/runs/"
KEEP_RUNS = 32
"""Runs whose records are kept (older ones are deleted when a run starts)."""
EXITS = ("clean", "preempted")
_KEY = re.compile(
    r"health/runs/(\d{20}-[0-9a-f]{8})/"
    r"(?:(restore|progress)\.(\d{12}|w\d{19})|exit\.(clean|preempted))\.json"
)


@dataclass
class Run:
    """What one run's records say."""

    run: str
    restored: int | None = None
    progress: bool = False
    exit: str | None = None
    keys: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """It restored and then ended without progress, a clean exit or a preemption."""
        return self.restored is not None and not self.progress and self.exit is None


def new_run() -> str:
    """A new run's id (sorts after every earlier run's on a sane clock)."""
    return stamp()


def parse_runs(keys: Iterable[str]) -> list[Run]:
    """The runs listed ``keys`` describe, newest first (at most ``4 * KEEP_RUNS``)."""
    runs: dict[str, Run] = {}
    for key in keys:
        m = _KEY.fullmatch(key)
        if m is None:
            continue
        run = runs.setdefault(m[1], Run(m[1]))
        run.keys.append(key)
        if m[2] == "restore":
            run.restored = parse_step_name(m[3])
        elif m[2] == "progress":
            run.progress = True
        else:
            run.exit = m[4]
    return [runs[r] for r in sorted(runs, reverse=True)[: 4 * KEEP_RUNS]]


def list_runs(storage: Storage) -> list[Run]:
    """Every recorded run, newest first (one listing)."""
    return parse_runs(storage.list(RUNS))


def crash_loop(
    runs: list[Run], since: Callable[[int], str] = lambda step: ""
) -> tuple[int | None, int]:
    """``(step, n)``: the step the newest run restored and how many of the newest runs
    in a row restored it and failed (:attr:`Run.failed`), counting only runs that
    started after ``since(step)`` (a run id or a mark's stamp: a step marked good by
    hand starts its count again); ``(None, 0)`` without runs."""
    if not runs or runs[0].restored is None:
        return None, 0
    step, n = runs[0].restored, 0
    for run in runs:
        if run.restored != step or not run.failed or run.run <= since(step):
            break
        n += 1
    return step, n


def _record(kind: str, **facts: object) -> bytes:
    return json.dumps({"kind": kind, "time": time.time(), "host": host(), **facts}).encode()


def write_restore(storage: Storage, run: str, step: int) -> None:
    """Records that ``run`` is restoring ``step`` (its first restore)."""
    key = f"{RUNS}{run}/restore.{marker_step_name(step)}.json"
    storage.write(key, _record("restore", run=run, step=step))


def write_progress(storage: Storage, run: str, step: int) -> None:
    """Records that ``run`` committed ``step``, newer than the one it restored."""
    key = f"{RUNS}{run}/progress.{marker_step_name(step)}.json"
    storage.write(key, _record("progress", run=run, step=step))


def write_exit(storage: Storage, run: str, how: str) -> None:
    """Records that ``run`` ended cleanly (``"clean"``) or was told to stop (``"preempted"``)."""
    if how not in EXITS:
        raise ValueError(f"how must be one of {EXITS}, got {how!r}")
    storage.write(f"{RUNS}{run}/exit.{how}.json", _record("exit", run=run, how=how))


def prune_runs(storage: Storage, runs: list[Run], keep: int = KEEP_RUNS) -> None:
    """Deletes the records of every run but the newest ``keep`` (of ``runs``, newest first)."""
    old = [k for run in runs[keep:] for k in run.keys]
    if old:
        storage.delete_many(old)
