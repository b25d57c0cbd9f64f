"""Promotion against a durable root that keeps failing: retries back off.

A tiered manager whose durable root is a full tmpfs: every promotion attempt
fails with ENOSPC. ``wait_durable`` and ``close`` wait for the step without
hurrying the promoter, which retries the step after 0.5-1 s, then 1-2 s, 2-4 s,
... (exponential, with jitter) and logs each failure once. Before, both woke the
promoter every 50 ms and every wake logged one error: 3,096 lines in ~45 s.
"""

from __future__ import annotations

import logging
import math
import os
import time

import numpy as np
import pytest

import jaxckpt
from jaxckpt.lifecycle._backoff import Backoff

WAIT_S = 4.0
CLOSE_S = 6.0


def fill(path: str) -> None:
    """Writes zeros to ``path`` until its file system is full."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError:
            pass


def test_a_full_durable_disk_makes_promotion_back_off(tmp_path, caplog):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=4M tmpfs {mnt} 2>/dev/null") != 0:
        pytest.fail("this test needs root to mount a small tmpfs (CI runs as root)")
    try:
        mgr = jaxckpt.CheckpointManager(
            str(mnt / "durable"), local_root=str(tmp_path / "local"), save_timeout_s=CLOSE_S
        )
        fill(str(mnt / "filler"))  # after the durable root took its epoch
        with caplog.at_level(logging.INFO, logger="jaxckpt"):
            mgr.save(1, {"w": np.arange(1 << 16, dtype=np.float32)})
            mgr.wait()
            start = time.monotonic()
            with pytest.raises(jaxckpt.PromotionTimeoutError, match="no space left on device"):
                mgr.wait_durable(timeout_s=WAIT_S)
            mgr.close()  # waits CLOSE_S for step 1, then leaves it requested
            window = time.monotonic() - start
    finally:
        os.system(f"umount {mnt}")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    failed = [m for m in errors if m.startswith("promotion of step 1 failed")]
    assert failed and all("retried in" in m for m in failed), errors
    # Attempts at 0 and then after >= 0.5, 1, 2, 4 ... s: at most 2 + log2(window / 0.5).
    assert len(failed) <= 2 + math.log2(window / 0.5), (window, errors)
    assert len(errors) == len(failed), errors
    assert "closing with steps [1] not yet promoted" in caplog.text


def test_backoff_doubles_with_jitter_up_to_the_longest_and_forgets_a_success():
    now = [0.0]
    rolls = iter([0.0, 0.999, 0.5, 0.0, 0.0, 0.0])
    b = Backoff(first_s=1.0, longest_s=8.0, clock=lambda: now[0], rng=lambda: next(rolls))
    delays = [b.failed(3) for _ in range(6)]
    assert delays == pytest.approx([0.5, 1.999, 3.0, 4.0, 4.0, 4.0], abs=1e-3)
    assert not b.due(3) and b.due(4)
    assert b.next_due_s() == pytest.approx(4.0)
    now[0] = 4.0
    assert b.due(3) and b.next_due_s() == 0.0
    b.succeeded(3)
    assert b.failures(3) == 0 and b.next_due_s() is None
    with pytest.raises(ValueError):
        Backoff(first_s=0, longest_s=1)
