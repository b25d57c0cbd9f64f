"""What the run ledger costs a training loop: per save() call, per save, in requests.

Measures, with the ledger on and off in one run (local directory, and a loopback S3
server with ``--s3``): the time of a ``save(step)`` call the policy declines (the
loop's every step), the median blocking time of the saves, and the ledger objects
written per save (each is one PUT) over a loop of ``--steps`` steps of ``--step-ms``,
saving every ``--every`` steps with the default flush interval (10 s).

    python scripts/bench.py ledger [--calls 20000] [--steps 400] [--step-ms 20]
        [--every 5] [--s3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any


def _declined_call_us(root: str, ledger: bool, calls: int) -> float:
    import numpy as np

    import jaxckpt
    from jaxckpt import policy

    state = {"w": np.zeros(16)}
    with jaxckpt.CheckpointManager(
        root, save_policy=policy.EveryNSteps(10**9), ledger=ledger
    ) as mgr:
        mgr.save(10**9, state)  # the one save; every later call is declined
        started = time.perf_counter()
        for step in range(1, calls + 1):
            mgr.save(step, state)
        return (time.perf_counter() - started) / calls * 1e6


def _loop(root: str, ledger: bool, steps: int, step_ms: float, every: int) -> dict[str, Any]:
    import numpy as np

    import jaxckpt
    from jaxckpt import policy
    from jaxckpt.storage import open_storage

    state = {"w": np.arange(1 << 18, dtype=np.float32)}  # 1 MiB
    with jaxckpt.CheckpointManager(
        root, save_policy=policy.EveryNSteps(every), ledger=ledger
    ) as mgr:
        for step in range(1, steps + 1):
            mgr.save(step, state)
            time.sleep(step_ms / 1000)
    stats = mgr.save_stats()
    saves = steps // every  # save_stats() keeps the newest 64
    objects = len(open_storage(root).list("ledger/"))
    return {
        "saves": saves,
        "blocking_ms_median": statistics.median(s.blocking_s for s in stats) * 1e3,
        "saves_seen": len(stats),
        "ledger_objects": objects,
        "ledger_puts_per_save": objects / saves if saves else None,
        "write_failures": mgr.ledger.write_failures,
    }


def measure(root: str, args: argparse.Namespace) -> dict[str, Any]:
    calls: dict[bool, list[float]] = {False: [], True: []}
    for i in range(5):  # interleaved: the machine's noise falls on both alike
        for on in (False, True):
            calls[on].append(_declined_call_us(f"{root}/calls-{on}-{i}", on, args.calls))
    out: dict[str, Any] = {}
    for on in (False, True):
        loop = _loop(f"{root}/loop-{on}", on, args.steps, args.step_ms, args.every)
        out["on" if on else "off"] = {
            "declined_call_us_median": statistics.median(calls[on]),
            **loop,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py ledger", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--s3", action="store_true", help="also on a loopback S3 server (moto)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        results["local"] = measure(tmp, args)
        if args.s3:
            from benchkit.listing import s3_bucket

            with s3_bucket(Path(tmp)) as bucket:
                results["s3"] = measure(f"{bucket}/{uuid.uuid4().hex}", args)
    text = json.dumps(results, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text)
    return 0
