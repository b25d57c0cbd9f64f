"""Saves a step and exits without ``close()``: ``python exit_child.py ROOT HOW``.

``HOW``: ``end`` falls off the end of the script, ``sys_exit`` calls
``sys.exit(0)``, ``del`` drops the manager (``del mgr``) and then ends. The
save is still in flight when the interpreter begins to exit (a 32 MiB state).
"""

from __future__ import annotations

import sys

import numpy as np

import jaxckpt

STEP = 3


def state() -> dict[str, object]:
    return {"w": np.arange(8 * 2**20, dtype=np.float32), "step": STEP}


if __name__ == "__main__":  # the suite imports every module of tests/ for doctests
    root, how = sys.argv[1], sys.argv[2]
    mgr = jaxckpt.CheckpointManager(root)
    mgr.save(STEP, state())
    print("SAVED", flush=True)
    if how == "sys_exit":
        sys.exit(0)
    if how == "del":
        del mgr
