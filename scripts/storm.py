"""Saves and restores through a throttling store: how much slower, and when they give up.

Usage::

    python scripts/storm.py [--mib 16] [--rate 0.3] [--storm-s 0] [--save-timeout 600] [--no-storm]

Starts moto (``benchkit/servers.py``) with the fault proxy (``faultproxy.py``) in
front of it answering ``503 SlowDown`` to a share of the requests, and runs one
process's packed save and restore of ``--mib`` MiB in 16 leaves through it:

1. ``clean``: no throttling (the reference time of a save and a restore);
2. ``throttled``: ``--rate`` of every request throttled: the save's and the
   restore's time against ``clean``;
3. ``storm``: every request throttled, for ``--storm-s`` seconds (0: until the
   call ends): how long a save and a restore take to fail, or to complete once
   the storm ends, and whether the restore returned the saved bytes.

Prints one JSON line per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
from benchkit import servers
from faultproxy import NO_FAULTS, FaultPlan, FaultProxy

servers.isolate_cloud_env(os.environ, tempfile.gettempdir())


def _state(mib: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = (mib << 20) // 16 // 4
    return {f"w{i}": rng.standard_normal(n, dtype=np.float32) for i in range(16)}


def _timed(call) -> tuple[float, str | None, object]:
    start = time.monotonic()
    try:
        result = call()
    except Exception as e:  # what the phase reports
        return time.monotonic() - start, f"{type(e).__name__}: {str(e)[:200]}", None
    return time.monotonic() - start, None, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--rate", type=float, default=0.3)
    parser.add_argument("--storm-s", type=float, default=0.0)
    parser.add_argument("--save-timeout", type=float, default=600.0)
    parser.add_argument("--no-storm", action="store_true", help="skip the storm phase")
    args = parser.parse_args()
    import jaxckpt

    moto = servers.start_moto(Path(tempfile.mkdtemp(prefix="storm-")))
    proxy = FaultProxy(moto.endpoint)
    options = {"endpoint": proxy.endpoint}

    def manager(root: str) -> jaxckpt.CheckpointManager:
        return jaxckpt.CheckpointManager(
            root, storage_options=options, save_timeout_s=args.save_timeout
        )

    def save_restore(phase: str, plan: FaultPlan, until_s: float = 0.0) -> None:
        root = f"s3://{moto.bucket}/{uuid.uuid4().hex}"
        state = _state(args.mib, 1)
        with manager(root) as mgr:  # opened before the storm (the open is not measured)
            proxy.plan = plan
            timer = threading.Timer(until_s, setattr, (proxy, "plan", NO_FAULTS))
            if until_s:
                timer.start()
            before = proxy.snapshot()
            save_s, save_error, _ = _timed(lambda: (mgr.save(1, state), mgr.wait()))
            timer.cancel()
            proxy.plan = NO_FAULTS
        if save_error is not None:
            with manager(root) as mgr:
                mgr.save(1, state)  # so that the restore has a step to read
        with manager(root) as mgr:
            proxy.plan = plan
            timer = threading.Timer(until_s, setattr, (proxy, "plan", NO_FAULTS))
            if until_s:
                timer.start()
            restore_s, restore_error, restored = _timed(lambda: mgr.restore(1))
            timer.cancel()
            proxy.plan = NO_FAULTS
        exact = restored is not None and all(
            np.array_equal(np.asarray(restored[k]), v) for k, v in state.items()
        )
        after = proxy.snapshot()
        row = {
            "phase": phase,
            "save_s": round(save_s, 2),
            "save_error": save_error,
            "restore_s": round(restore_s, 2),
            "restore_error": restore_error,
            "restored_exactly": exact,
            "throttled_requests": after["throttle"] - before["throttle"],
        }
        print(json.dumps(row), flush=True)

    try:
        save_restore("clean", NO_FAULTS)
        save_restore("throttled", FaultPlan(throttle=args.rate))
        if not args.no_storm:
            save_restore("storm", FaultPlan(throttle=1.0), args.storm_s)
    finally:
        proxy.close()
        moto.stop()


if __name__ == "__main__":
    sys.exit(main())
