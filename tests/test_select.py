"""The restore selection: how many commit markers a restore reads, counted from the server's log."""

from __future__ import annotations

import re
import uuid

import numpy as np
import servers

import jaxckpt

STEPS = 50


def marker_gets(server: servers.Server, prefix: str, since: int) -> list[str]:
    """Marker GETs (not latest-step hints) under ``prefix`` in moto's log after ``since``."""
    log = server.log_path.read_text(errors="replace")[since:]
    return re.findall(rf'"GET /{server.bucket}/{prefix}/commits/\d+(?:\.e\d+)?\.json', log)


def test_restoring_the_newest_of_50_steps_reads_at_most_3_markers(s3_server):
    prefix = uuid.uuid4().hex
    root = f"s3://{s3_server.bucket}/{prefix}"
    with jaxckpt.CheckpointManager(root, gc_on_open=False) as mgr:
        for step in range(STEPS):
            mgr.save(step, {"w": np.full(4, step, np.float32)})
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    before = len(s3_server.log_path.read_text(errors="replace"))
    assert mgr.latest_step() == STEPS - 1
    latest = marker_gets(s3_server, prefix, before)
    before = len(s3_server.log_path.read_text(errors="replace"))
    restored = mgr.restore()
    restore = marker_gets(s3_server, prefix, before)
    np.testing.assert_array_equal(restored["w"], np.full(4, STEPS - 1, np.float32))
    assert len(latest) == 1, latest
    assert len(restore) <= 3, restore
    mgr.close()
