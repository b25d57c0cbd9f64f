"""Root URIs are checked and normalised before anything is sent or written (issue 22)."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
from benchkit import servers

import jaxckpt
from jaxckpt.errors import StorageError
from jaxckpt.storage import open_storage, parse_root

INVALID = [
    ("s3://home/../victim/run", "'..' segments"),
    ("s3://bucket/run/./x", "'.' segments"),
    ("gs://bucket/a/..", "'..' segments"),
    ("s3://bucket/a//b", "empty segments"),
    ("s3:///run", "no bucket"),
    ("gs://", "no bucket"),
    ("http://example.com/run", "use a path, file://, gs://"),
    ("az://container/run", "use a path, file://, gs://"),
    ("s3://Bucket/run", "not a valid s3 bucket name"),
    ("s3://my_bucket/run", "not a valid s3 bucket name"),
    ("gs://ab/run", "not a valid gs bucket name"),
    ("s3://192.168.1.1/run", "not a valid s3 bucket name"),
    ("s3://bucket/run\nx", "control characters"),
    ("", "empty"),
    ("file://", "the path is empty"),
    # A cloud scheme with one slash or none would be a local directory './gs:/bucket'.
    ("gs:/bucket/run", "use 'gs://bucket/run'"),
    ("s3:/bucket/run", "use 's3://bucket/run'"),
    ("gs:bucket/run", "use 'gs://bucket/run'"),
    ("s3:bucket", "use 's3://bucket'"),
    ("GS:/bucket", "use 'gs://bucket'"),
    ("gcs:/bucket/run", "use 'gs://bucket/run'"),
    ("file:relative/run", "use file:///ABSOLUTE/PATH"),
]


@pytest.mark.parametrize(("root", "why"), INVALID)
def test_invalid_roots_are_refused_naming_the_root(root: str, why: str) -> None:
    with pytest.raises(StorageError, match=why) as info:
        open_storage(root)
    assert info.value.errno == errno.EINVAL
    assert repr(root) in str(info.value) or not root


@pytest.mark.parametrize(
    ("root", "uri"),
    [
        ("s3://bucket/runs/a/", "s3://bucket/runs/a"),
        ("s3://bucket/", "s3://bucket"),
        ("gs://my_bucket.example/x", "gs://my_bucket.example/x"),
        ("/tmp/a/../b", "/tmp/b"),
        ("file:///tmp/a/", "/tmp/a"),
        ("file:/tmp/a/", "/tmp/a"),
        ("file:/tmp/a/../b", "/tmp/b"),
        ("run:1", os.path.abspath("run:1")),  # a colon in a plain relative path is no scheme
    ],
)
def test_valid_roots_are_normalised(root: str, uri: str) -> None:
    assert parse_root(root).uri == uri
    assert open_storage(root).uri == uri


def test_a_mistyped_scheme_writes_nothing_locally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for root in ("gs:/bucket/run", "s3:bucket/run"):
        with pytest.raises(StorageError, match="needs two slashes"):
            jaxckpt.CheckpointManager(root)
    assert list(tmp_path.iterdir()) == []


def test_tilde_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert open_storage("~/ckpt").uri == str(home / "ckpt")
    assert open_storage("file://~/ckpt").uri == str(home / "ckpt")
    with jaxckpt.CheckpointManager("~/ckpt") as mgr:
        assert mgr.save(1, {"w": np.arange(3.0)})
    assert (home / "ckpt" / "jaxckpt.json").exists()
    assert not (work / "~").exists()
    np.testing.assert_array_equal(
        jaxckpt.CheckpointManager("~/ckpt").restore()["w"], np.arange(3.0)
    )


def test_dot_segments_never_reach_another_bucket(s3_server: servers.Server) -> None:
    """Before: the HTTP layer resolved ``..`` and the root record landed in the victim's bucket."""
    victim = f"victim-{uuid.uuid4().hex[:12]}"
    client = servers.s3_client(s3_server.endpoint)
    client.create_bucket(Bucket=victim)
    root = f"s3://{s3_server.bucket}/../{victim}/run"
    with pytest.raises(StorageError, match=r"'\.\.' segments") as info:
        jaxckpt.CheckpointManager(root)
    assert root in str(info.value)
    assert client.list_objects_v2(Bucket=victim).get("KeyCount", 0) == 0


@pytest.mark.parametrize("durable", ["s3:///run", "gs://", "http://example.com/run"])
def test_a_tiered_manager_checks_its_durable_root_before_touching_the_local_one(
    tmp_path: Path, durable: str
) -> None:
    local = tmp_path / "local"
    with pytest.raises(StorageError, match="invalid checkpoint root"):
        jaxckpt.CheckpointManager(durable, local_root=str(local))
    assert not os.path.exists(local)
