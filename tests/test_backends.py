"""The manager's core contract on every backend: local directory, S3 server, GCS emulator."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from benchkit import servers
from rootpaths import chunk_path, data_objects, data_steps
from trees import assert_tree_bitexact, sample_state

import jaxckpt
from jaxckpt.commit import CommitProtocol
from jaxckpt.records import json_record
from jaxckpt.storage import open_storage

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_dtypes() -> list[str]:
    """The dtypes the README's "Supported leaves" paragraph names in backticks."""
    text = README.read_text()
    paragraph = text[text.index("Supported leaves:") :].split("(64-bit", 1)[0]
    return re.findall(r"`([a-z0-9_]+)`", paragraph)


def dtype_leaves(seed: int) -> dict[str, jax.Array]:
    """One small ``jax.Array`` per README dtype (call under ``jax.enable_x64``)."""
    rng = np.random.default_rng(seed)
    leaves = {}
    for name in readme_dtypes():
        dtype = np.dtype(jnp.dtype(name))
        if name == "bool":
            value = rng.integers(0, 2, (3, 5)).astype(bool)
        elif name in ("int2", "int4"):  # sub-byte: one value per byte, in range
            info = ml_dtypes.iinfo(dtype)
            value = rng.integers(int(info.min), int(info.max), (3, 5), endpoint=True).astype(dtype)
        elif np.issubdtype(dtype, np.integer):  # every bit pattern, extremes included
            value = rng.integers(0, 256, 15 * dtype.itemsize, dtype=np.uint8).view(dtype)
            value = value.reshape(3, 5)
        elif np.issubdtype(dtype, np.complexfloating):
            value = (rng.standard_normal((3, 5)) + 1j * rng.standard_normal((3, 5))).astype(dtype)
        else:
            value = (rng.standard_normal((3, 5)) * 2).astype(dtype)
        leaves[name] = jax.device_put(value)
        assert leaves[name].dtype == dtype, (name, leaves[name].dtype)
    return leaves


def test_readme_names_every_storable_dtype_and_no_other():
    from jaxckpt.records import storage_problem

    named = readme_dtypes()
    assert len(named) == len(set(named)) > 20
    assert [n for n in named if storage_problem(np.dtype(jnp.dtype(n)))] == []
    for refused in ("uint2", "uint4", "float8_e4m3", "float6_e2m3fn"):
        assert storage_problem(np.dtype(jnp.dtype(refused))), refused


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_round_trip_all_dtypes_and_tree_shapes(storage_root, layout):
    with jax.enable_x64(True):
        state = {**sample_state(2), "dtypes": dtype_leaves(2)}
        assert {type(x) for x in state["dtypes"].values()} == {type(jnp.zeros(1))}
        with jaxckpt.CheckpointManager(storage_root, chunk_bytes=256, layout=layout) as mgr:
            assert mgr.save(2, state)
            mgr.wait()
            assert mgr.steps() == [2]
        reader = jaxckpt.CheckpointManager(storage_root, read_only=True)
        restored = reader.restore(target=state)
        assert_tree_bitexact(restored, state)
        assert all(isinstance(x, jax.Array) for x in restored["dtypes"].values())
        plain = reader.restore(2)
    assert plain["name"] == "run-α" and plain["layers"][1]["k"].tolist() == [0, 1, 2, 3]
    assert {k: v.dtype for k, v in plain["dtypes"].items()} == {
        k: np.dtype(v.dtype) for k, v in state["dtypes"].items()
    }
    assert reader.verify(2).ok
    packs = [k for k in data_objects(storage_root, 2) if "/packs/" in k]
    assert len(packs) == (1 if layout == "packed" else 0)


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_missing_step_and_tree_mismatch(storage_root, layout):
    with jaxckpt.CheckpointManager(storage_root, layout=layout) as mgr:
        mgr.save(1, {"a": jnp.zeros((2, 3))})
    mgr = jaxckpt.CheckpointManager(storage_root)
    with pytest.raises(jaxckpt.StepNotFoundError, match=r"step 5 not found .*committed steps: 1"):
        mgr.restore(5)
    with pytest.raises(jaxckpt.TreeMismatchError, match=r"not in checkpoint: \['b'\]"):
        mgr.restore(1, target={"a": jnp.zeros((2, 3)), "b": jnp.zeros(1)})


@pytest.mark.usefixtures("plain_by_default")
def test_corrupted_object_is_detected_and_restore_falls_back(storage_root):
    with jaxckpt.CheckpointManager(storage_root, chunk_bytes=512) as mgr:
        mgr.save(1, {"w": jnp.arange(1024.0)})
        mgr.save(2, {"w": jnp.arange(1024.0) * 2})
    servers.corrupt_object(chunk_path(storage_root, 2, "w", 3))
    mgr = jaxckpt.CheckpointManager(storage_root)
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"step 2: \['w'\]: chunk c/3"):
        mgr.restore(2)
    np.testing.assert_array_equal(mgr.restore()["w"], np.arange(1024.0))
    report = mgr.verify(2)
    assert not report.ok and report.problems[0].chunk == "c/3"


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_partial_step_is_invisible_and_garbage_collected(storage_root, layout):
    with jaxckpt.CheckpointManager(storage_root, layout=layout) as mgr:
        mgr.save(1, {"w": jnp.arange(8.0)})
        mgr.save(2, {"w": jnp.arange(8.0)})
    storage = open_storage(storage_root)
    marker = CommitProtocol(storage).require_marker(2)
    storage.delete(marker.key)  # as if killed just before the marker
    storage.write(marker.location.pending_key, json_record(operation="save", started=0.0))
    assert jaxckpt.CheckpointManager(storage_root, read_only=True).steps() == [1]
    assert storage.list(marker.location.prefix)
    jaxckpt.CheckpointManager(storage_root).close()  # the next writer collects it
    assert storage.list(marker.location.prefix) == [] and storage.list("pending/") == []
    assert jaxckpt.CheckpointManager(storage_root).steps() == [1]


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_background_failure_keeps_earlier_steps(storage_root, monkeypatch, layout):
    from jaxckpt.formats import _packed as _pack
    from jaxckpt.formats import _tsio

    mgr = jaxckpt.CheckpointManager(storage_root, layout=layout)
    mgr.save(1, {"w": jnp.arange(8.0)})
    mgr.wait()
    writer = _tsio.ArrayWriter if layout == "plain" else _pack.PackWriter
    monkeypatch.setattr(writer, "write", lambda *a: 1 / 0)
    mgr.save(2, {"w": jnp.arange(8.0)})
    with pytest.raises(jaxckpt.SaveFailedError, match="step 2"):
        mgr.wait()
    monkeypatch.undo()
    mgr.close()
    again = jaxckpt.CheckpointManager(storage_root)
    assert again.steps() == [1]
    np.testing.assert_array_equal(again.restore()["w"], np.arange(8.0))


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_delete_and_retention(storage_root, layout):
    from jaxckpt import policy

    with jaxckpt.CheckpointManager(
        storage_root, retention=policy.KeepLast(2), layout=layout
    ) as mgr:
        for s in range(1, 6):
            mgr.save(s, {"s": s, "w": jnp.full(4, s)})
        mgr.wait()
        mgr.wait_for_deletions(timeout_s=60)
        assert mgr.steps() == [4, 5]
        mgr.delete(4)
        assert mgr.steps() == [5]
    storage = open_storage(storage_root)
    assert data_steps(storage) == {5}


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_orbax_never_sees_the_root_uri_and_its_placeholder_is_never_created(storage_root, layout):
    import os

    from jaxckpt.saving import _handler

    placeholder = _handler.orbax_step_path(1)
    with jaxckpt.CheckpointManager(storage_root, layout=layout) as mgr:
        mgr.save(1, {"w": jnp.arange(4.0)})
    assert not os.path.exists(str(placeholder)) and not os.path.exists(str(placeholder.parent))
    assert jaxckpt.CheckpointManager(storage_root).steps() == [1]


def test_explicit_s3_endpoint_option_without_environment(s3_server, monkeypatch):
    """An endpoint given only as an option serves the data path and the records alike."""
    import uuid

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    options = {"endpoint": s3_server.endpoint, "max_retries": 1}
    with jaxckpt.CheckpointManager(root, storage_options=options) as mgr:
        mgr.save(1, {"w": jnp.arange(4.0)})
    reader = jaxckpt.CheckpointManager(root, storage_options=options, read_only=True)
    np.testing.assert_array_equal(reader.restore(1)["w"], np.arange(4.0))


def test_object_store_options_as_a_mapping_leave_a_directory_root_alone(tmp_path: Path) -> None:
    """A launch script's ``storage_options`` for its cloud root also opens a local root and
    a local tier (as the typed options do); a key nobody takes is named."""
    options = {"max_retries": 1, "timeout_s": 30.0, "io_concurrency": 4}
    root, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with jaxckpt.CheckpointManager(root, local_root=local, storage_options=options) as mgr:
        mgr.save(1, {"w": jnp.arange(4.0)})
    assert jaxckpt.CheckpointManager(root, storage_options=options).latest_step() == 1
    with pytest.raises(ValueError, match=r"storage_options \['max_retry'\] are options neither"):
        jaxckpt.CheckpointManager(root, storage_options={"max_retry": 1})


def test_the_saves_own_error_is_found_under_orbaxs_wrapper() -> None:
    """Orbax's ChainedFuture turns any TimeoutError of the background save (an agreement
    that names the process that never came) into its own, naming nobody: the session
    reports the error behind it."""
    from jaxckpt.commit._agree import AgreementTimeoutError
    from jaxckpt.saving._helpers import behind

    ours = AgreementTimeoutError("no 'written' from process 1 within 6s")
    try:
        try:
            raise ours
        except TimeoutError as e:
            raise TimeoutError("ChainedFuture completed 0/1 futures but timed out") from e
    except TimeoutError as wrapper:
        assert behind(wrapper, jaxckpt.CheckpointError) is ours
        assert behind(ValueError("x"), jaxckpt.CheckpointError) is None
