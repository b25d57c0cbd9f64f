"""A store that cannot be reached fails within seconds, in one line naming what was tried.

No request leaves loopback: the endpoint is a closed loopback port (a refused
connection is the unreachable store), the AWS SDK's instance-metadata lookup is
off (``AWS_EC2_METADATA_DISABLED``) and Google's metadata server is pointed at a
closed loopback port, so nothing probes 169.254.169.254.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

import jaxckpt
from jaxckpt.storage._retry import UNREACHABLE_S, Backoff, unreachable


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _isolated_env(tmp_path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AWS_", "GOOGLE_", "GCE_", "STORAGE_EMULATOR", "TENSORSTORE_"))
    }
    closed = f"127.0.0.1:{_closed_port()}"
    env.update(
        AWS_EC2_METADATA_DISABLED="true",
        AWS_ENDPOINT_URL_S3=f"http://{closed}",
        AWS_REGION="us-east-1",
        AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws-credentials"),
        GCE_METADATA_HOST=closed,
        GCE_METADATA_ROOT=closed,
        GCE_METADATA_IP=closed,
        HOME=str(tmp_path),
        JAX_PLATFORMS="cpu",
    )
    return env


def test_no_credentials_and_a_refused_endpoint_fail_in_one_line_naming_what_was_tried(tmp_path):
    # The manager's first request, without importing jax (the child stays cheap).
    code = (
        "import sys\n"
        "from jaxckpt.errors import StorageError\n"
        "from jaxckpt.storage import open_storage\n"
        "try:\n"
        "    open_storage('s3://bucket-only').read('jaxckpt.json')\n"
        "except StorageError as e:\n"
        "    print(f'raised: {e}'); sys.exit(3)\n"
    )
    # Before, the refused connection was retried to the save deadline (600 s): the
    # timeout here is the hang's bound, the short retry budget is what returns.
    run = subprocess.run(
        [sys.executable, "-c", code],
        env=_isolated_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 3, (run.stdout, run.stderr[-2000:])
    [line] = run.stdout.splitlines()
    assert "cannot read s3://bucket-only/jaxckpt.json" in line
    assert "Could not connect to server" in line
    assert "the store is unreachable: tried region us-east-1" in line
    assert "credentials: the AWS default chain" in line and "[endpoint http://127.0.0.1:" in line
    assert "attempts in" in line


def test_only_throttling_and_server_errors_are_retried_to_the_deadline():
    backoff = Backoff(initial_s=0.5, max_s=8.0, deadline_s=600.0)
    later = UNREACHABLE_S + 0.1
    assert backoff.delay(3, started=0.0, now=later, unreachable=True) is None
    assert backoff.delay(3, started=0.0, now=later) is not None  # throttled: goes on
    assert backoff.delay(3, started=0.0, now=599.0) is not None
    refused = ValueError(
        "ABORTED: All 0 retry attempts failed: CURL error Could not connect to server: "
        "Failed to connect to 127.0.0.1 port 9 after 0 ms [curl_code='7']"
    )
    no_dns = ValueError("ABORTED: CURL error Could not resolve host: s3.amazonaws.com")
    slow = ValueError(
        "UNAVAILABLE: All 5 retry attempts failed: SlowDown [http_response_code='503']"
    )
    assert unreachable(refused) and unreachable(no_dns) and unreachable(ConnectionRefusedError())
    assert not unreachable(slow)


@pytest.mark.parametrize("root", ["S3://bucket/run", "GS://bucket/run", "Gs://bucket"])
def test_an_upper_case_scheme_is_refused_like_a_missing_slash(root, tmp_path):
    with pytest.raises(jaxckpt.StorageError, match=r"the scheme is lower case: use '(s3|gs)://"):
        jaxckpt.CheckpointManager(root)
    assert not os.listdir(tmp_path)
