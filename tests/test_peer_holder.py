"""A holder stopped past the save timeout: the save in flight fails, the next ones succeed.

Two real JAX processes on two nodes, ``local_replicas=2`` (each holds the
other's replica). Process 1 is SIGSTOPped while saving step 2 (paused just
before it replicates) and stays stopped for longer than ``save_timeout_s``:
process 0's save of step 2 fails within the bound, naming process 1; once
process 1 is continued, its own save of step 2 fails too, and steps 3 and 4
commit on both processes (before the fixes of issue 37, every later save failed
on every process).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import harness
import pytest
import test_multihost as mh

from jaxckpt.commit import CommitProtocol
from jaxckpt.storage import open_storage

pytestmark = pytest.mark.timeout(240)
CHILD = Path(__file__).with_name("holder_child.py")
SAVE_TIMEOUT_S = 6.0
PEER_TIMEOUT_S = 3.0
STOPPED_S = SAVE_TIMEOUT_S + 3.0


def test_a_holder_stopped_past_the_save_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mh, "CHILD_PATH", CHILD)
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    resume = tmp_path / "resume"
    resume.mkdir()
    for step in (1, 3, 4):  # process 1 pauses before replicating step 2 only
        harness.resume(resume, "replicating", step)
    env_for = {
        0: {"JAXCKPT_NODE_ID": "node0"},
        1: {
            "JAXCKPT_NODE_ID": "node1",
            harness.PAUSE_AT: "replicating",
            harness.RESUME_DIR: str(resume),
        },
    }
    extra = (f"--local-root={local}", f"--peer-timeout={PEER_TIMEOUT_S:g}")
    with mh.spawn(
        tmp_path,
        root,
        mode="save",
        processes=2,
        devices=1,
        mesh="2x1",
        save_timeout_s=SAVE_TIMEOUT_S,
        steps=(1, 2, 3, 4),
        env_for=env_for,
        extra=extra,
    ) as procs:
        harness.wait_until(
            lambda: harness.reached_file(resume, "replicating", 2).exists(),
            what="process 1 saving step 2",
            timeout_s=mh.RUN_TIMEOUT_S,
        )
        holder = procs[1].popen.pid
        os.kill(holder, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            harness.resume(resume, "replicating", 2)  # seen once it is continued
            harness.wait_until(
                lambda: procs[0].said("FAILED 2"),
                what="process 0's save of step 2 failing",
                timeout_s=SAVE_TIMEOUT_S + mh.LOAD_MARGIN_S,
            )
            time.sleep(max(0.0, stopped + STOPPED_S - time.monotonic()))
        finally:
            os.kill(holder, signal.SIGCONT)
        mh.wait_all(procs, timeout_s=mh.RUN_TIMEOUT_S)
    (failed,) = procs[0].said("FAILED")
    _, step, error, seconds = failed.split()
    assert step == "2" and error in ("SaveFailedError", "SaveTimeoutError"), procs[0].report()
    assert float(seconds) < SAVE_TIMEOUT_S + mh.LOAD_MARGIN_S, failed
    (message,) = [x for x in procs[0].stderr().splitlines() if x.startswith("error: step 2:")]
    assert "from process 1 within" in message, procs[0].report()  # the error names it
    for p in procs:
        assert p.said("COMMITTED") == ["COMMITTED 1", "COMMITTED 3", "COMMITTED 4"], p.report()
        assert [line.split()[1] for line in p.said("FAILED")] == ["2"], p.report()
        assert p.said("DONE") == ["DONE"], p.report()
    for i in range(2):
        local_steps = CommitProtocol(open_storage(f"{local}{i}")).visible_refs().keys()
        assert {1, 3, 4} <= local_steps and 2 not in local_steps
