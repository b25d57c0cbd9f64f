"""An absl training script as a port writes it: a wrong ``--checkpoint_init_from`` is a
usage error (no traceback), and six saves print jaxckpt's six lines, not Orbax's INFO."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import jaxckpt
import jaxckpt.flags

SCRIPT = """
from absl import app
import numpy as np
import jaxckpt.flags

jaxckpt.flags.define_flags()


def main(argv):
    with jaxckpt.flags.manager_from_flags() as mgr:
        jaxckpt.flags.init_from_flags(mgr, {"w": np.zeros(2)})
        for step in range(6):
            mgr.save(step, {"w": np.zeros(2)}, force=True)


if __name__ == "__main__":
    app.run(main)
"""


def _run(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "trainer.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )


def test_a_wrong_init_from_is_a_usage_error_and_orbax_info_lines_stay_out(tmp_path):
    pretrained = tmp_path / "pretrained"
    with jaxckpt.CheckpointManager(pretrained) as mgr:
        mgr.save(3, {"w": np.ones(2)})
    init_from = f"{pretrained}:4"  # a step the root does not hold
    done = _run(
        tmp_path, f"--checkpoint_root={tmp_path / 'run'}", f"--checkpoint_init_from={init_from}"
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "USAGE" in done.stdout + done.stderr
    assert f"--checkpoint_init_from={init_from}: step 4 not found" in done.stderr
    nothing = str(tmp_path / "nothing")  # not a root: the same usage error (in process here)
    fv = jaxckpt.flags.flags_from_mapping({"root": str(tmp_path / "run2"), "init_from": nothing})
    with (
        jaxckpt.flags.manager_from_flags(fv) as mgr,
        pytest.raises(jaxckpt.flags.CheckpointFlagError, match="is not a jaxckpt root"),
    ):
        jaxckpt.flags.init_from_flags(mgr, {"w": np.zeros(2)}, fv)
    done = _run(
        tmp_path, f"--checkpoint_root={tmp_path / 'run'}", f"--checkpoint_init_from={pretrained}:3"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    info = [line for line in done.stderr.splitlines() if line.startswith("I")]
    assert sum("committed step" in line for line in info) == 6
    assert not [line for line in info if "async_checkpointer.py" in line], info
