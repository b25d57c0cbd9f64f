"""Benchmark jaxckpt against the disk's limit and against Orbax, side by side in one run.

Every measurement runs in a fresh child process (``--child``), one contender at a
time, interleaved ``raw, jaxckpt, orbax, raw, jaxckpt, orbax, ...`` so that slow
drifts of the machine hit all contenders alike. A child builds the same state
(float32 leaves, normally distributed, in XLA-owned buffers), warms its
contender up with a tiny save and restore, then measures:

* save: the time ``save`` blocks, the time until the step is committed, and the
  peak resident memory above the level at the call (``/proc/self/status``
  ``VmHWM`` after resetting it through ``/proc/self/clear_refs``, cross-checked
  by a psutil sampling thread);
* restore: after ``fsync`` + ``POSIX_FADV_DONTNEED`` on every file of the step
  (for all contenders alike; ``--warm-cache`` skips it), the time to get the
  arrays back and the peak extra memory; then the restored values are compared
  with the saved ones.

The contenders: ``raw`` writes each leaf to its own file and fsyncs it, one
after the other (the disk's sequential limit), and reads it back with
``readinto``; ``jaxckpt`` is :class:`jaxckpt.CheckpointManager`; ``orbax`` is
``ocp.CheckpointManager`` with ``ocp.args.StandardSave`` and default options.

The training loop: a jitted, CPU-bound step (matmuls on both cores). A child runs
``saves`` pairs of segments of ``every`` steps each, one plain and one that starts
with a save and ends when it is committed; ``every`` is chosen so that a save has
time to finish in the background. The overhead per save (saving minus plain
segment, pair by pair, so that drifts in the machine's load cancel) is set
beside the blocking time of a save alone.

With ``--object-stores``, ``moto_server`` and ``gcp-storage-emulator`` are started
on 127.0.0.1 (through ``tests/servers.py`` when present) for informational rows.

Usage::

    python scripts/bench.py [--cases big,small,huge] [--repeats 3] [--out results/]
    python scripts/bench.py --tiny --repeats 1 --out /tmp/bench   # smoke test

Writes ``bench.md`` (tables with the date and machine), ``bench.png`` and
``bench.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULT_MARK = "BENCH-RESULT "
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
GB = 1e9
KEEP_BYTES = 3 * GiB  # scratch kept on disk within a case (see Scratch)
CONTENDERS = ("raw", "jaxckpt", "orbax")
LOOP_CONTENDERS = ("raw", "jaxckpt", "orbax")
STORE_CONTENDERS = ("jaxckpt-s3", "jaxckpt-gcs", "orbax-gcs")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """A state to save: ``leaves`` float32 arrays of ``leaf_bytes`` each."""

    name: str
    kind: str  # "few-big" or "many-small": which targets apply
    leaves: int
    leaf_bytes: int

    @property
    def nbytes(self) -> int:
        return self.leaves * self.leaf_bytes

    @property
    def label(self) -> str:
        return f"{self.name}: {self.leaves:,} × {_size(self.leaf_bytes)} = {_size(self.nbytes)}"


CASES = {
    c.name: c
    for c in (
        Case(name="big", kind="few-big", leaves=16, leaf_bytes=64 * MiB),
        Case(name="small", kind="many-small", leaves=1000, leaf_bytes=64 * KiB),
        Case(name="huge", kind="few-big", leaves=16, leaf_bytes=256 * MiB),
        Case(name="tiny-big", kind="few-big", leaves=4, leaf_bytes=1 * MiB),
        Case(name="tiny-small", kind="many-small", leaves=40, leaf_bytes=16 * KiB),
    )
}
DEFAULT_CASES = "big,small,huge"
TINY_CASES = "tiny-big,tiny-small"


def _size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


# --------------------------------------------------------------------------------------------
# Child side: state, contenders, memory probe, measurements. Imports jax lazily.
# --------------------------------------------------------------------------------------------


def make_state(case: Case, seed: int = 0) -> dict[str, Any]:
    """``{"layer0000": array, ...}``: distinct, normally distributed, XLA-owned leaves."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = case.leaf_bytes // 4
    base = jnp.asarray(
        np.random.default_rng(seed).standard_normal(min(n, 16 * MiB), dtype=np.float32)
    )

    @jax.jit
    def leaf(base: Any, i: Any) -> Any:  # base as an argument: not baked into the program
        tiled = jnp.tile(base, -(-n // base.size))[:n]
        return tiled * (1.0 + i * 1e-3) + i * 1e-3

    state = {f"layer{i:04d}": leaf(base, jnp.float32(i)) for i in range(case.leaves)}
    return jax.block_until_ready(state)


def abstract_of(state: Any) -> Any:
    import jax

    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def _stored_bytes(files: list[str]) -> int:
    return sum(os.path.getsize(f) for f in files)


def _files_under(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]


class RawSaver:
    """The disk's limit: each leaf to its own file, written and fsync'd in turn."""

    def __init__(self, root: str) -> None:
        self._root = root
        os.makedirs(root, exist_ok=True)

    def save(self, step: int, state: dict[str, Any]) -> None:
        import numpy as np

        folder = os.path.join(self._root, str(step))
        os.makedirs(folder)
        for name, value in state.items():
            data = np.ascontiguousarray(np.asarray(value)).data.cast("B")
            fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                while data:
                    data = data[os.write(fd, data) :]
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(folder)
        _fsync_dir(self._root)

    def wait(self) -> None:
        pass

    def restore(self, step: int, abstract: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        out = {}
        for name, spec in abstract.items():
            array = np.empty(spec.shape, spec.dtype)
            view = array.data.cast("B")
            with open(os.path.join(self._root, str(step), name), "rb", buffering=0) as f:
                while view:
                    view = view[f.readinto(view) :]
            out[name] = array
        return out

    def files(self) -> list[str]:
        return _files_under(self._root)

    def close(self) -> None:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JaxckptSaver:
    """jaxckpt.CheckpointManager, with the bench's options."""

    def __init__(self, root: str, options: dict[str, Any]) -> None:
        import jaxckpt

        self._root = root
        if "://" in root:  # local-disk options do not apply to object stores
            options = {k: v for k, v in options.items() if k != "storage_options"}
        self._m = jaxckpt.CheckpointManager(root, **options)

    def save(self, step: int, state: Any) -> None:
        self._m.save(step, state)

    def wait(self) -> None:
        self._m.wait()

    def restore(self, step: int, abstract: Any) -> Any:
        return self._m.restore(step, target=abstract)

    def files(self) -> list[str]:
        return [] if "://" in self._root else _files_under(self._root)

    def close(self) -> None:
        self._m.close()


class OrbaxSaver:
    """``ocp.CheckpointManager`` with default options and ``StandardSave``."""

    def __init__(self, root: str) -> None:
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self._root = root
        self._m = ocp.CheckpointManager(root)

    def save(self, step: int, state: Any) -> None:
        self._m.save(step, args=self._ocp.args.StandardSave(state))

    def wait(self) -> None:
        self._m.wait_until_finished()

    def restore(self, step: int, abstract: Any) -> Any:
        return self._m.restore(step, args=self._ocp.args.StandardRestore(abstract))

    def files(self) -> list[str]:
        return [] if "://" in self._root else _files_under(self._root)

    def close(self) -> None:
        self._m.close()


class BackgroundRawSaver(RawSaver):
    """The raw writer on a background thread: the floor for an async save's overhead."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._save, args=(step, state), daemon=True)
        self._thread.start()

    def _save(self, step: int, state: dict[str, Any]) -> None:
        try:
            super().save(step, state)
        except BaseException as e:
            self._error = e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error


def open_saver(spec: dict[str, Any]) -> Any:
    contender, root = spec["contender"], spec["root"]
    if contender == "raw":
        return BackgroundRawSaver(root) if spec["phase"] == "loop" else RawSaver(root)
    if contender.startswith("jaxckpt"):
        return JaxckptSaver(root, spec["jaxckpt_options"])
    if contender.startswith("orbax"):
        return OrbaxSaver(root)
    raise ValueError(f"unknown contender {contender!r}")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """Peak resident memory above the level at entry (``.extra``, bytes).

    Uses the kernel's high-water mark (reset on entry) and a psutil sampling
    thread (every 5 ms), and takes the larger of the two.
    """

    def __enter__(self) -> PeakRss:
        import psutil

        self._proc = psutil.Process()
        self.baseline = self._proc.memory_info().rss
        self._hwm_reset = _reset_peak_rss()
        self._sampled = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._sampled = max(self._sampled, self._proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        hwm = _status_bytes("VmHWM") if self._hwm_reset else 0
        self.extra = max(0, max(hwm, self._sampled) - self.baseline)


def drop_cache(files: list[str]) -> None:
    """fsync and POSIX_FADV_DONTNEED every file, so that reads go to the disk."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def same_values(state: dict[str, Any], restored: dict[str, Any]) -> bool:
    import numpy as np

    return state.keys() == restored.keys() and all(
        np.array_equal(np.asarray(state[k]), np.asarray(restored[k])) for k in state
    )


def warm_up(saver: Any) -> None:
    """A tiny save and restore (step 0): first-call costs are not measured."""
    import jax.numpy as jnp

    small = {"warmup": jnp.arange(1024, dtype=jnp.float32)}
    saver.save(0, small)
    saver.wait()
    saver.restore(0, abstract_of(small))


def timed_save(saver: Any, step: int, state: Any) -> tuple[float, float]:
    """``(blocking seconds, seconds until committed)`` of one save."""
    start = time.perf_counter()
    saver.save(step, state)
    blocking = time.perf_counter() - start
    saver.wait()
    return blocking, time.perf_counter() - start


def measure_io(spec: dict[str, Any], case: Case) -> dict[str, Any]:
    import jax

    state = make_state(case)
    abstract = abstract_of(state)
    saver = open_saver(spec)
    try:
        warm_up(saver)
        stored_before = _stored_bytes(saver.files())
        with PeakRss() as save_mem:
            blocking_s, commit_s = timed_save(saver, 1, state)
        stored = _stored_bytes(saver.files()) - stored_before
        if spec["cold_cache"]:
            drop_cache(saver.files())
        with PeakRss() as restore_mem:
            start = time.perf_counter()
            restored = jax.block_until_ready(saver.restore(1, abstract))
            restore_s = time.perf_counter() - start
        correct = same_values(state, restored)
    finally:
        saver.close()
    return {
        "blocking_s": blocking_s,
        "commit_s": commit_s,
        "restore_s": restore_s,
        "save_extra_rss": save_mem.extra,
        "restore_extra_rss": restore_mem.extra,
        "stored_bytes": stored,
        "correct": correct,
    }


def make_train_step() -> tuple[Callable[[Any], Any], Any]:
    """A jitted, CPU-bound step (four 512×512 matmuls) and its input."""
    import jax
    import jax.numpy as jnp

    w = jax.random.normal(jax.random.key(0), (512, 512), jnp.float32) / math.sqrt(512)

    @jax.jit
    def step(x: Any) -> Any:
        for _ in range(4):
            x = jnp.tanh(x @ w)
        return x

    x = jax.random.normal(jax.random.key(1), (512, 512), jnp.float32)
    return step, x


def measure_calibration() -> dict[str, Any]:
    step, x = make_train_step()
    for _ in range(5):
        x = step(x).block_until_ready()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        x = step(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times)}


def _steps(step: Callable[[Any], Any], x: Any, n: int) -> Any:
    for _ in range(n):
        x = step(x).block_until_ready()
    return x


def measure_loop(spec: dict[str, Any], case: Case) -> dict[str, Any]:
    """Pairs of loop segments of ``every`` steps: one plain, one that starts with a save.

    A saving segment ends when the save is committed, so its background work
    never spills into the next segment (a save still running after ``every``
    steps costs the wait, as the next ``save`` call would). Pairs alternate
    their order, and overhead is taken pair by pair, so slow drifts of the
    machine's load cancel.
    """
    state = make_state(case)
    step, x = make_train_step()
    saver = open_saver(spec)
    every = spec["every"]
    plain: list[float] = []
    saving: list[float] = []
    blocking: list[float] = []
    try:
        warm_up(saver)
        x = _steps(step, x, 3)
        for i in range(spec["saves"]):
            for with_save in (False, True) if i % 2 == 0 else (True, False):
                start = time.perf_counter()
                if with_save:
                    saver.save(i + 1, state)
                    blocking.append(time.perf_counter() - start)
                x = _steps(step, x, every)
                if with_save:
                    saver.wait()
                (saving if with_save else plain).append(time.perf_counter() - start)
    finally:
        saver.close()
    return {"plain_s": plain, "saving_s": saving, "blocking_s": blocking}


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    phase = spec["phase"]
    if phase == "calibrate":
        return measure_calibration()
    case = Case(**spec["case"])
    if phase == "io":
        return measure_io(spec, case)
    if phase == "loop":
        return measure_loop(spec, case)
    raise ValueError(f"unknown phase {phase!r}")


def run_as_child(spec_text: str) -> int:
    try:
        result = child_main(json.loads(spec_text))
    except Exception as e:
        result = {
            "error": f"{type(e).__name__}: {e}"[:2000],
            "trace": traceback.format_exc()[-4000:],
        }
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# Orchestrator side: no jax here, so that its memory and threads stay out of the way.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    cases: tuple[Case, ...]
    repeats: int
    out: Path
    root: Path
    cold_cache: bool
    object_stores: bool
    object_store_max_bytes: int
    loop_saves: int
    loop_min_interval_s: float
    loop_max_bytes: int
    jaxckpt_options: dict[str, Any]


def run_child(spec: dict[str, Any], *, timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Runs one measurement in a fresh interpreter; returns its result or ``{"error": ...}``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
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


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


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
    """Roots in the loopback buckets (in-memory servers: nothing to delete)."""

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
) -> dict[str, list[dict[str, Any]]]:
    """``repeats`` rounds of save + restore, contenders interleaved within each round."""
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
            try:
                result = run_child(spec, timeout_s=_timeout_for(case), env=env)
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
    samples: dict[str, list[dict[str, Any]]] = {c: [] for c in LOOP_CONTENDERS}
    loop_s = 2 * every * saves * step_s
    for r in range(s.repeats):
        for contender in LOOP_CONTENDERS:
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


def _ok(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [x for x in samples if "error" not in x]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize_io(samples: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    """Medians over the repeats; memory is the worst repeat."""
    ok = _ok(samples)
    out: dict[str, Any] = {
        "n": len(ok),
        "errors": [x["error"] for x in samples if "error" in x],
        "incorrect": sum(1 for x in ok if not x.get("correct", True)),
    }
    if not ok:
        return out
    commit = _median([x["commit_s"] for x in ok])
    restore = _median([x["restore_s"] for x in ok])
    out.update(
        blocking_s=_median([x["blocking_s"] for x in ok]),
        commit_s=commit,
        restore_s=restore,
        save_gbps=nbytes / commit / GB if commit else None,
        restore_gbps=nbytes / restore / GB if restore else None,
        save_rss=max(x["save_extra_rss"] for x in ok) / nbytes,
        restore_rss=max(x["restore_extra_rss"] for x in ok) / nbytes,
        stored_ratio=_median([x["stored_bytes"] / nbytes for x in ok]),
    )
    return out


def summarize_loop(
    samples: dict[str, list[dict[str, Any]]], io: dict[str, Any], every: int, saves: int
) -> dict[str, Any]:
    """Overhead per save: the median over pairs of (saving − plain segment), then over repeats."""
    out: dict[str, Any] = {"every": every, "saves": saves}
    for contender, results in samples.items():
        ok = _ok(results)
        entry: dict[str, Any] = {
            "n": len(ok),
            "errors": [x["error"] for x in results if "error" in x],
        }
        if ok:
            entry.update(
                overhead_s_per_save=_median([_pair_overhead(x) for x in ok]),
                plain_segment_s=_median([statistics.median(x["plain_s"]) for x in ok]),
                blocking_s_in_loop=_median([statistics.median(x["blocking_s"]) for x in ok]),
                blocking_s_alone=io.get(contender, {}).get("blocking_s"),
            )
        out[contender] = entry
    return out


# ---- targets --------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is not positive."""
    return a / b if a is not None and b is not None and b > 0 else None


def _get(summary: dict[str, Any], contender: str, key: str) -> float | None:
    return summary.get("io", {}).get(contender, {}).get(key)


def _vs(summary: dict[str, Any], key: str, other: str) -> float | None:
    """jaxckpt's ``key`` divided by ``other``'s."""
    return _ratio(_get(summary, "jaxckpt", key), _get(summary, other, key))


def _loop_ratio(summary: dict[str, Any]) -> float | None:
    loop = summary.get("loop", {}).get("jaxckpt", {})
    return _ratio(loop.get("overhead_s_per_save"), loop.get("blocking_s_alone"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """A goal for one ratio; ``kind`` is the case kind it applies to, or ``*``."""

    kind: str
    label: str
    bound_text: str
    measure: Callable[[dict[str, Any]], float | None]
    at_least: bool
    bound: float

    def check(self, summary: dict[str, Any]) -> dict[str, Any]:
        value = self.measure(summary)
        if value is None:
            verdict = "n/a"
        else:
            passed = value >= self.bound if self.at_least else value <= self.bound
            verdict = "PASS" if passed else "MISS"
        return {"target": self.label, "bound": self.bound_text, "value": value, "verdict": verdict}


TARGETS = (
    Target(
        kind="few-big",
        label="save throughput vs raw write+fsync",
        bound_text="≥ 0.85×",
        measure=lambda s: _vs(s, "save_gbps", "raw"),
        at_least=True,
        bound=0.85,
    ),
    Target(
        kind="few-big",
        label="restore throughput vs Orbax",
        bound_text="≥ 1.5×",
        measure=lambda s: _vs(s, "restore_gbps", "orbax"),
        at_least=True,
        bound=1.5,
    ),
    Target(
        kind="many-small",
        label="save throughput vs Orbax",
        bound_text="≥ 2×",
        measure=lambda s: _vs(s, "save_gbps", "orbax"),
        at_least=True,
        bound=2.0,
    ),
    Target(
        kind="many-small",
        label="restore throughput vs Orbax",
        bound_text="≥ 2×",
        measure=lambda s: _vs(s, "restore_gbps", "orbax"),
        at_least=True,
        bound=2.0,
    ),
    Target(
        kind="*",
        label="blocking time vs Orbax",
        bound_text="≤ 1×",
        measure=lambda s: _vs(s, "blocking_s", "orbax"),
        at_least=False,
        bound=1.0,
    ),
    Target(
        kind="*",
        label="peak extra RSS during save / state",
        bound_text="≤ 1.25×",
        measure=lambda s: _get(s, "jaxckpt", "save_rss"),
        at_least=False,
        bound=1.25,
    ),
    Target(
        kind="*",
        label="training-loop overhead / blocking alone",
        bound_text="≤ 1.5×",
        measure=_loop_ratio,
        at_least=False,
        bound=1.5,
    ),
)


def check_targets(case: Case, summary: dict[str, Any]) -> list[dict[str, Any]]:
    return [t.check(summary) for t in TARGETS if t.kind in ("*", case.kind)]


# ---- machine --------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
        return match.group(1).strip() if match else platform.processor() or "unknown"
    except OSError:
        return platform.processor() or "unknown"


def _disk_of(path: Path) -> str:
    """Device, file system and size of the file system holding ``path``."""
    best = ("?", "?", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, fstype = line.split()[:3]
                if str(path).startswith(mount) and len(mount) >= len(best[2]):
                    best = (device, fstype, mount)
    except OSError:
        pass
    device, fstype, mount = best
    total = shutil.disk_usage(path).total
    rotational = Path(f"/sys/block/{Path(device).name}/queue/rotational")
    kind = ""
    if rotational.exists():
        kind = ", rotational" if rotational.read_text().strip() == "1" else ", non-rotational"
    return f"{device} ({fstype} on {mount}, {total / GB:.0f} GB{kind})"


def _source_state() -> str:
    """The commit the benchmark ran against, and whether jaxckpt/ had local changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "jaxckpt"],
            capture_output=True,
            text=True,
            cwd=REPO,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head or 'unknown'}" + (" + uncommitted changes in jaxckpt/" if dirty else "")


def machine_info(root: Path) -> dict[str, Any]:
    import psutil

    versions = {}
    for name in ("jax", "jaxlib", "orbax-checkpoint", "tensorstore", "numpy", "jaxckpt"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": psutil.virtual_memory().total / GiB,
        "disk": _disk_of(root),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "versions": versions,
        "jaxckpt_source": _source_state(),
        "load_at_start": os.getloadavg(),
    }


def fits_in_memory(case: Case) -> str | None:
    """Why the case cannot run now, or None: state + restored copy + transient buffers."""
    import psutil

    need = 3 * case.nbytes + GiB
    available = psutil.virtual_memory().available
    if need > available:
        return f"needs ~{_size(need)} of memory, {_size(available)} available"
    return None


# ---- object stores ---------------------------------------------------------------------------


def _load_test_servers() -> ModuleType | None:
    path = REPO / "tests" / "servers.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("_bench_servers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@contextmanager
def object_stores(log_dir: Path) -> Iterator[tuple[dict[str, str], dict[str, str]]]:
    """Starts S3 and GCS servers on 127.0.0.1; yields (child env, bucket URI per store).

    The child environment sends every endpoint and credential lookup to loopback
    (``AWS_ENDPOINT_URL*`` matter: Orbax's path handling inside jaxckpt goes
    through s3fs, which otherwise contacts ``s3.amazonaws.com``).
    """
    servers = _load_test_servers()
    if servers is None:
        raise RuntimeError("tests/servers.py is missing: it starts moto_server and the emulator")
    saved_env = dict(os.environ)
    servers.isolate_cloud_env(os.environ, str(log_dir))  # boto3 here and in the children
    try:
        s3 = servers.start_moto(log_dir)
        try:
            gcs = servers.start_gcs_emulator(log_dir)
        except BaseException:
            s3.stop()
            raise
        env = child_env()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    env.update(
        AWS_ENDPOINT_URL_S3=s3.endpoint,
        AWS_ENDPOINT_URL=s3.endpoint,
        STORAGE_EMULATOR_HOST=gcs.endpoint,
        TENSORSTORE_GCS_HTTP_URL=gcs.endpoint,
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    try:
        yield env, {"s3": f"s3://{s3.bucket}", "gcs": f"gs://{gcs.bucket}"}
    finally:
        gcs.stop()
        s3.stop()


def run_store_rounds(
    s: Settings, case: Case, env: dict[str, str], buckets: dict[str, str]
) -> dict[str, Any]:
    samples = run_io_rounds(s, case, STORE_CONTENDERS, BucketRoots(buckets), env)
    return {c: summarize_io(x, case.nbytes) for c, x in samples.items()}


# ---- one case --------------------------------------------------------------------------------


def run_case(s: Settings, case: Case, step_s: Callable[[], float], stores: Any) -> dict[str, Any]:
    skip = fits_in_memory(case)
    if skip:
        _progress(f"case {case.label}: skipped, {skip}")
        return {"case": dataclasses.asdict(case), "skipped": skip}
    _progress(f"case {case.label}")
    scratch = Scratch(s.root)
    try:
        summary = _run_local_rounds(s, case, step_s, scratch)
    finally:
        scratch.flush()
    if stores is not None:
        if case.nbytes <= s.object_store_max_bytes:
            summary["stores"] = run_store_rounds(s, case, *stores)
        else:
            summary["stores_skipped"] = (
                f"state larger than --object-store-max-bytes ({_size(s.object_store_max_bytes)})"
            )
    summary["targets"] = check_targets(case, summary)
    return summary


def _run_local_rounds(
    s: Settings, case: Case, step_s: Callable[[], float], scratch: Scratch
) -> dict[str, Any]:
    env = child_env()
    samples = run_io_rounds(s, case, CONTENDERS, scratch, env)
    summary: dict[str, Any] = {
        "case": dataclasses.asdict(case),
        "samples": {"io": samples},
        "io": {c: summarize_io(x, case.nbytes) for c, x in samples.items()},
    }
    if case.nbytes <= s.loop_max_bytes:
        every, saves = loop_plan(s, summary["io"], step_s())
        loop = run_loop_rounds(s, case, (every, saves, step_s()), scratch, env)
        summary["samples"]["loop"] = loop
        summary["loop"] = summarize_loop(loop, summary["io"], every, saves)
        summary["loop"]["step_ms"] = step_s() * 1e3
    else:
        summary["loop_skipped"] = f"state larger than --loop-max-bytes ({_size(s.loop_max_bytes)})"
    return summary


# ---- report: markdown, chart, json ----------------------------------------------------------


def _f(value: float | None, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}{unit}"


def _cell(io: dict[str, Any], contender: str, key: str, scale: float = 1.0, digits: int = 2) -> str:
    entry = io.get(contender, {})
    if not entry.get("n"):
        return "error" if entry.get("errors") else "–"
    return _f(entry.get(key), scale, digits)


def _verdicts(summary: dict[str, Any], label: str) -> str:
    hits = [t for t in summary.get("targets", []) if t["target"] == label]
    return "; ".join(f"{t['bound']} → **{t['verdict']}**" for t in hits) or ""


def _io_rows(summary: dict[str, Any]) -> list[str]:
    io = summary["io"]
    j = lambda key: _get(summary, "jaxckpt", key)  # noqa: E731
    o = lambda key: _get(summary, "orbax", key)  # noqa: E731
    r = lambda key: _get(summary, "raw", key)  # noqa: E731
    rows = [
        (
            "save: blocking (ms)",
            "blocking_s",
            1e3,
            1,
            f"{_f(_ratio(j('blocking_s'), o('blocking_s')))}× Orbax",
            "blocking time vs Orbax",
        ),
        ("save: until committed (s)", "commit_s", 1.0, 3, "", ""),
        (
            "save throughput (GB/s)",
            "save_gbps",
            1.0,
            3,
            f"{_f(_ratio(j('save_gbps'), r('save_gbps')))}× raw, "
            f"{_f(_ratio(j('save_gbps'), o('save_gbps')))}× Orbax",
            "save throughput vs raw write+fsync|save throughput vs Orbax",
        ),
        (
            "restore throughput (GB/s)",
            "restore_gbps",
            1.0,
            3,
            f"{_f(_ratio(j('restore_gbps'), r('restore_gbps')))}× raw, "
            f"{_f(_ratio(j('restore_gbps'), o('restore_gbps')))}× Orbax",
            "restore throughput vs Orbax",
        ),
        (
            "peak extra RSS, save (× state)",
            "save_rss",
            1.0,
            2,
            "",
            "peak extra RSS during save / state",
        ),
        ("peak extra RSS, restore (× state)", "restore_rss", 1.0, 2, "", ""),
        ("bytes stored (× state)", "stored_ratio", 1.0, 3, "", ""),
    ]
    out = []
    for name, key, scale, digits, ratio, labels in rows:
        verdict = "; ".join(filter(None, (_verdicts(summary, x) for x in labels.split("|"))))
        cells = [_cell(io, c, key, scale, digits) for c in CONTENDERS]
        if key == "blocking_s":
            cells[0] = "(= commit)"
        out.append(f"| {name} | {' | '.join(cells)} | {ratio} | {verdict} |")
    return out


def _loop_rows(summary: dict[str, Any]) -> list[str]:
    loop = summary.get("loop")
    if not loop:
        return [f"| training loop | {summary.get('loop_skipped', 'not run')} | | | | |"]
    r, j, o = (loop.get(c, {}) for c in LOOP_CONTENDERS)
    overhead = [_f(x.get("overhead_s_per_save"), 1e3, 1) for x in (r, j, o)]
    in_loop = [_f(x.get("blocking_s_in_loop"), 1e3, 1) for x in (r, j, o)]
    ratios = (
        f"{_f(_ratio(j.get('overhead_s_per_save'), j.get('blocking_s_alone')))}× its blocking"
        f" alone, {_f(_ratio(j.get('overhead_s_per_save'), r.get('overhead_s_per_save')))}×"
        f" the raw writer thread's overhead (Orbax"
        f" {_f(_ratio(o.get('overhead_s_per_save'), o.get('blocking_s_alone')))}× its blocking)"
    )
    head = (
        f"training loop ({loop['saves']} saves, one every {loop['every']} steps of "
        f"{loop['step_ms']:.1f} ms, against as many steps without a save; raw = the raw writer"
        " on a background thread)"
    )
    verdict = _verdicts(summary, "training-loop overhead / blocking alone")
    return [
        f"| {head}: overhead per save (ms) | {' | '.join(overhead)} | {ratios} | {verdict} |",
        f"| training loop: blocking per save in the loop (ms) | {' | '.join(in_loop)} | | |",
    ]


def _store_rows(summary: dict[str, Any]) -> list[str]:
    stores = summary.get("stores")
    if not stores:
        return []
    out = [
        "",
        "Object stores on loopback (informational; in-memory servers, one request at a time for"
        " the GCS emulator):",
        "",
        "| store | blocking (ms) | save (s) | save (MB/s) | restore (s) | restore (MB/s) |"
        " peak extra RSS save / restore (× state) | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, e in stores.items():
        errors = "; ".join(x.splitlines()[0][:120] for x in e.get("errors", []))
        cells = [
            _f(e.get("blocking_s"), 1e3, 1),
            _f(e.get("commit_s"), digits=3),
            _f(e.get("save_gbps"), 1e3, 1),
            _f(e.get("restore_s"), digits=3),
            _f(e.get("restore_gbps"), 1e3, 1),
            f"{_f(e.get('save_rss'))} / {_f(e.get('restore_rss'))}",
            errors,
        ]
        out.append(f"| {name} | {' | '.join(cells)} |")
    return out


def _case_section(summary: dict[str, Any]) -> list[str]:
    case = Case(**summary["case"])
    lines = [f"### {case.label}", ""]
    if "skipped" in summary:
        return [*lines, f"Skipped: {summary['skipped']}.", ""]
    lines += [
        "| metric | raw write+fsync | jaxckpt | Orbax | jaxckpt ratio | target |",
        "|---|---|---|---|---|---|",
        *_io_rows(summary),
        *_loop_rows(summary),
    ]
    errors = [
        f"- {c}: {e.splitlines()[0][:300]}"
        for c, entry in summary["io"].items()
        for e in entry.get("errors", [])
    ]
    if errors:
        lines += ["", "Errors:", *errors]
    wrong = [c for c, entry in summary["io"].items() if entry.get("incorrect")]
    if wrong:
        lines += ["", f"**Restored values differ from the saved ones:** {', '.join(wrong)}"]
    return [*lines, *_store_rows(summary), ""]


def _target_table(summaries: list[dict[str, Any]]) -> list[str]:
    lines = ["| case | target | measured | bound | result |", "|---|---|---|---|---|"]
    for summary in summaries:
        for t in summary.get("targets", []):
            lines.append(
                f"| {summary['case']['name']} | {t['target']} | {_f(t['value'])}× | {t['bound']} "
                f"| **{t['verdict']}** |"
            )
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    m, st = report["machine"], report["settings"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    lines = [
        "# jaxckpt benchmark: against the disk and against Orbax",
        "",
        f"- Date: {m['date']}",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']:.1f} GiB RAM; "
        f"disk {m['disk']}; Linux {m['kernel']}, Python {m['python']}",
        f"- Versions: {versions}; jaxckpt source: {m.get('jaxckpt_source', 'unknown')}",
        f"- Load average at start / end: {_load(m['load_at_start'])} / {_load(m['load_at_end'])}",
        f"- Repeats: {st['repeats']}, contenders interleaved ({', '.join(CONTENDERS)}), each "
        "measurement in a fresh process after a warm-up save; medians over repeats, peak memory "
        "is the worst repeat.",
        f"- Restore reads: {'from the disk (fsync + POSIX_FADV_DONTNEED on every file first, for all contenders)' if st['cold_cache'] else 'page cache left warm for all contenders'}.",  # noqa: E501
        f"- jaxckpt options: {st['jaxckpt_options'] or 'defaults'}; Orbax: "
        "`ocp.CheckpointManager` defaults + `StandardSave`.",
        "- Throughput is state bytes / seconds (save: from the call until committed).",
        "",
        "## Targets",
        "",
        *_target_table(report["cases"]),
        "",
        "## Cases",
        "",
    ]
    for summary in report["cases"]:
        lines += _case_section(summary)
    return "\n".join(lines) + "\n"


def _load(values: Any) -> str:
    return " ".join(f"{v:.2f}" for v in values) if values else "?"


COLORS = {"raw": "#8c8c8c", "jaxckpt": "#1f77b4", "orbax": "#ff7f0e"}
LIGHT = {"raw": "#cccccc", "jaxckpt": "#9ecae1", "orbax": "#fdd0a2"}


def _bars(
    ax: Any,
    groups: list[str],
    series: dict[str, list[float | None]],
    title: str,
    *,
    log: bool = False,
) -> None:
    """Grouped bars; a series named ``"<contender> ..."`` gets the contender's colour."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        contender = name.split()[0]
        color = (LIGHT if "blocking" in name else COLORS).get(contender)
        heights = [v if v is not None else 0.0 for v in values]
        ax.bar(xs, heights, width, label=name, color=color)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def render_chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [s for s in report["cases"] if "io" in s]
    groups = [s["case"]["name"] for s in done]

    def io_series(key: str, contenders: tuple[str, ...], scale: float = 1.0) -> dict[str, Any]:
        return {
            c: [None if (v := _get(s, c, key)) is None else v * scale for s in done]
            for c in contenders
        }

    def loop_series() -> dict[str, Any]:
        out: dict[str, list[float | None]] = {}
        for c in LOOP_CONTENDERS:
            if c != "raw":
                out[f"{c} blocking alone"] = [_loop_get(s, c, "blocking_s_alone") for s in done]
            out[f"{c} loop overhead"] = [_loop_get(s, c, "overhead_s_per_save") for s in done]
        return {k: [v * 1e3 if v is not None else None for v in vs] for k, vs in out.items()}

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    save, restore = io_series("save_gbps", CONTENDERS), io_series("restore_gbps", CONTENDERS)
    _bars(axes[0, 0], groups, save, "save throughput (GB/s, log)", log=True)
    _bars(axes[0, 1], groups, restore, "restore throughput (GB/s, log)", log=True)
    blocking = io_series("blocking_s", CONTENDERS[1:], 1e3)
    _bars(axes[0, 2], groups, blocking, "save blocking (ms, log)", log=True)
    _bars(axes[1, 0], groups, io_series("save_rss", CONTENDERS), "peak extra RSS, save (× state)")
    restore_rss = io_series("restore_rss", CONTENDERS)
    _bars(axes[1, 1], groups, restore_rss, "peak extra RSS, restore (× state)")
    _bars(axes[1, 2], groups, loop_series(), "training loop: ms per save (raw: writer thread)")
    axes[1, 0].axhline(1.25, color="red", lw=0.8, ls="--")
    fig.suptitle(f"jaxckpt vs raw disk vs Orbax — {report['machine']['date']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _loop_get(summary: dict[str, Any], contender: str, key: str) -> float | None:
    return summary.get("loop", {}).get(contender, {}).get(key)


def write_outputs(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "bench.md").write_text(render_markdown(report))
    render_chart(report, out / "bench.png")


# ---- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", help=f"comma-separated: {', '.join(CASES)} (default {DEFAULT_CASES})")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "results")
    p.add_argument("--root", type=Path, help="scratch directory (default: a temp dir on /work)")
    p.add_argument("--tiny", action="store_true", help=f"smoke-test sizes ({TINY_CASES})")
    p.add_argument("--warm-cache", action="store_true", help="do not evict files before restore")
    p.add_argument("--object-stores", action="store_true", help="add loopback S3 and GCS rows")
    p.add_argument("--object-store-max-bytes", type=int, default=256 * MiB)
    p.add_argument("--loop-saves", type=int, default=3, help="saves per training-loop run")
    p.add_argument("--loop-max-bytes", type=int, default=GiB, help="larger states skip the loop")
    p.add_argument("--chunk-bytes", type=int, help="jaxckpt chunk_bytes")
    p.add_argument("--max-inflight-bytes", type=int, help="jaxckpt max_inflight_bytes")
    p.add_argument("--io-concurrency", type=int, help="jaxckpt local file_io_concurrency")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def jaxckpt_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if args.chunk_bytes:
        options["chunk_bytes"] = args.chunk_bytes
    if args.max_inflight_bytes:
        options["max_inflight_bytes"] = args.max_inflight_bytes
    if args.io_concurrency:
        options["storage_options"] = {"io_concurrency": args.io_concurrency}
    return options


def make_settings(args: argparse.Namespace, root: Path) -> Settings:
    names = (args.cases or (TINY_CASES if args.tiny else DEFAULT_CASES)).split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    return Settings(
        cases=tuple(CASES[n.strip()] for n in names),
        repeats=args.repeats,
        out=args.out,
        root=root,
        cold_cache=not args.warm_cache,
        object_stores=args.object_stores,
        object_store_max_bytes=args.object_store_max_bytes,
        loop_saves=2 if args.tiny else args.loop_saves,
        loop_min_interval_s=0.2 if args.tiny else 2.0,
        loop_max_bytes=args.loop_max_bytes,
        jaxckpt_options=jaxckpt_options(args),
    )


@contextmanager
def scratch_root(requested: Path | None) -> Iterator[Path]:
    """``--root`` or a fresh directory under ``results/tmp`` (on the same disk as /work)."""
    base = requested or REPO / "results" / "tmp"
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-", dir=base))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_all(s: Settings) -> dict[str, Any]:
    env = child_env()
    step_cache: list[float] = []

    def step_s() -> float:
        if not step_cache:
            step_cache.append(calibrate_step(s, env))
        return step_cache[0]

    report: dict[str, Any] = {"machine": machine_info(s.root), "cases": []}
    report["settings"] = {
        "cases": [c.name for c in s.cases],
        "repeats": s.repeats,
        "cold_cache": s.cold_cache,
        "jaxckpt_options": s.jaxckpt_options,
        "object_stores": s.object_stores,
    }
    with _maybe_object_stores(s) as stores:
        for case in s.cases:
            report["cases"].append(run_case(s, case, step_s, stores))
    report["machine"]["load_at_end"] = os.getloadavg()
    return report


@contextmanager
def _maybe_object_stores(s: Settings) -> Iterator[Any]:
    if not s.object_stores:
        yield None
        return
    log_dir = Path(tempfile.mkdtemp(prefix="servers-", dir=s.root))
    with object_stores(log_dir) as stores:
        yield stores


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return run_as_child(args.child)
    with scratch_root(args.root) as root:
        settings = make_settings(args, root)
        started = time.perf_counter()
        report = run_all(settings)
        report["elapsed_s"] = time.perf_counter() - started
    write_outputs(report, settings.out)
    _progress(f"wrote {settings.out / 'bench.md'}, bench.png, bench.json")
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
