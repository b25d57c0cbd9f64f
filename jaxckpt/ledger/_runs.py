"""One run's figures from its ledger events: its phases, saves, restore and progress.

A run is one writer epoch. Its *start* is its earliest process start (``open``'s
``process_start``, else the open itself), its *end* its last recorded event, its
*work start* its first ``save`` call (else the end of its restore, else its open).
Its progress is the primary's (time, step) points: its reached steps and the start of
each save. A run is *clean* when every process recorded an exit without an error.
"""

from __future__ import annotations

import bisect
from typing import Any

from jaxckpt.ledger._read import RunEvents

_COMPILES = ("recompiled", "compiled", "loaded")
"""A run's compile outcome: the first of these that any of its processes had."""


class RunFigures:
    """One run's figures, from its events (see :mod:`jaxckpt.ledger._report`)."""

    def __init__(self, run: RunEvents) -> None:
        self.epoch = run.epoch
        self.processes = run.processes
        opens = run.of("open")
        starts = [
            e["open_start"] if e["process_start"] is None else e["process_start"] for e in opens
        ]
        times = run.times()
        self.end = max(times)
        self.start = min(starts) if starts else min(times)
        self.open_start = min((e["open_start"] for e in opens), default=self.start)
        self.open_end = max((e["t"] for e in opens), default=self.start)
        restores = run.of("restore")
        self.restore_s = max((e["seconds"] for e in restores), default=0.0)
        self.restore_end = max((e["t"] for e in restores), default=None)
        first = restores[0] if restores else None
        self.restored = None if first is None else first["step"]
        self.tier = None if first is None else first["tier"]
        self.why = None if first is None else first["why"]
        compiles = run.of("compile")  # CheckpointManager.compile: the slowest process's
        self.compile_s = max((e["seconds"] for e in compiles), default=None)
        outcomes = {e["outcome"] for e in compiles}
        self.compile = next((o for o in _COMPILES if o in outcomes), None)
        first_saves = run.of("first_save")
        self.first_save = max((e["t"] for e in first_saves), default=None)
        exits = {
            p
            for p, es in run.events.items()
            if any(e["kind"] == "exit" and e.get("error") is None for e in es)
        }
        self.clean = bool(exits) and exits >= set(run.events)
        primary = next((p for p in sorted(run.events) if run.of("reached", p)), min(run.events))
        self.saves: dict[int, dict[str, Any]] = {}
        for e in run.of("save"):
            s = self.saves.setdefault(e["step"], {**e, "nbytes": 0, "processes": 0})
            s["blocking_s"] = max(s["blocking_s"], e["blocking_s"])
            s["total_s"] = max(s["total_s"], e["total_s"])
            s["started"] = min(s["started"] or e["started"], e["started"] or s["started"])
            s["nbytes"] += e["nbytes"]  # each process's commit marker (one on a shared root)
            s["processes"] += 1
        for e in run.of("save_call"):  # the loop's wait: the slowest process's call
            if e["step"] in self.saves:
                s = self.saves[e["step"]]
                s["blocking_s"] = max(s["blocking_s"], e["seconds"])
        points = {e["step"]: e["t"] for e in run.of("first_save", primary)}
        points.update((e["step"], e["t"]) for e in run.of("reached", primary))
        for step, s in self.saves.items():
            if s["started"]:
                points[step] = min(points.get(step, s["started"]), s["started"])
        self.points = sorted((t, step) for step, t in points.items())
        self.reached = max((step for _, step in self.points), default=None)
        self.work_start = self.first_save or self.restore_end or self.open_end
        self.promoted = run.of("promoted")
        self.deleted = run.of("deleted")
        self.failed = {e["step"] for e in run.of("save_failed")}

    def time_at(self, step: int) -> float:
        """When this run reached ``step`` (interpolated; its work's start if before)."""
        steps = [s for _, s in self.points]
        i = bisect.bisect_left(steps, step)
        if i == 0:
            return self.work_start if not self.points or step < steps[0] else self.points[0][0]
        if i == len(steps):
            return self.points[-1][0]
        (t0, s0), (t1, s1) = self.points[i - 1], self.points[i]
        return t0 + (t1 - t0) * (step - s0) / (s1 - s0)

    def blocking_between(self, t0: float, t1: float) -> float:
        """Blocking of the saves started after ``t0`` until ``t1``."""
        return sum(s["blocking_s"] for s in self.saves.values() if t0 < s["started"] <= t1)

    def step_s(self) -> float | None:
        """Seconds per step between its first and last point."""
        if len(self.points) < 2 or self.points[-1][1] <= self.points[0][1]:
            return None
        (t0, s0), (t1, s1) = self.points[0], self.points[-1]
        return (t1 - t0) / (s1 - s0)
