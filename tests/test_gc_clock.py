"""``jaxckpt gc`` judges an attempt's age by the storage's clock, not the operator's (issue 22)."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np

import jaxckpt
from jaxckpt.commit import CommitProtocol
from jaxckpt.records import StepLocation, json_record, new_attempt
from jaxckpt.storage import open_storage

# The operator's process: every clock reading of its own runs ``offset`` seconds ahead.
OPERATOR = """
import sys, time
_real_time = time.time
time.time = lambda: _real_time() + float(sys.argv[2])
from jaxckpt import cli
sys.exit(cli.main(["gc", sys.argv[1]]))
"""
TWO_HOURS = 7200.0


def _live_save(root: str, step: int) -> StepLocation:
    """What a writer in the middle of saving ``step`` has written so far (this host's clock)."""
    storage = open_storage(root)
    started = time.time()
    loc = StepLocation(step, new_attempt(CommitProtocol(storage).epochs.newest(), started))
    storage.write(loc.pending_key, json_record(operation="save", started=started, step=step))
    storage.write(loc.arrays_prefix + "w/c/0", b"being written")
    return loc


def _gc(root: str, offset_s: float) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", OPERATOR, root, str(offset_s)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_gc_on_a_host_two_hours_ahead_keeps_a_live_save(storage_root: str) -> None:
    """Before: the attempt looked 2 h old (> the 1 h grace) and was removed."""
    with jaxckpt.CheckpointManager(storage_root) as mgr:
        mgr.save(1, {"w": np.arange(4.0)})
    loc = _live_save(storage_root, 2)
    out = _gc(storage_root, TWO_HOURS)
    assert "keep (within grace period) step 2" in out, out
    assert "removed 0 attempts" in out
    storage = open_storage(storage_root)
    assert storage.list(loc.arrays_prefix) == [loc.arrays_prefix + "w/c/0"]
    assert storage.read(loc.pending_key) is not None
    # A clock two hours behind does not keep a fenced writer's attempt alive either.
    jaxckpt.CheckpointManager(storage_root, gc_on_open=False).close()  # a new epoch fences it
    out = _gc(storage_root, -TWO_HOURS)
    assert storage.list(loc.arrays_prefix) == [], out
    assert jaxckpt.CheckpointManager(storage_root, read_only=True).steps() == [1]
