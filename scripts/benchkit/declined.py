"""``bench.py declined``: what a save the policy declines costs the training loop.

A jitted, CPU-bound training step (a few matmuls, its step counter an int32
``jax.Array`` as in a Flax ``TrainState``) runs ``--steps`` times, calling
``mgr.save(step, state)`` after each with ``EveryNSteps`` larger than the run, so
every save is declined. Side by side, in one process, interleaved round by round:

* ``int``: the loop's own Python counter (nothing to read);
* ``array``: ``state.step`` itself, the jax.Array (jaxckpt predicts it);
* ``array, read``: ``int(state.step)``, what a save used to do with it (it waits
  for the step's computation).

Reported per variant: the median milliseconds one ``save`` call blocks, and the
wall seconds per training step (dispatch stays asynchronous when ``save`` does
not wait).

    python scripts/bench.py declined [--steps 30] [--rounds 3] [--size 512] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS = ("int", "array", "array, read")


def _loop(mgr: Any, step_fn: Any, state: Any, steps: int, variant: str) -> dict[str, float]:
    import jax

    calls = []
    start = time.perf_counter()
    for i in range(steps):
        state = step_fn(state)
        step = {"int": i + 1, "array": state["step"]}.get(variant)
        t = time.perf_counter()
        if step is None:
            step = int(state["step"])  # what save() did with a jax.Array step before
        mgr.save(step, state)
        calls.append(time.perf_counter() - t)
    jax.block_until_ready(state)
    wall = time.perf_counter() - start
    return {"save_ms": statistics.median(calls) * 1e3, "step_s": wall / steps}


def measure(steps: int, rounds: int, size: int) -> dict[str, dict[str, float]]:
    import jax
    import jax.numpy as jnp

    import jaxckpt
    from jaxckpt import policy

    @jax.jit
    def train_step(state: dict[str, Any]) -> dict[str, Any]:
        w = state["w"]
        for _ in range(4):
            w = jnp.tanh(w @ w) * 0.5
        return {"w": w, "step": state["step"] + 1}

    init = {"w": jnp.eye(size) * 0.1, "step": jnp.int32(0)}
    jax.block_until_ready(train_step(init))  # compiled once, outside the measurements
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    never = policy.EveryNSteps(10**9)
    for _ in range(rounds):
        for variant in VARIANTS:
            with (
                tempfile.TemporaryDirectory() as root,
                jaxckpt.CheckpointManager(root, save_policy=never) as mgr,
            ):
                runs[variant].append(_loop(mgr, train_step, dict(init), steps, variant))
    return {
        v: {k: statistics.median(r[k] for r in rs) for k in ("save_ms", "step_s")}
        for v, rs in runs.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py declined", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="training steps per run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", type=int, default=512, help="the step's matrices are size x size")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    results = measure(args.steps, args.rounds, args.size)
    rows = ["| step passed to save | declined save blocks (ms) | training step (ms) |"]
    rows.append("|---|---:|---:|")
    for variant, r in results.items():
        rows.append(f"| {variant} | {r['save_ms']:.3f} | {r['step_s'] * 1e3:.1f} |")
    print("\n".join(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
