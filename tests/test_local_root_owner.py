"""A local tier records the durable root it serves and refuses to serve another.

Two jobs given the same ``local_root`` (different durable roots): the second
must neither resume from the first job's steps nor promote them into its own
durable root. Durable roots on a loopback S3 server; ``jaxckpt promote`` run
as a command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from benchkit import servers

import jaxckpt
from jaxckpt import policy
from jaxckpt.commit import CommitProtocol
from jaxckpt.records import TIER_RECORD, WRITERS, read_requests
from jaxckpt.storage import open_storage


def job(root: str, local: Path, **kwargs: object) -> jaxckpt.CheckpointManager:
    kwargs.setdefault("promote_policy", policy.EveryNSteps(1))
    return jaxckpt.CheckpointManager(root, local_root=str(local), **kwargs)


@pytest.fixture
def roots(s3_server: servers.Server, tmp_path: Path) -> tuple[Path, str, str]:
    """One local root, two jobs' durable roots (the first with steps 1 and 2 promoted)."""
    local = tmp_path / "nvme"
    first, second = (f"s3://{s3_server.bucket}/{uuid.uuid4().hex}" for _ in range(2))
    with job(first, local) as mgr:
        for s in (1, 2):
            mgr.save(s, {"w": np.arange(4.0) + s})
            mgr.wait_durable(s)
    return local, first, second


def test_a_second_job_is_refused_before_anything_is_written(roots: tuple[Path, str, str]) -> None:
    local, first, second = roots
    epochs = sorted(os.listdir(local / WRITERS))
    for read_only in (False, True):
        with pytest.raises(jaxckpt.LocalRootInUseError) as e:
            job(second, local, read_only=read_only)
        assert str(local) in str(e.value) and first in str(e.value) and second in str(e.value)
    assert sorted(os.listdir(local / WRITERS)) == epochs  # no epoch taken, nobody fenced
    assert open_storage(second).list("") == []  # the second durable root untouched
    with job(first, local) as mgr:  # the first job resumes as before
        assert mgr.latest_step() == 2
        assert mgr.restore()["w"][0] == 2.0


def test_the_promote_sidecar_refuses_another_jobs_local_root(
    roots: tuple[Path, str, str],
) -> None:
    local, first, second = roots
    with job(first, local, promotion="external") as mgr:
        mgr.save(3, {"w": np.arange(4.0)})  # committed locally, awaiting the sidecar
    assert read_requests(CommitProtocol(open_storage(str(local)))).keys() == {3}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxckpt", "promote", str(local), second],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc
    assert "serves the durable root" in proc.stderr and first in proc.stderr, proc.stderr
    assert open_storage(second).list("") == []


def test_an_older_local_root_without_the_record_is_adopted(roots: tuple[Path, str, str]) -> None:
    local, first, second = roots
    (local / TIER_RECORD).unlink()  # as a local root written before the record existed
    with job(first, local) as mgr:
        assert mgr.latest_step() == 2
    record = json.loads((local / TIER_RECORD).read_text())
    assert record["durable"] == first
    with pytest.raises(jaxckpt.LocalRootInUseError):
        job(second, local)
