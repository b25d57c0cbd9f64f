"""The restore selection: how many commit markers a restore reads, counted from the server's log."""

from __future__ import annotations

import logging
import re
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from benchkit import servers
from rootpaths import chunk_path

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


@pytest.mark.usefixtures("plain_by_default")
def test_the_caller_learns_which_step_restore_restored(tmp_path, caplog):
    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root, chunk_bytes=1024) as mgr:
        assert mgr.restored_step is None  # nothing restored yet
        mgr.save(1, {"w": np.arange(1024.0)})
        mgr.save(2, {"w": np.arange(1024.0) + 1})
    chunk = Path(chunk_path(root, 2, "w", 2))
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x40
    chunk.write_bytes(bytes(data))
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    assert mgr.latest_step() == 2
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        state = mgr.restore()
    assert "falling back to step 1" in caplog.text
    np.testing.assert_array_equal(state["w"], np.arange(1024.0))
    assert mgr.restored_step == 1  # not latest_step(): the newest step was corrupt
    mgr.restore(1)
    assert mgr.restored_step == 1
    with pytest.raises(jaxckpt.CorruptCheckpointError):
        mgr.restore(2)
    assert mgr.restored_step == 1  # a failed restore leaves it as it was


@pytest.mark.parametrize("tiered", [False, True])
def test_restore_reaches_the_step_reader_in_two_calls(tmp_path, monkeypatch, tiered):
    from jaxckpt.restoring import _stepreader as _restore

    kwargs = {"local_root": str(tmp_path / "local")} if tiered else {}
    with jaxckpt.CheckpointManager(str(tmp_path / "root"), **kwargs) as mgr:
        mgr.save(1, {"w": np.arange(4.0)})
        if tiered:
            mgr.wait_durable(1)
    restore = _restore.StepReader.restore
    chains: list[list[str]] = []

    def recording(self, *args, **kwargs):
        frame, chain = sys._getframe(1), []
        while frame.f_code.co_name != "restore" or not frame.f_code.co_filename.endswith(
            "_manager.py"
        ):
            chain.append(frame.f_code.co_qualname)
            frame = frame.f_back
        chains.append(chain)
        return restore(self, *args, **kwargs)

    monkeypatch.setattr(_restore.StepReader, "restore", recording)
    reader = jaxckpt.CheckpointManager(str(tmp_path / "root"), read_only=True, **kwargs)
    reader.restore()
    reader.restore(1)
    # CheckpointManager.restore -> Selection.restore -> StepReader.restore
    assert chains == [["Selection.restore"]] * 2
