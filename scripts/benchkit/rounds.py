"""Orchestrator side: fresh child processes, scratch roots, interleaved rounds."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from benchkit.common import (
    GB,
    KEEP_BYTES,
    LOOP_CONTENDERS,
    REPO,
    RESULT_MARK,
    Case,
    Settings,
    _progress,
)

SCRIPT = REPO / "scripts" / "bench.py"


def run_child(spec: dict[str, Any], *, timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Runs one measurement in a fresh interpreter; returns its result or ``{"error": ...}``."""
    cmd = [sys.executable, str(SCRIPT), "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])
    return {"error": f"child exited with {proc.returncode}: {proc.stderr[-1500:]}"}


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra or {})
    return env


def _timeout_for(case: Case, extra_s: float = 0.0) -> float:
    return 240.0 + case.nbytes / 5e6 + extra_s


def _io_line(result: dict[str, Any], nbytes: int) -> str:
    if "error" in result:
        return "ERROR " + result["error"].splitlines()[0][:200]
    return (
        f"blocking {result['blocking_s'] * 1e3:.1f} ms, save {nbytes / result['commit_s'] / GB:.2f}"
        f" GB/s, restore {nbytes / result['restore_s'] / GB:.2f} GB/s, peak extra RSS"
        f" {result['save_extra_rss'] / nbytes:.2f}× / {result['restore_extra_rss'] / nbytes:.2f}×"
    )


class Scratch:
    """Directories for the children; deleted late, as deleting many files is not free.

    Deleting thousands of files makes ext4 slow to create new ones for a minute or
    more (its inode allocator skips recently freed inodes: ``recently_deleted`` in
    ``fs/ext4/ialloc.c``), which would slow down whichever contender runs next. So
    directories are kept until the case ends, as long as they hold under ``keep_bytes``.
    """

    def __init__(self, base: Path, keep_bytes: int = KEEP_BYTES) -> None:
        self._base = base
        self._keep = keep_bytes
        self._kept: list[str] = []
        self._held = 0

    def new(self, contender: str) -> str:
        return str(self._base / f"{contender}-{uuid.uuid4().hex[:8]}")

    def release(self, root: str, nbytes: int) -> None:
        if self._held + nbytes <= self._keep:
            self._kept.append(root)
            self._held += nbytes
        else:
            shutil.rmtree(root, ignore_errors=True)

    def flush(self) -> None:
        for root in self._kept:
            shutil.rmtree(root, ignore_errors=True)
        self._kept, self._held = [], 0


class BucketRoots:
    """Roots in the loopback buckets (each measurement empties its own root)."""

    def __init__(self, buckets: dict[str, str]) -> None:
        self._buckets = buckets

    def new(self, contender: str) -> str:
        return f"{self._buckets[contender.split('-')[1]]}/bench-{uuid.uuid4().hex[:8]}"

    def release(self, root: str, nbytes: int) -> None:
        pass


def run_io_rounds(
    s: Settings,
    case: Case,
    contenders: tuple[str, ...],
    roots: Scratch | BucketRoots,
    env: dict[str, str],
    server_logs: dict[str, str] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """``repeats`` rounds of save + restore, contenders interleaved within each round.

    ``server_logs`` (store name -> log file) lets a child count its requests.
    """
    samples: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    for r in range(s.repeats):
        for contender in contenders:
            root = roots.new(contender)
            spec = {
                "phase": "io",
                "case": dataclasses.asdict(case),
                "contender": contender,
                "root": root,
                "cold_cache": s.cold_cache,
                "jaxckpt_options": s.jaxckpt_options,
            }
            timeout_s = _timeout_for(case)
            if server_logs:  # in-memory servers on this machine's two cores: slow
                spec["server_log"] = server_logs[contender.split("-")[1]]
                timeout_s *= 4
            try:
                result = run_child(spec, timeout_s=timeout_s, env=env)
            finally:
                roots.release(root, case.nbytes)
            samples[contender].append(result)
            line = _io_line(result, case.nbytes)
            _progress(f"  [{case.name} {r + 1}/{s.repeats}] {contender:12s} {line}")
    return samples


def calibrate_step(s: Settings, env: dict[str, str]) -> float:
    result = run_child({"phase": "calibrate"}, timeout_s=300, env=env)
    if "error" in result:
        raise RuntimeError(f"calibration of the training step failed: {result['error']}")
    return float(result["step_s"])


def loop_plan(s: Settings, io: dict[str, Any], step_s: float) -> tuple[int, int]:
    """``(every, saves)``: room for the slower library's save between two saves."""
    commits = [io[c]["commit_s"] for c in ("jaxckpt", "orbax") if io.get(c, {}).get("commit_s")]
    interval = max(s.loop_min_interval_s, 1.5 * max(commits, default=1.0))
    return max(2, math.ceil(interval / step_s)), s.loop_saves


def run_loop_rounds(
    s: Settings,
    case: Case,
    plan: tuple[int, int, float],
    scratch: Scratch,
    env: dict[str, str],
) -> dict[str, list[dict[str, Any]]]:
    """``repeats`` rounds of the training loop, contenders interleaved.

    ``plan`` is (steps between saves, saves, seconds per step).
    """
    every, saves, step_s = plan
    # The smoke test's tiny cases skip the variant contenders (test time).
    contenders = LOOP_CONTENDERS[:3] if case.name.startswith("tiny") else LOOP_CONTENDERS
    samples: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    loop_s = 2 * every * saves * step_s
    for r in range(s.repeats):
        for contender in contenders:
            root = scratch.new(contender)
            spec = {
                "phase": "loop",
                "case": dataclasses.asdict(case),
                "contender": contender,
                "root": root,
                "every": every,
                "saves": saves,
                "jaxckpt_options": s.jaxckpt_options,
            }
            try:
                result = run_child(spec, timeout_s=_timeout_for(case, 4 * loop_s), env=env)
            finally:
                scratch.release(root, saves * case.nbytes)
            samples[contender].append(result)
            _progress(
                f"  [{case.name} loop {r + 1}/{s.repeats}] {contender:8s} {_loop_line(result)}"
            )
    return samples


def _pair_overhead(result: dict[str, Any]) -> float:
    """Median over the pairs of a loop run of (saving segment − plain segment)."""
    pairs = zip(result["saving_s"], result["plain_s"], strict=True)
    return statistics.median([a - b for a, b in pairs])


def _loop_line(result: dict[str, Any]) -> str:
    if "error" in result:
        return "ERROR " + result["error"].splitlines()[0][:200]
    extra = _pair_overhead(result)
    return (
        f"plain segment {statistics.median(result['plain_s']):.2f} s, overhead {extra * 1e3:.0f}"
        f" ms/save, blocking {statistics.median(result['blocking_s']) * 1e3:.1f} ms/save"
    )


# ---- summaries ------------------------------------------------------------------------------
