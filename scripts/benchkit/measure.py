"""The child process: one measurement (save + restore, training loop, calibration)."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from benchkit.common import RESULT_MARK, Case
from benchkit.contenders import _stored_bytes, abstract_of, make_state, open_saver


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
    thread (every 5 ms; ``sample=False``: none, where a thread polling under the
    GIL would slow what is measured), and takes the larger of the two.
    """

    def __init__(self, *, sample: bool = True) -> None:
        self._sampling = sample

    def __enter__(self) -> PeakRss:
        import psutil

        self._proc = psutil.Process()
        self.baseline = self._proc.memory_info().rss
        self._hwm_reset = _reset_peak_rss()
        self._sampled = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        if self._sampling or not self._hwm_reset:
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._sampled = max(self._sampled, self._proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        hwm = _status_bytes("VmHWM") if self._hwm_reset else 0
        self.extra = max(0, max(hwm, self._sampled) - self.baseline)


def drop_cache(files: list[str]) -> None:
    """fsync and POSIX_FADV_DONTNEED every file, so that reads go to the disk.

    A file gone since the listing is skipped: a committed step's pending record
    is removed in the background after the save returns (``jaxckpt.commit._tidy``)."""
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
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


_REQUEST = re.compile(r'"(?:\x1b\[[0-9;]*m)*([A-Z]+) (\S+) HTTP/[0-9.]+(?:\x1b\[[0-9;]*m)*" (\d+)')


class RequestLog:
    """Counts the HTTP requests a loopback server logged (moto and the GCS emulator
    log one ``"METHOD path HTTP/1.1" status`` line per request)."""

    def __init__(self, path: str | None) -> None:
        self._path = path
        self._offset = self._size()

    def _size(self) -> int:
        return os.path.getsize(self._path) if self._path else 0

    def mark(self) -> dict[str, int] | None:
        """Requests by method since the previous mark (None without a server log)."""
        if not self._path:
            return None
        # complete: each server logs a request before it answers it (send_response)
        with open(self._path, "rb") as f:
            f.seek(self._offset)
            text = f.read().decode("utf-8", "replace")
            self._offset = f.tell()
        counts: dict[str, int] = {}
        for method, _, _ in _REQUEST.findall(text):
            counts[method] = counts.get(method, 0) + 1
        return counts


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


def _empty_bucket_root(root: str) -> None:
    """Deletes what a measurement wrote to a loopback bucket.

    The servers keep every object in memory: left there, each round's 256 MiB
    grew them by gigabytes over a run.
    """
    if root.startswith(("gs://", "s3://")):
        from jaxckpt.storage import open_storage

        open_storage(root).delete_prefix("")


def measure_io(spec: dict[str, Any], case: Case) -> dict[str, Any]:
    import jax

    state = make_state(case)
    abstract = abstract_of(state)
    saver = open_saver(spec)
    requests = RequestLog(spec.get("server_log"))
    try:
        warm_up(saver)
        stored_before = _stored_bytes(saver.files())
        requests.mark()
        with PeakRss() as save_mem:
            blocking_s, commit_s = timed_save(saver, 1, state)
        save_requests = requests.mark()
        stored = _stored_bytes(saver.files()) - stored_before
        if spec["cold_cache"]:
            drop_cache(saver.files())
        with PeakRss() as restore_mem:
            start = time.perf_counter()
            restored = jax.block_until_ready(saver.restore(1, abstract))
            restore_s = time.perf_counter() - start
        restore_requests = requests.mark()
        correct = same_values(state, restored)
    finally:
        saver.close()
        _empty_bucket_root(spec["root"])
    return {
        "save_requests": save_requests,
        "restore_requests": restore_requests,
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
