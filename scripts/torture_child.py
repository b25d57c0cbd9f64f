"""One writer process of the torture run (``scripts/torture.py``): opens a root and saves.

Usage::

    python scripts/torture_child.py ROOT --seed S [--kib K] [--start N | --start next]
        [--steps K] [--restore] [--keep-last K] [--go] [--storage-options JSON]

It opens a writable ``jaxckpt.CheckpointManager`` (taking a new writer epoch),
optionally restores the newest step and checks it bit for bit, then saves
steps ``N .. N+K-1`` (``next``: from the newest committed step + 1), waiting
for each commit. Step ``s`` written by writer ``S`` holds :func:`make_state`
``(S, s, K)``; the ``writer`` leaf names ``S``, so whoever restores a step can
recompute what it must contain.

Every line on stdout is ``<unix time> <EVENT> [args]``; the events are
``READY``, ``OPENING``, ``OPENED <epoch>``, ``RESTORED <step> <writer> ok|bad``,
``SAVING <s>``, ``SAVED <s>``, ``COMMITTED <s>``, ``EXISTS <s>``,
``FAILED <s> <error class> <message>``, ``FENCED <s> <message>``,
``PHASE before_marker <s>`` (the moment just before the commit marker is
written, from jaxckpt's phase hook), ``CLOSED`` and ``ERROR <class> <message>``
(an exception that is not a ``CheckpointError``: exit code 1). A fenced
writer exits with code 3.

With ``--go`` it prints ``READY`` once jax and jaxckpt are imported and
reads ``GO <open at> <save at>`` (unix times, 0: now) from stdin, so the
parent can start several writers at one wall-clock instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from typing import Any, TextIO

import numpy as np

CHUNK_BYTES = 64 << 10  # small chunks: even a small state has several per array
MARKER_PHASE = "before_marker"
EXIT_FENCED = 3


def make_state(seed: int, step: int, kib: float) -> dict[str, Any]:
    """The state writer ``seed`` saves as ``step``: about ``kib`` KiB of numpy leaves and values."""
    import ml_dtypes

    rng = np.random.default_rng([seed, step, 20261130])
    total = max(int(kib * 1024), 16 << 10)
    cols = 128
    rows = max(2, total // 2 // (4 * cols) // 2 * 2)  # even: splits over 2 devices
    special = rng.standard_normal(max(8, total // 8 // 4), dtype=np.float32)
    special[:4] = [np.nan, np.inf, -np.inf, -0.0]
    return {
        "params": {
            "w": rng.standard_normal((rows, cols), dtype=np.float32),
            "emb": rng.standard_normal((max(1, total // 4 // 256), 128), dtype=np.float32).astype(
                ml_dtypes.bfloat16
            ),
        },
        "opt": {
            "mu": special,
            "count": np.asarray(step, dtype=np.int32),
            "mask": rng.random(333) < 0.5,
            "ids": rng.integers(-(2**62), 2**62, size=max(1, total // 8 // 8), dtype=np.int64),
        },
        "writer": seed,
        "step": step,
        "lr": float(rng.random()),
        "tag": f"writer-{seed}",
        "none": None,
    }


def device_state(seed: int, step: int, kib: float) -> dict[str, Any]:
    """:func:`make_state` with ``w`` a ``jax.Array`` sharded over the local devices."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    state = make_state(seed, step, kib)
    devices = jax.local_devices()
    w = state["params"]["w"]
    if len(devices) > 1 and w.shape[0] % len(devices) == 0:
        sharding = NamedSharding(Mesh(np.array(devices), ("d",)), PartitionSpec("d", None))
        state["params"]["w"] = jax.device_put(w, sharding)
    else:
        state["params"]["w"] = jax.device_put(w)
    state["opt"]["count"] = jax.device_put(state["opt"]["count"])
    return state


def differences(actual: Any, expected: Any, where: str = "") -> list[str]:
    """How ``actual`` differs from ``expected`` (same nesting, leaf types, dtypes and bytes)."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or sorted(actual) != sorted(expected):
            keys = sorted(actual) if isinstance(actual, dict) else type(actual).__name__
            return [f"{where or '/'}: keys {keys} != {sorted(expected)}"]
        return [d for k in expected for d in differences(actual[k], expected[k], f"{where}/{k}")]
    if isinstance(expected, np.ndarray):
        if not isinstance(actual, np.ndarray):
            return [f"{where}: {type(actual).__name__}, not an ndarray"]
        if (actual.dtype, actual.shape) != (expected.dtype, expected.shape):
            return [f"{where}: {actual.dtype}{actual.shape} != {expected.dtype}{expected.shape}"]
        a = np.ascontiguousarray(actual).reshape(-1).view(np.uint8)
        e = np.ascontiguousarray(expected).reshape(-1).view(np.uint8)
        if not np.array_equal(a, e):
            return [f"{where}: {int(np.count_nonzero(a != e))} bytes differ"]
        return []
    if type(actual) is not type(expected) or actual != expected:
        return [f"{where}: {actual!r} != {expected!r}"]
    return []


def check_restored(restored: Any, step: int, kib_of: Any) -> tuple[int | None, list[str]]:
    """The writer a restored ``step`` names and how it differs from that writer's state.

    Args:
      kib_of: the state size of a writer (``kib_of(seed)``), or None if unknown.
    """
    writer = restored.get("writer") if isinstance(restored, dict) else None
    if not isinstance(writer, int):
        return None, [f"step {step}: no writer leaf ({type(restored).__name__})"]
    kib = kib_of(writer)
    if kib is None:
        return writer, [f"step {step}: names writer {writer}, which never saved under this root"]
    return writer, [
        f"step {step}: {d}" for d in differences(restored, make_state(writer, step, kib))
    ]


class _Events:
    """Timestamped event lines on stdout, safe from several threads."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._lock = threading.Lock()

    def __call__(self, event: str, *args: object) -> None:
        text = " ".join([f"{time.time():.6f}", event, *map(str, args)])
        with self._lock:
            self._out.write(text.replace("\n", " ") + "\n")
            self._out.flush()


class _PhaseTap:
    """Wraps stderr: jaxckpt's ``JAXCKPT_PHASE`` lines become timestamped events."""

    def __init__(self, stream: TextIO, say: _Events) -> None:
        self._stream = stream
        self._say = say
        self._buf = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            now = time.time()
            self._buf += text
            lines = self._buf.split("\n")
            self._buf = lines.pop()
        for line in lines:
            if line.startswith("JAXCKPT_PHASE "):
                _, phase, step = line.split()
                self._say("PHASE", phase, step, f"at={now:.6f}")
            else:
                self._stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="One writer of the torture run.")
    p.add_argument("root")
    p.add_argument("--seed", type=int, required=True, help="the writer id")
    p.add_argument("--kib", type=float, default=256.0, help="state size in KiB")
    p.add_argument("--start", default="next", help="first step, or 'next'")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--restore", action="store_true", help="restore the newest step first")
    p.add_argument("--keep-last", type=int, default=None, help="retention: keep the K newest")
    p.add_argument("--go", action="store_true", help="wait for 'GO <open at> <save at>' on stdin")
    p.add_argument("--storage-options", default="{}", help="JSON object")
    return p.parse_args(argv)


def _sleep_until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        time.sleep(delay)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:600]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    say = _Events(sys.stdout)
    # jaxckpt prints "JAXCKPT_PHASE <phase> <step>" to stderr at this phase and sleeps 0 s.
    os.environ["JAXCKPT_PAUSE_AT"] = MARKER_PHASE
    os.environ["JAXCKPT_PAUSE_S"] = "0"
    sys.stderr = _PhaseTap(sys.stderr, say)

    import jax

    import jaxckpt
    from jaxckpt import policy

    jax.devices()
    open_at = save_at = 0.0
    if args.go:
        say("READY")
        words = sys.stdin.readline().split()
        if len(words) != 3 or words[0] != "GO":
            say("ERROR", "ValueError", f"expected 'GO <open at> <save at>', got {words!r}")
            return 1
        open_at, save_at = float(words[1]), float(words[2])
    _sleep_until(open_at)
    step: int | str = "-"
    try:
        say("OPENING")
        manager = jaxckpt.CheckpointManager(
            args.root,
            chunk_bytes=CHUNK_BYTES,
            retention=None if args.keep_last is None else policy.KeepLast(args.keep_last),
            storage_options=json.loads(args.storage_options),
            save_timeout_s=120.0,
        )
        say("OPENED", manager.epoch)
        latest = manager.latest_step()
        if args.restore and latest is not None:
            restored = manager.restore(latest)
            writer, problems = check_restored(restored, latest, lambda _: args.kib)
            say("RESTORED", latest, writer, "ok" if not problems else "bad " + "; ".join(problems))
        first = (latest or 0) + 1 if args.start == "next" else int(args.start)
        state = device_state(args.seed, first, args.kib) if args.steps else None
        _sleep_until(save_at)
        try:
            for step in range(first, first + args.steps):
                say("SAVING", step)
                try:
                    manager.save(step, state)
                    say("SAVED", step)
                    state = device_state(args.seed, step + 1, args.kib)
                    manager.wait()
                    say("COMMITTED", step)
                except jaxckpt.StepAlreadyExistsError:
                    say("EXISTS", step)
                    state = device_state(args.seed, step + 1, args.kib)
                except jaxckpt.WriterFencedError:
                    raise
                except jaxckpt.CheckpointError as e:
                    say("FAILED", step, type(e).__name__, _one_line(e))
            step = "-"
        finally:
            manager.close()
        say("CLOSED")
        return 0
    except jaxckpt.WriterFencedError as e:
        say("FENCED", step, _one_line(e))
        return EXIT_FENCED
    except jaxckpt.CheckpointError as e:
        say("FAILED", step, type(e).__name__, _one_line(e))
        return 2
    except Exception as e:
        traceback.print_exc()
        say("ERROR", type(e).__name__, _one_line(e))
        return 1


if __name__ == "__main__":
    sys.exit(main())
