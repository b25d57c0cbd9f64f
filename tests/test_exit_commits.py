"""A script that exits without ``close()`` still commits its last save.

``tests/exit_child.py`` saves step 3 and exits while the save is in flight:
falling off its end, through ``sys.exit``, or after ``del mgr`` (three
children at once). A fresh process then restores step 3 intact, and each
child logged one line saying that exit waited for it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import harness
import numpy as np

import jaxckpt

CHILD = Path(__file__).with_name("exit_child.py")
HOWS = ("end", "sys_exit", "del")


def test_a_save_in_flight_at_exit_commits(tmp_path: Path) -> None:
    children = {
        how: subprocess.Popen(
            [sys.executable, str(CHILD), str(tmp_path / how), how],
            env=harness.child_env(JAX_PLATFORMS="cpu"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for how in HOWS
    }
    try:
        outputs = {how: child.communicate(timeout=180) for how, child in children.items()}
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait(timeout=10)
    for how, (out, err) in outputs.items():
        assert children[how].returncode == 0, (how, err)
        assert "SAVED" in out, (how, out)
        assert "cannot schedule new futures" not in err, (how, err)
        waited = [line for line in err.splitlines() if "at exit:" in line]
        assert len(waited) == 1, (how, err)
        assert "waited for the save of step 3" in waited[0] and "close()" in waited[0], waited
        with jaxckpt.CheckpointManager(tmp_path / how, read_only=True) as mgr:
            assert mgr.steps() == [3], how
            restored = mgr.restore()
        assert restored["step"] == 3
        np.testing.assert_array_equal(restored["w"], np.arange(8 * 2**20, dtype=np.float32))
