"""A training loop for the run-ledger tests: saves every 5 steps, then stalls to be killed.

Usage::

    python tests/ledger_child.py ROOT --until N

Opens ``jaxckpt.CheckpointManager(ROOT)`` (``EveryNSteps(5)``, the ledger flushed every
0.2 s), calls ``save`` for steps 1 .. N, prints ``REACHED N`` and then waits forever:
the parent kills it once the ledger holds the reached step.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import jaxckpt
from jaxckpt import policy


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--until", type=int, required=True)
    args = p.parse_args()
    mgr = jaxckpt.CheckpointManager(
        args.root, save_policy=policy.EveryNSteps(5), ledger_flush_s=0.2
    )
    for step in range(1, args.until + 1):
        mgr.save(step, {"w": np.full(256, float(step))})
    mgr.wait()
    print(f"REACHED {args.until}", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
