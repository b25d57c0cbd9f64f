"""A byte flipped in transit is read again, not reported as damage.

A loopback proxy in front of the S3 server (``scripts/faultproxy.py``) flips
one byte of one response; every read path (restore, ``open_step``, export,
verify, the packed layout, TensorStore-decoded archives, the records) must
read that object again and go on, and damage that is really stored must still
be reported.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from rootpaths import step_key, step_object

import jaxckpt
from jaxckpt import cli
from jaxckpt.records import marker_key
from jaxckpt.storage import LocalStorage
from jaxckpt.tools import read_safetensors


def _load_faultproxy():
    import faultproxy  # scripts/ is on the suite's pythonpath

    return faultproxy


faultproxy = _load_faultproxy()


def _state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((64, 32), dtype=np.float32), "b": np.arange(5) + step}


@pytest.fixture
def s3_root(s3_server) -> str:
    return f"s3://{s3_server.bucket}/{os.urandom(8).hex()}"


@contextlib.contextmanager
def _flipping(
    monkeypatch: pytest.MonkeyPatch, path_contains: str, times: int = 1
) -> Iterator[object]:
    """Routes S3 requests through a proxy that flips one byte of the first ``times``
    matching GETs."""
    direct = os.environ["AWS_ENDPOINT_URL_S3"]
    proxy = faultproxy.FaultProxy(direct)
    proxy.inject("flip", method="GET", path_contains=path_contains, times=times)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
    try:
        yield proxy
        assert proxy.snapshot()["flip"] == times, "not every flip was injected"
    finally:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", direct)
        proxy.close()


def _saved(root: str, **options) -> None:
    """Steps 1 and 2; plain unless ``layout`` says (the flips target chunk objects)."""
    opts = jaxckpt.CheckpointOptions(**{"layout": "plain", **options})
    with jaxckpt.CheckpointManager(root, options=opts) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))


def _chunk_of(root: str, step: int, leaf: str = "w") -> str:
    return f"{step_key(root, step)}arrays/{leaf}/c/"


def test_restore_newest_rereads_instead_of_falling_back(s3_root, monkeypatch, caplog):
    _saved(s3_root)
    with _flipping(monkeypatch, _chunk_of(s3_root, 2)), caplog.at_level(logging.WARNING):
        restored = jaxckpt.CheckpointManager(s3_root, read_only=True).restore()
    np.testing.assert_array_equal(restored["w"], _state(2)["w"])  # not step 1's
    assert "read again" in caplog.text


@pytest.mark.parametrize("times", [1, 2])  # 2: the direct read fails twice, TensorStore's not
def test_restore_of_a_named_step_rereads(s3_root, monkeypatch, times):
    _saved(s3_root)
    with _flipping(monkeypatch, _chunk_of(s3_root, 2), times):
        restored = jaxckpt.CheckpointManager(s3_root, read_only=True).restore(2)
    np.testing.assert_array_equal(restored["w"], _state(2)["w"])


def test_verify_rereads_before_reporting_damage(s3_root, monkeypatch):
    _saved(s3_root)
    with _flipping(monkeypatch, _chunk_of(s3_root, 2)):
        report = jaxckpt.CheckpointManager(s3_root, read_only=True).verify(2)
    assert report.ok, report.problems


def test_open_step_and_export_reread(s3_root, monkeypatch, tmp_path):
    _saved(s3_root)
    with _flipping(monkeypatch, _chunk_of(s3_root, 2)):
        view = jaxckpt.open_step(s3_root, 2)
        np.testing.assert_array_equal(view["w"].read(), _state(2)["w"])
    with _flipping(monkeypatch, _chunk_of(s3_root, 2)):
        jaxckpt.export_safetensors(s3_root, tmp_path / "out.safetensors", step=2)
    tensors = dict(read_safetensors(tmp_path / "out.safetensors"))
    np.testing.assert_array_equal(tensors["w"], _state(2)["w"])


def _packs_of(root: str, step: int) -> str:
    """What every pack key of ``step`` holds: ``<step>.<attempt>/packs/`` (format 4)."""
    attempt = step_key(root, step).split("/")[2]
    return f"/{step}.{attempt}/packs/"


def test_packed_layout_rereads(s3_root, monkeypatch):
    _saved(s3_root, layout="packed")
    with _flipping(monkeypatch, _packs_of(s3_root, 2)):
        restored = jaxckpt.CheckpointManager(s3_root, read_only=True).restore(2)
    np.testing.assert_array_equal(restored["w"], _state(2)["w"])
    with _flipping(monkeypatch, _packs_of(s3_root, 2)):
        assert jaxckpt.CheckpointManager(s3_root, read_only=True).verify(2).ok


def test_a_zstd_archive_read_through_tensorstore_rereads(s3_root, monkeypatch, tmp_path):
    src = str(tmp_path / "src")
    _saved(src)
    assert cli.main(["cp", src, s3_root, "--compress", "zstd"]) == 0
    with _flipping(monkeypatch, _chunk_of(s3_root, 2)):
        restored = jaxckpt.CheckpointManager(s3_root, read_only=True).restore(2)
    np.testing.assert_array_equal(restored["w"], _state(2)["w"])


@pytest.mark.parametrize("record", ["tree.json", "manifest/0.json", "marker"])
def test_records_are_reread(s3_root, monkeypatch, record):
    _saved(s3_root)
    key = marker_key(2, 1) if record == "marker" else step_object(s3_root, 2, record)
    with _flipping(monkeypatch, key):
        restored = jaxckpt.CheckpointManager(s3_root, read_only=True).restore()
    np.testing.assert_array_equal(restored["w"], _state(2)["w"])


def test_damage_on_storage_is_still_reported(tmp_path, monkeypatch):
    root = str(tmp_path / "root")
    _saved(root)
    chunk = Path(root, _chunk_of(root, 2), "0", "0")
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    reads: list[str] = []
    read_buffer = LocalStorage.read_buffer

    def counting(self, key, size=None):
        reads.append(key)
        return read_buffer(self, key, size)

    monkeypatch.setattr(LocalStorage, "read_buffer", counting)
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"c/0/0 .*: checksum mismatch$"):
        mgr.restore(2)
    assert reads.count(f"{_chunk_of(root, 2)}0/0") == 2  # then once through TensorStore
    (problem,) = mgr.verify(2).problems
    assert problem.chunk == "c/0/0" and problem.message == "checksum mismatch"


def test_cp_rereads(s3_root, monkeypatch, tmp_path, capsys):
    _saved(s3_root)
    dst = str(tmp_path / "copy")
    with _flipping(monkeypatch, _chunk_of(s3_root, 2)):
        assert cli.main(["cp", s3_root, dst]) == 0
    assert "2 committed steps" in capsys.readouterr().out
    restored = jaxckpt.CheckpointManager(dst, read_only=True).restore(2)
    np.testing.assert_array_equal(restored["w"], _state(2)["w"])


def test_verify_rereads_array_metadata(s3_root, monkeypatch):
    _saved(s3_root)
    with _flipping(monkeypatch, f"{step_key(s3_root, 2)}arrays/w/zarr.json"):
        report = jaxckpt.CheckpointManager(s3_root, read_only=True).verify(2)
    assert report.ok, report.problems
