"""Object-store roots as an operator meets them: stalls bounded per request, quiet output.

Both run the library in a child process: TensorStore reads its HTTP stall
limits from the environment once, when a process first uses HTTP, and the AWS
SDK's log lines go to the process's own stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import faultproxy
import numpy as np
import pytest
from benchkit import servers

import jaxckpt

STALLED_SAVE = """
import sys, time
import numpy as np
import jaxckpt

root, endpoint = sys.argv[1:3]
options = jaxckpt.ObjectStoreOptions(
    endpoint=endpoint, timeout_s=2.0, max_retries=1, initial_delay_s=0.1, max_delay_s=0.2
)
mgr = jaxckpt.CheckpointManager(root, storage_options=options, save_timeout_s=150)
start = time.monotonic()
mgr.save(1, {"w": np.arange(4096.0)})
try:
    mgr.wait()
    print("SAVED")
except jaxckpt.CheckpointError as e:
    print(f"FAILED {time.monotonic() - start:.1f} {type(e).__name__}: {e}")
"""


@pytest.mark.timeout(280)
def test_a_store_that_stalls_mid_save_fails_it_within_timeout_s(
    s3_server: servers.Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: ``timeout_s`` did not reach TensorStore's HTTP requests; the stalled PUT
    failed only on TensorStore's own stall limit (132.6 s with one retry, measured)."""
    # As if this process had opened a root with the default timeout_s (300 s): the
    # child inherits those stall limits and must replace them with its own.
    for name in (
        "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS",
        "TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS",
    ):
        monkeypatch.setenv(name, "300")
    monkeypatch.setenv("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")
    monkeypatch.setenv("JAXCKPT_CURL_LIMITS_PID", str(os.getpid()))
    proxy = faultproxy.FaultProxy(s3_server.endpoint)
    try:
        proxy.plan = faultproxy.FaultPlan(slow_s=3600.0)  # a "slow" fault: an hour
        proxy.inject("slow", method="PUT", path_contains="/arrays/", times=10_000)
        root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-c", STALLED_SAVE, root, proxy.endpoint],
            capture_output=True,
            text=True,
            timeout=240,
        )
        elapsed = time.monotonic() - start
    finally:
        proxy.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("FAILED "), proc.stdout + proc.stderr[-3000:]
    seconds = float(proc.stdout.split()[1])
    # Two attempts of 2 s without progress each, their backoff, and the load margin;
    # far below save_timeout_s.
    assert seconds < 60, proc.stdout
    assert elapsed < 100
    assert root in proc.stdout


def test_an_s3_command_prints_nothing_on_stderr_on_success(
    s3_server: servers.Server, tmp_path: Path
) -> None:
    """Before: five AWS-SDK ``E…`` lines about the missing ``~/.aws/config`` and credentials."""
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(3, {"w": np.arange(8.0)})
    home = tmp_path / "home"  # a user without ~/.aws
    home.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
    }
    env["HOME"] = str(home)
    proc = subprocess.run(
        [sys.executable, "-m", "jaxckpt", "ls", root], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert "3" in proc.stdout
    assert proc.stderr == ""
