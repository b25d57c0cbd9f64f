"""A local tier removed (``rm -rf``) under a running tiered trainer.

A real trainer process saves every step (each promoted) while the test
removes its local root a few times. The next save recreates the local root
(root record, the durable root it serves, a writer epoch); meanwhile ``jaxckpt
ls --local-root`` and read-only tiered managers read the durable root; and
every step the trainer saved is durable at the end, or the trainer was told
(a SaveFailedError naming the step).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import harness
import numpy as np
import pytest

import jaxckpt
from jaxckpt.commit import CommitProtocol
from jaxckpt.records import ROOT_RECORD, TIER_RECORD
from jaxckpt.storage import open_storage

STEPS = 40
TRAINER = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import jaxckpt
    from jaxckpt import policy
    durable, local, go = sys.argv[1], sys.argv[2], sys.argv[3]
    mgr = jaxckpt.CheckpointManager(
        durable, local_root=local, promote_policy=policy.EveryNSteps(1), chunk_bytes=16 << 10
    )
    for step in range(1, STEPS + 1):
        try:
            mgr.save(step, {"w": np.full(64 << 10, float(step), np.float32)})
            print("SAVED", step, flush=True)
            if step in (5, 15, 25):  # step in flight: the test removes the local root now
                deadline = time.monotonic() + 120
                while not os.path.exists(f"{go}-{step}") and time.monotonic() < deadline:
                    time.sleep(0.01)
        except jaxckpt.SaveFailedError as e:
            print("FAILED", step, repr(str(e)), flush=True)
        time.sleep(0.05)
    try:
        mgr.close()
    except jaxckpt.SaveFailedError as e:
        print("FAILED close", repr(str(e)), flush=True)
    print("DONE", flush=True)
    """
).replace("STEPS", str(STEPS))


def _ls(durable: Path, local: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jaxckpt", "ls", str(durable), "--local-root", str(local)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _told_steps(line: str) -> set[int]:
    """The steps a FAILED line names: the save that raised and each step its message names
    ("step 5", "steps [3, 5]")."""
    named = re.findall(r"^FAILED (\d+)|\bstep (\d+)|\bsteps \[([\d, ]+)\]", line)
    return {int(n) for group in named for field in group for n in re.findall(r"\d+", field)}


def _durable(durable: Path, steps: range) -> bool:
    return set(steps) <= set(CommitProtocol(open_storage(str(durable))).committed())


@pytest.mark.timeout(600)
def test_a_local_root_removed_under_a_trainer_is_recreated_and_no_step_is_dropped_silently(
    tmp_path: Path,
) -> None:
    durable, local = tmp_path / "durable", tmp_path / "nvme"
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(durable), str(local), str(tmp_path / "go")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    assert proc.stdout is not None
    wipes = 0
    for line in proc.stdout:
        lines.append(line.strip())
        m = re.fullmatch(r"SAVED (\d+)", lines[-1])
        if m and int(m.group(1)) in (5, 15, 25):
            # The steps before the one in flight are promoted first (bounded wait), so the
            # wipe costs the step in flight and the save that reports it, as in the bound below.
            before = range(int(m.group(1)) - 4, int(m.group(1)))
            harness.wait_until(
                functools.partial(_durable, durable, before),
                what=f"steps {list(before)} promoted to {durable}",
                timeout_s=120,
                gone=lambda: proc.poll() is not None,
                report=lambda: "\n".join(lines),
            )
            for _ in range(50):  # rm -rf while the step is in flight (it may refill)
                shutil.rmtree(local, ignore_errors=True)
                if not (local / ROOT_RECORD).exists():
                    break
            wipes += 1
            with jaxckpt.CheckpointManager(
                str(durable), local_root=str(local), read_only=True
            ) as r:
                assert r.latest_step() is not None  # the durable root, while the cache is gone
            assert _ls(durable, local).returncode == 0
            (tmp_path / f"go-{m.group(1)}").touch()
    proc.wait(timeout=300)
    stderr = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 0 and lines[-1] == "DONE", (lines, stderr)
    assert wipes == 3
    told = set().union(*(_told_steps(x) for x in lines if x.startswith("FAILED")))
    saved = [int(x.split()[1]) for x in lines if re.fullmatch(r"SAVED \d+", x)]
    durable_steps = set(CommitProtocol(open_storage(str(durable))).committed())
    silently_lost = [s for s in saved if s not in durable_steps and s not in told]
    log = "\n".join(lines)
    assert silently_lost == [], f"saved, not durable, never reported: {silently_lost}\n{log}"
    assert len(durable_steps) >= STEPS - 6, f"durable: {sorted(durable_steps)}\n{log}"
    # The local root was recreated by the next save: records and its newest steps are there.
    assert (local / ROOT_RECORD).exists()
    assert json.loads((local / TIER_RECORD).read_text())["durable"] == str(durable)
    listed = _ls(durable, local)
    assert listed.returncode == 0 and "local" in listed.stdout, listed
    with jaxckpt.CheckpointManager(str(durable), local_root=str(local), read_only=True) as r:
        assert r.latest_step() == STEPS
        np.testing.assert_array_equal(r.restore()["w"][:4], np.full(4, float(STEPS)))


def test_a_step_whose_local_copy_goes_before_promotion_fails_the_next_save(
    tmp_path: Path,
) -> None:
    """Committed locally, awaiting the sidecar, then the local root is removed: the step can
    never become durable, and the next save says so (naming it) instead of dropping it."""
    durable, local = tmp_path / "durable", tmp_path / "nvme"
    mgr = jaxckpt.CheckpointManager(str(durable), local_root=str(local), promotion="external")
    mgr.save(1, {"w": np.arange(4.0)})
    mgr.wait()
    shutil.rmtree(local)
    with pytest.raises(jaxckpt.SaveFailedError, match=r"steps \[1\]"):
        mgr.save(2, {"w": np.arange(4.0)})
    assert mgr.save(2, {"w": np.arange(4.0)})  # told once; training goes on
    mgr.close()
    assert (local / ROOT_RECORD).exists()  # recreated by the save of step 2
    assert CommitProtocol(open_storage(str(local))).require_marker(2).step == 2
