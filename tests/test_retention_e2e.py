"""End-to-end retention: policies drive real saves and deletions on a local root.

The root lives in RAM (``ram_dir``): the 2,000 commits are about the policies,
not the disk, and fsync on a disk was most of their time.
"""

from __future__ import annotations

import pathlib

import numpy as np
from rootpaths import data_steps

import jaxckpt
from jaxckpt import policy
from jaxckpt.records import parse_marker_key
from jaxckpt.storage import open_storage

EXPECTED = [10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 19980, 19990, 20000]


def test_every_10_steps_keep_last_3_and_milestones_over_20000_steps(ram_dir: pathlib.Path):
    root = str(ram_dir / "run")
    mgr = jaxckpt.CheckpointManager(
        root,
        save_policy=policy.EveryNSteps(10),
        retention=policy.KeepLast(3) | policy.KeepMilestones(series=(1, 2, 5)),
    )
    saved = 0
    state = {"w": np.zeros(4, np.float32), "step": 0}
    for step in range(1, 20001):
        state["w"][:] = step
        state["step"] = step
        saved += mgr.save(step, state)
    mgr.close()
    assert saved == 2000
    # The storage itself, not only steps(): markers and step data of exactly these steps.
    storage = open_storage(root)
    markers = sorted(r.step for k in storage.list("commits/") if (r := parse_marker_key(k)))
    assert markers == EXPECTED and sorted(data_steps(storage)) == EXPECTED
    assert storage.list("pending/") == []
    reader = jaxckpt.CheckpointManager(root, read_only=True)
    assert reader.steps() == EXPECTED
    assert reader.restore(5000)["step"] == 5000
    np.testing.assert_array_equal(reader.restore()["w"], np.full(4, 20000, np.float32))
