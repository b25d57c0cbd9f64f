"""A tiered trainer for the promotion crash tests: saves to a local tier, then waits to be killed.

Usage::

    python tests/tier_child.py ROOT LOCAL_ROOT --steps K [--start S] [--arm-last PHASE]

Opens ``CheckpointManager(ROOT, local_root=LOCAL_ROOT, promotion="external",
local_retention=KeepLast(1))``, saves steps ``S..S+K-1`` (step ``s`` holds
:func:`state` ``(s)``), prints ``COMMITTED s`` once each local commit is
done, then ``READY`` and sleeps until it is SIGKILLed. ``--arm-last`` sets
``JAXCKPT_PAUSE_AT`` for the last save only (see ``jaxckpt.commit._phases``), so the
test can kill it inside that save.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np


def state(step: int) -> dict[str, Any]:
    """The state saved as ``step`` (multi-chunk with 64 KiB chunks)."""
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((256, 128)).astype(np.float32),
        "i": np.arange(1000, dtype=np.int64) * step,
        "step": step,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("local_root")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--start", type=int, default=1)
    p.add_argument("--arm-last", default=None, metavar="PHASE")
    args = p.parse_args()
    import jaxckpt
    from jaxckpt import policy

    mgr = jaxckpt.CheckpointManager(
        args.root,
        local_root=args.local_root,
        promotion="external",
        local_retention=policy.KeepLast(1),
        chunk_bytes=64 << 10,
    )
    last = args.start + args.steps - 1
    for step in range(args.start, last + 1):
        if step == last and args.arm_last:
            os.environ["JAXCKPT_PAUSE_AT"] = args.arm_last
        mgr.save(step, state(step))
        mgr.wait()
        print(f"COMMITTED {step}", flush=True)
    mgr.wait_for_deletions(timeout_s=60)
    print("READY", flush=True)
    time.sleep(600)
    sys.exit(1)  # never reached: the test kills this process


if __name__ == "__main__":
    main()
