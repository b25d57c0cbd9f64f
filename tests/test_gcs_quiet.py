"""A ``jaxckpt`` command on a ``gs://`` root prints no TensorStore credential lines (issue 37).

TensorStore looks up GCS credentials on its first request and says so on stderr from
C++ (``google_auth_provider.cc ... Could not find the credentials file``, or ``Using
GOOGLE_AUTH_TOKEN_FOR_TESTING``). A fresh CLI process against the GCS emulator, with
no credentials anywhere (the suite's environment), must print only its own output.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
from benchkit import servers

import jaxckpt

CLI = str(Path(sys.executable).parent / "jaxckpt")


def test_a_cli_command_on_a_gcs_emulator_root_prints_no_credentials_noise(
    gcs_server: servers.Server,
) -> None:
    root = f"gs://{gcs_server.bucket}/{uuid.uuid4().hex}"
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(3, {"w": np.arange(4.0)})
    env = dict(os.environ, STORAGE_EMULATOR_HOST=gcs_server.endpoint)
    for name in ("GOOGLE_AUTH_TOKEN_FOR_TESTING", "TENSORSTORE_GCS_HTTP_URL"):
        env.pop(name, None)  # what this process set for itself: the child decides anew
    for argv in (["ls", root], ["verify", root, "3"]):
        done = subprocess.run(
            [CLI, *argv], env=env, capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr
        assert "3" in done.stdout
        assert "google_auth_provider" not in done.stderr, done.stderr
        assert "credentials" not in done.stderr.lower(), done.stderr
        assert "GOOGLE_AUTH_TOKEN_FOR_TESTING" not in done.stderr, done.stderr


def test_other_stderr_output_of_the_first_request_is_kept(
    gcs_server: servers.Server,
) -> None:
    """Only the credential lines are dropped: what else reached stderr meanwhile is kept."""
    code = """
import os, sys
import jaxckpt.storage._tsenv as tsenv
def first():
    os.write(2, b"google_auth_provider.cc:136] Using GOOGLE_AUTH_TOKEN_FOR_TESTING\\n")
    print("kept line", file=sys.stderr)
tsenv.quiet_gcs_auth(first)
tsenv.quiet_gcs_auth(lambda: print("called twice"))  # once per process: not called
os.write(2, b"google_auth_provider.cc: a later line is not TensorStore's lookup\\n")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout == ""
    assert done.stderr == (
        "kept line\ngoogle_auth_provider.cc: a later line is not TensorStore's lookup\n"
    )
