"""A failed background save reports one clean line, not Orbax's traceback."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import faultproxy
import numpy as np
import pytest
from absl import logging as absl_logging

import jaxckpt
from jaxckpt.records import ATTEMPTS

CHILD = """
import sys
import numpy as np
import pytest
import jaxckpt
options = {"max_retries": 1, "initial_delay_s": 0.01, "max_delay_s": 0.02}
mgr = jaxckpt.CheckpointManager(sys.argv[1], storage_options=options)
mgr.save(1, {"w": np.ones(4)})
try:
    mgr.wait()
except jaxckpt.SaveFailedError as e:
    print("CAUGHT", type(e).__name__, file=sys.stderr)
mgr.close()
"""


@pytest.mark.usefixtures("plain_by_default")
def test_a_failed_background_save_logs_one_line_and_no_traceback(s3_server, tmp_path):
    proxy = faultproxy.FaultProxy(s3_server.endpoint)
    proxy.inject("error", method="PUT", path_contains=ATTEMPTS, times=10_000)
    env = {**os.environ, "AWS_ENDPOINT_URL_S3": proxy.endpoint}
    root = f"s3://{s3_server.bucket}/{os.urandom(8).hex()}"
    try:
        child = subprocess.run(
            [sys.executable, "-c", CHILD, root],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        proxy.close()
    err = child.stderr
    assert child.returncode == 0, err
    assert proxy.snapshot()["error"] > 0
    assert "CAUGHT SaveFailedError" in err
    assert "Traceback" not in err and "Handler Commit operations" not in err, err
    lines = [line for line in err.splitlines() if "background save of step 1 failed" in line]
    assert len(lines) == 1, err


def test_orbax_errors_of_other_checkpointers_keep_their_traceback(tmp_path, caplog):
    with jaxckpt.CheckpointManager(str(tmp_path / "root")) as mgr:  # installs the filter
        mgr.save(1, {"w": np.ones(2)})
    with caplog.at_level(logging.ERROR, logger="absl"), contextlib.suppress(ValueError):
        try:
            raise ValueError("someone else's save failed")
        except ValueError:
            absl_logging.error(
                "[process=0] Failed to run 1 Handler Commit operations or the Commit callback "
                "in background save thread, directory: /data/orbax/run/7",
                exc_info=True,
            )
    (record,) = [r for r in caplog.records if "Handler Commit" in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[1] is not None


def test_no_log_line_of_a_save_names_the_orbax_placeholder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Orbax logs its INFO lines about a save with the directory it was handed, a
    placeholder that never exists: they are dropped, every other line is kept."""
    with caplog.at_level(logging.DEBUG):
        with jaxckpt.CheckpointManager(tmp_path / "run") as mgr:
            mgr.save(1, {"w": np.arange(4.0)})
        assert any(r.name == "absl" for r in caplog.records)  # Orbax did log
    named = [
        r.getMessage() for r in caplog.records if "jaxckpt-orbax-placeholder" in r.getMessage()
    ]
    assert named == []
