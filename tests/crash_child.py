"""A checkpoint writer for the crash tests: saves deterministic states until it is killed.

Usage::

    python tests/crash_child.py ROOT --start N --steps K --mb M [--seed S]
        [--delete STEP] [--arm save:STEP | --arm delete:STEP] [--no-gc]
        [--storage-options JSON] [--layout plain|packed]
        [--end-in PHASE:STEP:FRACTION]

It opens ``jaxckpt.CheckpointManager(ROOT)`` and saves steps ``N .. N+K-1``,
printing ``SAVED s`` to stdout once ``save()`` returns and ``COMMITTED s``
once ``wait()`` returns (the next state is computed in between, while the save
is written in the background); with ``--delete`` it then deletes that step and
prints ``DELETED s``. Step ``s`` holds :func:`host_state` ``(seed, s, mb)``,
so the parent can recompute exactly what a step must contain.

``JAXCKPT_PAUSE_AT`` (see ``jaxckpt/commit/_phases.py``) pauses at the first save or
delete that reaches the phase. ``--arm OP:STEP`` narrows that to one
operation: the variable is removed at start-up and put back just before that
save or delete, so a single process can commit a few steps and then pause in
a later one.

``--end-in PHASE:STEP:FRACTION`` (with ``JAXCKPT_TRACE=1``) ends the process
while it runs: when step ``STEP`` announces ``PHASE``, a kernel timer is set
to ``FRACTION`` of the time that phase lasted in the step before (from its
announcement to the next one), and on expiry SIGALRM, with no handler, ends
the process the way SIGKILL does (no user code runs). The child times its
own phases, so the kill's instant does not depend on how soon a parent reads
its output.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any, TextIO

import numpy as np

CHUNK_BYTES = 1 << 20  # 1 MiB chunks, so the large leaves have many chunks
PAUSE_ENV = "JAXCKPT_PAUSE_AT"


def host_state(seed: int, step: int, mb: float) -> dict[str, Any]:
    """The state saved as ``step``: numpy arrays and Python values, about ``mb`` MiB.

    Leaves: a multi-chunk float32 matrix, a bfloat16 embedding, int32/int64
    and bool arrays, float32 with NaN/inf/-0.0 bit patterns, a 0-d counter,
    and Python int/float/str/None values.
    """
    import ml_dtypes

    rng = np.random.default_rng([seed, step])
    total = max(int(mb * (1 << 20)), 1 << 16)
    cols = 256
    w_rows = max(2, total // 2 // (4 * cols) // 2 * 2)  # even, so it splits over 2 devices
    emb_rows = max(1, total // 4 // (2 * 128))
    n_mu = max(8, total // 8 // 4)
    n_ids = max(1, total // 8 // 8)
    mu = rng.standard_normal(n_mu, dtype=np.float32)
    mu[:4] = [np.nan, np.inf, -np.inf, -0.0]
    return {
        "params": {
            "w": rng.standard_normal((w_rows, cols), dtype=np.float32),
            "emb": rng.standard_normal((emb_rows, 128), dtype=np.float32).astype(
                ml_dtypes.bfloat16
            ),
            "bias": rng.integers(-(2**31), 2**31 - 1, size=(3, 5), dtype=np.int32),
        },
        "opt": {
            "mu": mu,
            "count": np.asarray(step, dtype=np.int32),
            "mask": rng.random(1000) < 0.5,
        },
        "ids": rng.integers(-(2**62), 2**62, size=n_ids, dtype=np.int64),
        "step": step,
        "lr": float(rng.random()),
        "name": f"run-{seed}",
        "none": None,
    }


def device_state(seed: int, step: int, mb: float) -> dict[str, Any]:
    """:func:`host_state` with some leaves as ``jax.Array``; ``w`` sharded over the devices."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    state = host_state(seed, step, mb)
    devices = jax.local_devices()
    if len(devices) > 1 and state["params"]["w"].shape[0] % len(devices) == 0:
        mesh = Mesh(np.array(devices), ("d",))
        sharding = NamedSharding(mesh, PartitionSpec("d", None))
        state["params"]["w"] = jax.device_put(state["params"]["w"], sharding)
    else:
        state["params"]["w"] = jax.device_put(state["params"]["w"])
    state["params"]["emb"] = jax.device_put(state["params"]["emb"])
    state["opt"]["count"] = jax.device_put(state["opt"]["count"])
    return state


class _EndIn:
    """A stderr that watches the ``JAXCKPT_TRACE`` lines written through it and
    arms the timer of ``--end-in`` (see the module docstring)."""

    def __init__(self, stream: TextIO, phase: str, step: int, fraction: float) -> None:
        self._stream = stream
        self._target = (phase, step)
        self._fraction = fraction
        self._lock = threading.Lock()
        self._partial = ""
        self._announced: list[tuple[str, int, float]] = []  # (phase, step, monotonic s)

    def write(self, text: str) -> int:
        now = time.monotonic()
        n = self._stream.write(text)
        with self._lock:
            *lines, self._partial = (self._partial + text).split("\n")
            for line in lines:
                if line.startswith("JAXCKPT_TRACE "):
                    _, phase, step = line.split()
                    self._announce(phase, int(step), now)
        return n

    def _announce(self, phase: str, step: int, at: float) -> None:
        self._announced.append((phase, step, at))
        if (phase, step) != self._target:
            return
        before = [i for i, (p, s, _) in enumerate(self._announced) if (p, s) == (phase, step - 1)]
        if not before or before[0] + 1 >= len(self._announced):
            self._stream.write(f"END_IN_UNTIMED {phase} of step {step - 1} was not traced\n")
            self._stream.flush()
            os._exit(3)  # from any thread; the parent sees the wrong exit status
        lasted = self._announced[before[0] + 1][2] - self._announced[before[0]][2]
        # 0 would disarm the timer; 1 microsecond is "at once".
        signal.setitimer(signal.ITIMER_REAL, max(self._fraction * lasted, 1e-6))

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Saves deterministic states until killed.")
    p.add_argument("root")
    p.add_argument("--start", type=int, default=1)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--mb", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--delete", type=int, default=None, help="delete this step after saving")
    p.add_argument("--arm", default=None, help="save:STEP or delete:STEP")
    p.add_argument("--no-gc", action="store_true", help="open with gc_on_open=False")
    p.add_argument("--storage-options", default="{}", help="JSON object")
    p.add_argument(
        "--layout", default=None, help="CheckpointOptions.layout (default: the library's)"
    )
    p.add_argument("--end-in", default=None, help="PHASE:STEP:FRACTION (see the docstring)")
    args = p.parse_args(argv)
    if args.end_in is not None:
        end_in = args.end_in
        phase, _, rest = end_in.partition(":")
        step, _, fraction = rest.partition(":")
        try:
            args.end_in = (phase, int(step), float(fraction))
        except ValueError:
            args.end_in = None
        if args.end_in is None or args.end_in[1] < 2 or not 0 <= args.end_in[2] <= 1:
            p.error(
                f"--end-in takes PHASE:STEP:FRACTION (STEP >= 2, 0 <= FRACTION <= 1): {end_in!r}"
            )
    if args.arm is not None:
        op, _, step = args.arm.partition(":")
        if op not in ("save", "delete") or not step.isdigit():
            p.error(f"--arm takes save:STEP or delete:STEP, got {args.arm!r}")
        args.arm = (op, int(step))
    return args


def _say(text: str) -> None:
    print(text, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    pause_at = os.environ.pop(PAUSE_ENV, None) if args.arm is not None else None
    if args.end_in is not None:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the timer's signal ends the process
        sys.stderr = _EndIn(sys.stderr, *args.end_in)

    def arm(op: str, step: int) -> None:
        if pause_at is not None and args.arm == (op, step):
            os.environ[PAUSE_ENV] = pause_at

    import jaxckpt

    layout = {} if args.layout is None else {"layout": args.layout}
    manager = jaxckpt.CheckpointManager(
        args.root,
        chunk_bytes=CHUNK_BYTES,
        gc_on_open=not args.no_gc,
        storage_options=json.loads(args.storage_options),
        **layout,
    )
    _say("OPENED")
    stop = args.start + args.steps
    state = device_state(args.seed, args.start, args.mb) if args.steps > 0 else None
    for step in range(args.start, stop):
        arm("save", step)
        manager.save(step, state)
        _say(f"SAVED {step}")
        # Like a training loop, compute the next state while this one is written.
        state = device_state(args.seed, step + 1, args.mb) if step + 1 < stop else None
        manager.wait()
        _say(f"COMMITTED {step}")
    if args.delete is not None:
        arm("delete", args.delete)
        manager.delete(args.delete)
        _say(f"DELETED {args.delete}")
    manager.close()
    _say("DONE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
