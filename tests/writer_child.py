"""A writer process for the many-writers tests (``test_writers.py``).

Usage::

    writer_child.py ROOT race --step S --value V --go FILE
    writer_child.py ROOT loop --start S --pause SECONDS [--keep-last K]

``race`` imports jax, prints ``READY``, waits for ``--go`` to hold a shared
wall-clock instant (the test writes it once every racer is ready) and for
that instant, then opens the root for writing and saves ``state(V)`` as
step S. ``loop`` opens the root and
saves step S, S+1, ... (``state(step)``) until it is fenced. Both print
``EPOCH e`` once the root is open, then ``COMMITTED s`` per commit, and end
with ``FENCED``, ``EXISTS`` or ``DONE``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import jaxckpt
from jaxckpt import policy


def state(value: int) -> dict[str, np.ndarray]:
    """A state whose every byte depends on ``value`` (two leaves, several chunks)."""
    rng = np.random.default_rng(value)
    return {
        "a": rng.standard_normal(4096).astype(np.float32),
        "b": np.full((64, 16), value, np.int32),
    }


def _say(text: str) -> None:
    print(text, flush=True)


GO_TIMEOUT_S = 120.0  # the other racer imports jax on a loaded 2-core machine


def _await_go(go: str) -> None:
    """Announces ``READY``, then sleeps until the instant the test writes into ``go``."""
    import jax  # noqa: F401  (imported before the start, so it costs nothing after it)

    _say("READY")
    deadline = time.monotonic() + GO_TIMEOUT_S
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise SystemExit(f"no start instant in {go} within {GO_TIMEOUT_S:.0f}s")
        time.sleep(0.005)
    with open(go) as f:
        at = float(f.read())
    time.sleep(max(0.0, at - time.time()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("mode", choices=["race", "loop"])
    p.add_argument("--step", type=int, default=5)
    p.add_argument("--value", type=int, default=0)
    p.add_argument("--go", default="", help="race: the file that brings the start instant")
    p.add_argument("--start", type=int, default=1)
    p.add_argument("--pause", type=float, default=0.1)
    p.add_argument("--keep-last", type=int, default=0)
    args = p.parse_args(argv)
    if args.mode == "race":
        _await_go(args.go)
    retention = policy.KeepLast(args.keep_last) if args.keep_last else None
    mgr = jaxckpt.CheckpointManager(args.root, chunk_bytes=4096, retention=retention)
    _say(f"EPOCH {mgr.epoch}")
    try:
        if args.mode == "race":
            mgr.save(args.step, state(args.value))
            mgr.wait()
            _say(f"COMMITTED {args.step}")
        else:
            step = args.start
            while True:
                mgr.save(step, state(step))
                mgr.wait()
                _say(f"COMMITTED {step}")
                step += 1
                time.sleep(args.pause)
    except jaxckpt.WriterFencedError as e:
        _say(f"FENCED {e}")
        return 0
    except jaxckpt.StepAlreadyExistsError as e:
        _say(f"EXISTS {e}")
        return 0
    _say("DONE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
