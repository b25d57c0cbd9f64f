"""Contract tests of CheckpointManager on local roots."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rootpaths import data_steps, marker_path, step_dir
from trees import assert_tree_bitexact, sample_state
from triggers import current_frame

import jaxckpt
from jaxckpt import policy
from jaxckpt.storage import open_storage


@pytest.fixture
def root(tmp_path: pathlib.Path) -> str:
    return str(tmp_path / "ckpt")


def test_round_trip_with_target_keeps_structure_dtypes_and_values(root):
    state = sample_state(3)
    with jaxckpt.CheckpointManager(root) as mgr:
        assert mgr.save(3, state) is True
    restored = jaxckpt.CheckpointManager(root).restore(target=state)
    assert_tree_bitexact(restored, state)
    assert isinstance(restored["params"]["w"], jax.Array)
    assert restored["params"]["w"].sharding == state["params"]["w"].sharding


def test_restore_without_target_gives_numpy_in_saved_nesting(root):
    state = sample_state(1)
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, state)
    restored = jaxckpt.CheckpointManager(root).restore()
    assert isinstance(restored["params"]["w"], np.ndarray)
    assert isinstance(restored["layers"], list) and restored["layers"][1]["k"].dtype == np.int32
    assert restored["name"] == "run-α" and restored["nothing"] is None and restored["lr"] == 0.125
    assert restored["params"]["b"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(restored["params"]["w"], np.asarray(state["params"]["w"]))
    assert restored["empty"].shape == (0, 3)
    assert restored["scalar"].shape == () and restored["scalar"] == np.float32(1.5)


def test_restore_into_shape_dtype_structs_with_sharding_and_dtype_cast(root):
    state = {"w": jnp.arange(24.0).reshape(4, 6), "n": 7}
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(0, state)
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    target = {"w": jax.ShapeDtypeStruct((4, 6), jnp.bfloat16, sharding=sharding), "n": 0}
    with pytest.raises(jaxckpt.TreeMismatchError, match="saved float32, target bfloat16"):
        jaxckpt.CheckpointManager(root).restore(0, target=target)  # lossy: needs consent
    out = jaxckpt.CheckpointManager(root).restore(0, target=target, allow_lossy_cast=True)
    assert out["w"].dtype == jnp.bfloat16 and out["w"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(out["w"], np.float32), np.arange(24.0).reshape(4, 6))
    assert out["n"] == 7  # non-array leaves come back with their saved values


def test_prng_keys_round_trip(root):
    state = {"new": jax.random.key(42), "old": jax.random.PRNGKey(7)}
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(0, state)
    out = jaxckpt.CheckpointManager(root).restore(target=state)
    assert jax.dtypes.issubdtype(out["new"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(
        jax.random.key_data(out["new"]), jax.random.key_data(state["new"])
    )
    np.testing.assert_array_equal(out["old"], state["old"])


def test_caller_may_donate_buffers_right_after_save(root):
    state = {"w": jnp.arange(1 << 16, dtype=jnp.float32)}
    expected = np.asarray(state["w"]).copy()
    update = jax.jit(lambda s: {"w": s["w"] * 0 - 1}, donate_argnums=0)
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, state)
        new = update(state)
        new = update(new)
        mgr.wait()
    np.testing.assert_array_equal(np.asarray(new["w"]), -np.ones(1 << 16, np.float32))
    out = jaxckpt.CheckpointManager(root).restore(1)
    np.testing.assert_array_equal(out["w"], expected)


def test_numpy_leaves_are_copied_so_caller_may_overwrite_them(root):
    arr = np.arange(1000, dtype=np.int64)
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"a": arr})
        arr[:] = -5
    np.testing.assert_array_equal(jaxckpt.CheckpointManager(root).restore(1)["a"], np.arange(1000))


def test_steps_latest_step_and_save_stats(root):
    with jaxckpt.CheckpointManager(root) as mgr:
        assert mgr.steps() == [] and mgr.latest_step() is None
        for s in (5, 1, 9):
            assert mgr.save(s, {"x": jnp.full(3, s)})
        mgr.wait()
        assert mgr.steps() == [1, 5, 9] and mgr.latest_step() == 9
        stats = mgr.save_stats()
        assert [s.step for s in stats] == [5, 1, 9] and all(s.nbytes > 0 for s in stats)
    assert jaxckpt.CheckpointManager(root).restore()["x"].tolist() == [9, 9, 9]


def _wait_until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s waiting for {what}"
        time.sleep(0.01)


def _blocked_in(thread: threading.Thread, function) -> bool:
    """Whether ``thread`` is currently executing inside ``function``."""
    frame = current_frame(thread)
    while frame is not None:
        if frame.f_code is function.__code__:
            return True
        frame = frame.f_back
    return False


def test_at_most_one_save_in_flight(root, tmp_path, monkeypatch):
    """A second save() waits for the first to commit before it writes anything."""
    from protocol_state import marker_state, pending_operation, step_objects

    resume = tmp_path / "resume"
    resume.mkdir()
    (resume / "data_written-2.resume").touch()  # only the first save pauses
    monkeypatch.setenv("JAXCKPT_PAUSE_AT", "data_written")
    monkeypatch.setenv("JAXCKPT_RESUME_DIR", str(resume))
    monkeypatch.setenv("JAXCKPT_PAUSE_S", "120")
    with jaxckpt.CheckpointManager(root) as mgr:
        storage = open_storage(root)
        assert mgr.save(1, {"x": jnp.full(3, 1)})
        _wait_until((resume / "data_written-1.reached").exists, "the first save's data")
        outcome: dict[str, object] = {}

        def second_save() -> None:
            try:
                outcome["saved"] = mgr.save(2, {"x": jnp.full(3, 2)})
                outcome["marker 1 then"] = marker_state(storage, 1)
            except BaseException as e:
                outcome["error"] = e

        thread = threading.Thread(target=second_save)
        thread.start()
        _wait_until(lambda: _blocked_in(thread, jaxckpt.CheckpointManager.wait), "save(2) waiting")
        assert marker_state(storage, 1) is None  # the first save is still paused
        assert pending_operation(storage, 2) is None and step_objects(storage, 2) == []
        (resume / "data_written-1.resume").touch()
        thread.join(timeout=60)
        assert not thread.is_alive(), "save(2) did not return after the first save committed"
        assert outcome == {"saved": True, "marker 1 then": "valid"}
        mgr.wait()
        assert mgr.steps() == [1, 2]


def test_adaptive_policy_sees_measured_blocking_times(root):
    """The manager feeds Adaptive the blocking seconds of its own saves."""
    seen: list[policy.SaveContext] = []

    class Recording(policy.Adaptive):
        def should_save(self, ctx: policy.SaveContext) -> bool:
            seen.append(ctx)
            return super().should_save(ctx)

    # With an MTBF of a million hours the interval is hours for any measured δ > 0;
    # only a save with no measurement yet (or no earlier save) is taken.
    with jaxckpt.CheckpointManager(root, save_policy=Recording(1e6, max_overhead=1.0)) as mgr:
        assert mgr.save(1, {"x": jnp.ones(4)}) is True
        mgr.wait()
        assert mgr.save(2, {"x": jnp.ones(4)}) is False
        measured = tuple(s.blocking_s for s in mgr.save_stats())
    assert [c.blocking_seconds for c in seen] == [(), measured]
    assert len(measured) == 1 and measured[0] > 0
    assert seen[1].last_save_time is not None and seen[1].last_saved_step == 1


def test_saving_an_existing_step_raises(root):
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(2, {"x": 1})
        mgr.wait()
        with pytest.raises(jaxckpt.StepAlreadyExistsError, match="step 2 already exists"):
            mgr.save(2, {"x": 2})
    assert jaxckpt.CheckpointManager(root).restore(2) == {"x": 1}


def test_missing_step_error_lists_committed_steps(root):
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"x": 1})
        mgr.save(4, {"x": 1})
    with pytest.raises(
        jaxckpt.StepNotFoundError, match=r"step 3 not found .*committed steps: 1, 4"
    ):
        jaxckpt.CheckpointManager(root).restore(3)
    with pytest.raises(FileNotFoundError):
        jaxckpt.CheckpointManager(root).metadata(3)


def test_restore_with_no_steps_raises(root):
    with pytest.raises(jaxckpt.StepNotFoundError, match="no committed steps"):
        jaxckpt.CheckpointManager(root).restore()


def test_tree_mismatch_names_every_path(root):
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"a": jnp.zeros((2, 3)), "b": jnp.zeros(4), "c": 1})
    target = {"a": jnp.zeros((2, 4)), "d": jnp.zeros(4), "c": 1}
    with pytest.raises(jaxckpt.TreeMismatchError) as info:
        jaxckpt.CheckpointManager(root).restore(1, target=target)
    text = str(info.value)
    assert "shape mismatch at ['a']: saved (2, 3) float32, target (2, 4) float32" in text
    assert "not in checkpoint: ['d']" in text
    assert "not in target: ['b'] (saved (4,) float32)" in text


@pytest.mark.parametrize(
    ("leaf", "message"),
    [
        (object(), "type object"),
        (np.array(["a", "bc"]), "dtype <U2 cannot be stored"),
        (np.array([b"a"]), "dtype |S1 cannot be stored"),
        (np.array([1, "x"], dtype=object), "dtype object"),
        (np.zeros(2, [("a", np.int32), ("b", np.float32)]), "dtype void64 cannot be stored"),
        (jnp.zeros(4, jnp.uint4), "dtype uint4 cannot be stored"),
        (np.zeros(4, jnp.float8_e4m3), "dtype float8_e4m3 cannot be stored"),
    ],
    ids=["object", "str", "bytes", "numpy-object", "structured", "uint4", "float8_e4m3"],
)
def test_unstorable_leaf_fails_in_save_naming_path_and_writes_nothing(root, leaf, message):
    """Refused synchronously in save(), before the pending record or any data exists."""
    from protocol_state import pending_operation, step_objects

    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": jnp.ones(3)})
        with pytest.raises(jaxckpt.UnsupportedLeafError, match=r"\['opt'\]\[1\]") as info:
            mgr.save(2, {"opt": [1, leaf]})
        assert message in str(info.value)
        assert mgr.steps() == [1]
        storage = open_storage(root)
        assert pending_operation(storage, 2) is None and step_objects(storage, 2) == []
        assert mgr.save(3, {"w": jnp.ones(3)})  # the manager is still usable
    assert jaxckpt.CheckpointManager(root).steps() == [1, 3]


def test_metadata_describes_tree_and_user_metadata(root):
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": jnp.zeros((8, 2), jnp.bfloat16), "n": 3}, metadata={"git": "abc"})
    meta = jaxckpt.CheckpointManager(root).metadata(1)
    assert meta.user_metadata == {"git": "abc"} and meta.step == 1 and meta.nbytes > 0
    by_path = {leaf.path: leaf for leaf in meta.tree}
    assert by_path["['w']"].shape == (8, 2) and by_path["['w']"].dtype == "bfloat16"
    assert by_path["['w']"].nbytes == 32 and by_path["['w']"].sharding["type"]
    assert by_path["['n']"].kind == "value" and by_path["['n']"].value == 3


def _chunk_files(root: str, step: int, name: str) -> list[str]:
    """Chunk files of an array, in file-name order (c/0, c/1, c/10, ...)."""
    base = step_dir(root, step, "arrays", name, "c")
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(base) for f in fs)


def _flip_byte(path: str, offset: int = 5) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.usefixtures("plain_by_default")
def test_corrupt_chunk_is_detected_named_and_falls_back(root, caplog):
    with jaxckpt.CheckpointManager(root, chunk_bytes=1024) as mgr:
        mgr.save(1, {"w": jnp.arange(4096.0)})
        mgr.save(2, {"w": jnp.arange(4096.0) + 1})
    bad = step_dir(root, 2, "arrays", "w", "c", "2")
    _flip_byte(bad)
    mgr = jaxckpt.CheckpointManager(root)
    with pytest.raises(jaxckpt.CorruptCheckpointError) as info:
        mgr.restore(2)
    assert "step 2" in str(info.value) and "['w']" in str(info.value) and "c/2" in str(info.value)
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        out = mgr.restore()
    np.testing.assert_array_equal(out["w"], np.arange(4096.0))
    assert "falling back to step 1" in caplog.text
    report = mgr.verify(2)
    assert not report.ok and [(p.path, p.chunk) for p in report.problems] == [("['w']", "c/2")]
    assert report.chunks_checked == 16
    assert mgr.verify(1).ok


@pytest.mark.usefixtures("plain_by_default")
def test_missing_chunk_is_corruption_not_zeros(root):
    with jaxckpt.CheckpointManager(root, chunk_bytes=1024) as mgr:
        mgr.save(1, {"w": jnp.arange(1024.0)})
    os.unlink(_chunk_files(root, 1, "w")[0])
    mgr = jaxckpt.CheckpointManager(root, fallback_on_corrupt=False)
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"chunk c/0 .*missing"):
        mgr.restore()
    assert mgr.verify(1).problems[0].message == "missing"


def test_corrupt_manifest_or_tree_record_is_detected(root):
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": jnp.arange(8.0)})
    _flip_byte(step_dir(root, 1, "tree.json"), 3)
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"tree\.json does not match"):
        jaxckpt.CheckpointManager(root).restore(1)
    assert not jaxckpt.CheckpointManager(root).verify(1).ok


def test_partial_step_is_invisible_and_collected_by_next_writer(root):
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": jnp.arange(8.0)})
        mgr.save(2, {"w": jnp.arange(8.0)})
    data = step_dir(root, 2)
    attempt = os.path.basename(data.rstrip("/"))
    marker = marker_path(root, 2)
    marker.unlink()  # as if killed before the marker
    os.makedirs(os.path.join(root, "pending", "2"), exist_ok=True)
    with open(os.path.join(root, "pending", "2", f"{attempt}.json"), "w") as f:
        f.write(json.dumps({"format": "jaxckpt", "version": 2, "operation": "save", "started": 0}))
    reader = jaxckpt.CheckpointManager(root, read_only=True)
    assert reader.steps() == [1]
    with pytest.raises(jaxckpt.UncommittedStepError, match=r"step 2 .* partial"):
        reader.restore(2)
    assert os.path.isdir(data)  # read-only: nothing removed
    jaxckpt.CheckpointManager(root).close()  # a new writer epoch fences the attempt and collects it
    assert not os.path.exists(data)
    assert os.listdir(os.path.join(root, "pending", "2")) == []


def test_torn_marker_is_not_a_commit(root):
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": jnp.arange(8.0)})
    data_dir = step_dir(root, 1)
    path = marker_path(root, 1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert jaxckpt.CheckpointManager(root, read_only=True).steps() == []
    with jaxckpt.CheckpointManager(root) as mgr:  # damage is corruption, not garbage
        assert mgr.steps() == []
        with pytest.raises(jaxckpt.CorruptCheckpointError, match="damaged commit marker"):
            mgr.restore(1)
        with pytest.raises(jaxckpt.StepAlreadyExistsError, match="damaged marker"):
            mgr.save(1, {"w": jnp.arange(8.0) * 2})
        assert mgr.garbage_collect() == []
        assert os.path.isdir(data_dir) and path.exists()
        assert mgr.garbage_collect(force=True) == [1]
        assert not os.path.exists(data_dir) and not path.exists()
        mgr.save(1, {"w": jnp.arange(8.0) * 2})
    np.testing.assert_array_equal(
        jaxckpt.CheckpointManager(root).restore(1)["w"], np.arange(8.0) * 2
    )


def test_newer_format_version_is_refused(root):
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": jnp.arange(8.0)})
    path = marker_path(root, 1)
    marker = json.loads(pathlib.Path(path).read_text())
    marker["version"] = 99
    marker.pop("marker_crc32c")
    from jaxckpt.records import crc32c, dumps

    marker["marker_crc32c"] = crc32c(dumps(marker))
    pathlib.Path(path).write_bytes(dumps(marker))
    with pytest.raises(jaxckpt.UnsupportedFormatError, match="format version 99"):
        jaxckpt.CheckpointManager(root, read_only=True).restore(1)


@pytest.mark.usefixtures("plain_by_default")
def test_background_failure_surfaces_on_wait_and_step_is_not_listed(root, monkeypatch):
    from jaxckpt.formats import _tsio

    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": jnp.arange(8.0)})
        mgr.wait()

        def boom(self, step, arrays):
            raise OSError("simulated I/O error")

        monkeypatch.setattr(_tsio.ArrayWriter, "write", boom)
        assert mgr.save(2, {"w": jnp.arange(8.0)})
        with pytest.raises(jaxckpt.SaveFailedError, match=r"step 2 .*simulated I/O error"):
            mgr.wait()
        monkeypatch.undo()
        assert mgr.steps() == [1]
        mgr.save(3, {"w": jnp.arange(8.0)})
    assert jaxckpt.CheckpointManager(root).steps() == [1, 3]


@pytest.mark.usefixtures("plain_by_default")
def test_background_failure_surfaces_on_close(root, monkeypatch):
    from jaxckpt.formats import _tsio

    mgr = jaxckpt.CheckpointManager(root)
    monkeypatch.setattr(_tsio.ArrayWriter, "write", lambda *a: 1 / 0)
    assert mgr.save(1, {"w": jnp.arange(8.0)})
    with pytest.raises(jaxckpt.SaveFailedError, match=r"step 1 .*division by zero"):
        mgr.close()
    monkeypatch.undo()
    mgr.close()  # closed: idempotent
    assert jaxckpt.CheckpointManager(root).steps() == []


@pytest.mark.usefixtures("plain_by_default")
def test_background_failure_surfaces_on_next_save(root, monkeypatch):
    from jaxckpt.formats import _tsio

    mgr = jaxckpt.CheckpointManager(root)
    monkeypatch.setattr(_tsio.ArrayWriter, "write", lambda *a: 1 / 0)
    mgr.save(1, {"w": jnp.arange(8.0)})
    with pytest.raises(jaxckpt.SaveFailedError, match="step 1"):
        mgr.save(2, {"w": jnp.arange(8.0)})
    monkeypatch.undo()
    mgr.close()


@pytest.mark.usefixtures("plain_by_default")
def test_tolerated_failed_saves_let_training_go_on_until_too_many_in_a_row(root, monkeypatch):
    """``tolerate_failed_saves=1``: a failed save (a full disk) is logged, counted and in
    the ledger, and the next save tries again; a commit starts the count again; two in a
    row raise (the game day's full local disk crashed every process's job)."""
    import errno

    from jaxckpt.formats import _tsio
    from jaxckpt.ledger import read_ledger
    from jaxckpt.storage import open_storage

    write = _tsio.ArrayWriter.write

    def full_for(*steps):  # the disk is full while these are saved
        def put(self, loc, arrays):
            if loc.step in steps:
                raise OSError(errno.ENOSPC, "No space left on device")
            return write(self, loc, arrays)

        return put

    state = {"w": jnp.arange(8.0)}
    monkeypatch.setattr(_tsio.ArrayWriter, "write", full_for(2, 5, 6))
    mgr = jaxckpt.CheckpointManager(root, tolerate_failed_saves=1, ledger_flush_s=0.2)
    for step in (1, 2, 3, 4, 5, 6):
        assert mgr.save(step, state)  # 3: 2 failed, told; 6: 5 failed after 4 committed
    assert mgr.failed_saves == 2
    with pytest.raises(jaxckpt.SaveFailedError, match=r"step 6 .*No space left"):
        mgr.save(7, state)  # 5 and 6 failed in a row
    mgr.close()
    assert mgr.steps() == [1, 3, 4] and mgr.failed_saves == 2
    (run,) = read_ledger(open_storage(root))
    assert [e["step"] for e in run.of("save_failed")] == [2, 5, 7]  # 7: its save() raised
    monkeypatch.setattr(_tsio.ArrayWriter, "write", full_for(2))
    again = jaxckpt.CheckpointManager(root, tolerate_failed_saves=1)
    again.save(2, state)
    with pytest.raises(jaxckpt.SaveFailedError, match="step 2"):  # wait() always raises
        again.wait()
    again.close()


def _local_keeping_3(tmp_path):
    """A manager with a local tier keeping 3 steps (none promoted) that lets a failed save pass."""
    return jaxckpt.CheckpointManager(
        tmp_path / "durable",
        local_root=str(tmp_path / "local"),
        local_retention=policy.KeepLast(3),
        promote_policy=policy.EveryNSteps(1000),
        tolerate_failed_saves=1,
    )


def _disk_full_at(monkeypatch, step: int) -> None:
    """The array writes of ``step`` fail with ENOSPC (a full local disk)."""
    import errno

    from jaxckpt.formats import _tsio

    write = _tsio.ArrayWriter.write

    def put(self, loc, arrays):
        if loc.step == step:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, loc, arrays)

    monkeypatch.setattr(_tsio.ArrayWriter, "write", put)


@pytest.mark.usefixtures("plain_by_default")
def test_a_full_local_tier_keeps_only_its_newest_step_and_the_next_save_commits(
    tmp_path, monkeypatch
):
    """A save that fails with ENOSPC on its own local tier makes room there (local
    retention keeps only the newest step) before the next save: on the game day a full
    local disk crashed the job."""
    from jaxckpt.tiers._peers import NoReplicas

    _disk_full_at(monkeypatch, 4)
    withdrawn: list[int] = []  # the tier's replicas are told too (their held copies go)
    monkeypatch.setattr(NoReplicas, "withdraw", lambda self, step: withdrawn.append(step))
    state = {"w": jnp.arange(8.0)}
    with _local_keeping_3(tmp_path) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, state)
        mgr.save(5, state)  # 4 failed: room made first, then 5 saved
        mgr.wait()
        mgr.wait_for_deletions()
        assert mgr.steps("local") == [3, 5] and mgr.failed_saves == 1
        assert withdrawn == [4]
        mgr.save(6, state)
        mgr.wait()
        mgr.wait_for_deletions()
        assert mgr.steps("local") == [3, 5, 6]  # KeepLast(3) again


def test_a_full_local_tier_found_by_a_saves_checks_is_a_tolerated_failed_save(
    tmp_path, monkeypatch
):
    """A disk filled to its last byte fails a save at its first write, the pending record
    in ``save()``'s checks, not in the background: that raised from ``save()`` whatever
    ``tolerate_failed_saves`` said (the game day's job crashed at its next save). Now
    ``save()`` returns False, counts it and makes room, and the next save commits."""
    import errno

    from jaxckpt.storage import LocalStorage

    write = LocalStorage.write
    full = {"on": False}

    def put(self, key, data, **kw):
        if full["on"] and key.startswith("pending/"):
            raise jaxckpt.StorageError(errno.ENOSPC, f"cannot write {key}: no space left")
        return write(self, key, data, **kw)

    monkeypatch.setattr(LocalStorage, "write", put)
    state = {"w": jnp.arange(8.0)}
    with _local_keeping_3(tmp_path) as mgr:
        for step in (1, 2):
            assert mgr.save(step, state)
            mgr.wait()
        full["on"] = True
        assert mgr.save(3, state) is False
        assert mgr.failed_saves == 1
        full["on"] = False
        assert mgr.save(4, state)
        mgr.wait()
        mgr.wait_for_deletions()
        assert mgr.steps("local") == [2, 4]  # room made (one step kept), then 4
        full["on"] = True
        assert mgr.save(5, state) is False
        with pytest.raises(jaxckpt.StorageError, match="no space left"):
            mgr.save(6, state)  # two in a row: raised
        full["on"] = False


@pytest.mark.usefixtures("plain_by_default")
def test_a_local_tier_that_stays_full_keeps_one_step_until_it_has_room(tmp_path, monkeypatch):
    """A disk filled by something else stays full: keeping ``local_retention``'s steps
    again right after the room was made failed every other save (4 processes, a 64 MiB
    tmpfs filled to its last byte: 5 of 10 saves failed). Until its file system has the
    room of three steps more, retention keeps only the newest step there."""
    import errno

    from jaxckpt.formats import _tsio
    from jaxckpt.storage import LocalStorage
    from jaxckpt.tiers._peers import NoReplicas

    write = _tsio.ArrayWriter.write
    size: dict[str, int | None] = {"disk": None}  # None: not full yet

    def used(root):
        return sum(f.stat().st_size for f in pathlib.Path(root).rglob("*") if f.is_file())

    def put(self, loc, arrays):
        if loc.step == 2:  # something else fills the disk: what is used now is all there is
            size["disk"] = used(tmp_path / "local")
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, loc, arrays)

    def free_bytes(self):
        return 1 << 40 if size["disk"] is None else max(0, size["disk"] - used(self.uri))

    monkeypatch.setattr(_tsio.ArrayWriter, "write", put)
    monkeypatch.setattr(LocalStorage, "free_bytes", free_bytes)
    told: list[str | None] = []  # the replicas: refused while full (a peer's listener)
    monkeypatch.setattr(NoReplicas, "short_of_room", lambda self, why: told.append(why))
    state = {"w": jnp.arange(8.0)}
    with _local_keeping_3(tmp_path) as mgr:
        local = []
        for step in (1, 2, 3, 4, 5, 6, 7):
            if step == 6:
                size["disk"] = None  # room again
            mgr.save(step, state)
            if step != 2:  # its failure is seen (and let pass) by the next save
                mgr.wait()
                mgr.wait_for_deletions()
                local.append(mgr.steps("local"))
        assert mgr.failed_saves == 1
    # one step kept while full; after 6's pass found room, KeepLast(3) again
    assert local == [[1], [3], [4], [5], [6], [6, 7]]
    assert [why is None for why in told] == [False, True]


@pytest.mark.usefixtures("plain_by_default")
def test_a_full_local_tier_keeps_no_waiting_step_besides_its_newest(tmp_path, monkeypatch):
    """A storm stalled promotion on a node whose disk was full: the steps waiting for it
    (``promote_backlog``) were kept besides the newest, took the room, and every save
    failed until the job crashed (game day, seed 2: 4 failed saves in a row, 41 steps
    lost). While the tier is full, waiting steps older than its newest are superseded:
    their requests are withdrawn and they are deleted; the newest waits for promotion."""
    from jaxckpt.records import read_requests
    from jaxckpt.storage import LocalStorage

    _disk_full_at(monkeypatch, 3)
    monkeypatch.setattr(LocalStorage, "free_bytes", lambda self: 0)  # full from step 3 on
    state = {"w": jnp.arange(8.0)}
    with jaxckpt.CheckpointManager(
        tmp_path / "durable",
        local_root=str(tmp_path / "local"),
        local_retention=policy.KeepLast(3),
        promotion="external",  # no sidecar runs: a durable root that does not answer
        promote_policy=policy.EveryNSteps(2),
        tolerate_failed_saves=1,
    ) as mgr:
        seen = []
        for step in (1, 2, 3, 4, 5, 6, 7):
            mgr.save(step, state)
            if step != 3:  # its failure is seen (and let pass) by the next save
                mgr.wait()
                mgr.wait_for_deletions()
                seen.append((mgr.steps("local"), sorted(read_requests(mgr._tiers[0].protocol))))
        assert mgr.failed_saves == 1
    assert seen == [
        ([1], []),
        ([1, 2], [2]),
        ([4], [4]),  # full since 3 failed: 2, waiting, superseded by 4
        ([5], []),
        ([6], [6]),
        ([7], []),
    ]


def test_root_that_cannot_be_created_names_the_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(jaxckpt.StorageError, match=str(blocker)):
        jaxckpt.CheckpointManager(str(blocker / "ckpt"))


def test_read_only_manager_on_missing_root_says_not_a_root(tmp_path):
    with pytest.raises(jaxckpt.NotACheckpointRootError, match="not a jaxckpt root"):
        jaxckpt.CheckpointManager(str(tmp_path / "nope"), read_only=True)


def test_file_uri_root(tmp_path):
    with jaxckpt.CheckpointManager(f"file://{tmp_path}") as mgr:
        mgr.save(1, {"x": jnp.ones(2)})
    assert jaxckpt.CheckpointManager(str(tmp_path)).steps() == [1]


def test_bad_step_numbers_are_rejected(root):
    with jaxckpt.CheckpointManager(root) as mgr:
        for bad in (-1, 1.5, True, "3"):
            with pytest.raises(ValueError, match="non-negative int"):
                mgr.save(bad, {"x": 1})


@pytest.mark.usefixtures("plain_by_default")
def test_checkpoint_opens_with_zarr_python_alone(root):
    import zarr

    w = np.arange(60, dtype=np.float32).reshape(6, 10)
    with jaxckpt.CheckpointManager(root, chunk_bytes=64) as mgr:
        mgr.save(7, {"params": {"w": jnp.asarray(w)}, "i": jnp.arange(5, dtype=jnp.int8)})
    group = zarr.open_group(step_dir(root, 7, "arrays"), mode="r")
    assert sorted(group.array_keys()) == ["i", "params.w"]
    np.testing.assert_array_equal(group["params.w"][...], w)
    np.testing.assert_array_equal(group["i"][...], np.arange(5, dtype=np.int8))
    assert group["params.w"].chunks == (1, 10)


def test_delete_retracts_marker_then_data(root):
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"x": jnp.ones(2)})
        mgr.save(2, {"x": jnp.ones(2)})
        mgr.wait()
        mgr.delete(1)
        assert mgr.steps() == [2]
        with pytest.raises(jaxckpt.StepNotFoundError):
            mgr.delete(1)
    assert data_steps(open_storage(root)) == {2}


def test_full_disk_fails_cleanly_and_keeps_earlier_steps(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=4M tmpfs {mnt} 2>/dev/null") != 0:
        pytest.fail("this test needs root to mount a small tmpfs (CI runs as root)")
    try:
        root = str(mnt / "ckpt")
        with jaxckpt.CheckpointManager(root) as mgr:
            mgr.save(1, {"w": jnp.ones(1 << 18, jnp.float32)})  # 1 MiB
            mgr.wait()
            mgr.save(2, {"w": jnp.ones(1 << 20, jnp.float32)})  # 4 MiB: does not fit
            with pytest.raises(jaxckpt.SaveFailedError, match="step 2"):
                mgr.wait()
        mgr = jaxckpt.CheckpointManager(root)  # next writer collects the partial step
        assert mgr.steps() == [1]
        np.testing.assert_array_equal(mgr.restore()["w"], np.ones(1 << 18, np.float32))
        assert data_steps(open_storage(root)) == {1}
    finally:
        os.system(f"umount {mnt}")


def test_save_policy_and_force(root):
    with jaxckpt.CheckpointManager(root, save_policy=policy.EveryNSteps(10)) as mgr:
        results = {s: mgr.save(s, {"s": s}) for s in range(1, 25)}
        assert [s for s, saved in results.items() if saved] == [10, 20]
        assert mgr.save(21, {"s": 21}, force=True) is True
        mgr.wait()
        assert mgr.steps() == [10, 20, 21]


def test_retention_deletes_in_background_and_explain_says_why(root):
    retention = policy.KeepLast(2) | policy.KeepBest(1, metric="loss", mode="min")
    with jaxckpt.CheckpointManager(root, retention=retention) as mgr:
        for s, loss in [(1, 5.0), (2, 1.0), (3, 4.0), (4, 3.0), (5, 2.0)]:
            mgr.save(s, {"s": s}, metrics={"loss": loss}, keep=(s == 1))
        mgr.wait()
        mgr.wait_for_deletions(timeout_s=30)
        assert mgr.steps() == [1, 2, 4, 5]
        why = mgr.explain()
        assert why[1] == ("pinned",) and "newest" in why[5]
        assert any("KeepBest" in r for r in why[2])
    assert data_steps(open_storage(root)) == {1, 2, 4, 5}


def test_public_api_names():
    assert set(jaxckpt.__all__) == {
        "CheckpointError", "CheckpointManager", "CheckpointOptions", "CorruptCheckpointError",
        "LeafInfo", "LeafMismatch", "NotACheckpointRootError", "Problem", "ResumeReport",
        "SaveFailedError", "SaveStats", "SaveTimeoutError", "StepAlreadyExistsError",
        "StepMetadata", "StepNotFoundError", "StorageError", "TreeMismatchError",
        "UncommittedStepError", "UnsupportedFormatError", "UnsupportedLeafError",
        "VerifyReport", "WriterFencedError", "check_resume", "nnx_step_fn", "policy",
        "LeafView", "StepView", "open_step", "diff_steps", "export_orbax", "export_safetensors",
        "import_orbax", "import_safetensors", "PromotionError", "PromotionTimeoutError",
        "ObjectStoreOptions", "LocalRootInUseError", "PeerError", "PeerAuthError",
        "PlacementError", "Report", "report", "PublishOptions",
    }  # fmt: skip
    for name in jaxckpt.__all__:
        assert getattr(jaxckpt, name) is not None
    for name in jaxckpt.__all__:
        obj = getattr(jaxckpt, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, jaxckpt.CheckpointError) and obj.__doc__


@pytest.mark.usefixtures("plain_by_default")
def test_declined_save_surfaces_a_finished_background_failure(root, monkeypatch):
    from jaxckpt.formats import _tsio

    mgr = jaxckpt.CheckpointManager(root, save_policy=policy.EveryNSteps(10))
    monkeypatch.setattr(_tsio.ArrayWriter, "write", lambda *a: 1 / 0)
    assert mgr.save(10, {"w": jnp.arange(8.0)})
    # Declined saves return False while the failing save runs, and raise once it
    # has failed; neither waits for it.
    deadline = time.monotonic() + 60
    with pytest.raises(jaxckpt.SaveFailedError, match="step 10"):
        while time.monotonic() < deadline:
            assert mgr.save(11, {"w": jnp.arange(8.0)}) is False
            time.sleep(0.01)
    monkeypatch.undo()
    assert mgr.save(12, {"w": 1}) is False
    mgr.close()


def test_create_only_local_writes_never_leave_a_torn_record(tmp_path):
    from jaxckpt.storage import LocalStorage, PreconditionFailed

    storage = LocalStorage(str(tmp_path))
    storage.write("commits/1.json", b"first", exclusive=True)
    with pytest.raises(PreconditionFailed):
        storage.write("commits/1.json", b"second", exclusive=True)
    assert storage.read("commits/1.json") == b"first"
    assert storage.list("commits/") == ["commits/1.json"]  # no temporary files left behind
    (tmp_path / "commits" / ".2.json.dead.tmp").write_bytes(b"half")  # a crash mid-create
    jaxckpt.CheckpointManager(str(tmp_path)).close()  # GC also drops the temp file
    assert storage.list("commits/") == ["commits/1.json"]
    # A fresh one may be a live writer's create in progress: kept until TEMP_GRACE_S old.
    fresh = f".3.json.{int(time.time())}-2414f4.tmp"
    (tmp_path / "commits" / fresh).write_bytes(b"half")
    jaxckpt.CheckpointManager(str(tmp_path)).close()
    assert storage.list("commits/") == [f"commits/{fresh}", "commits/1.json"]


def test_numpy_results_are_read_only_views_or_arrays(root):
    with jaxckpt.CheckpointManager(root, chunk_bytes=64) as mgr:
        mgr.save(1, {"one_chunk": np.arange(4.0), "many_chunks": np.arange(64.0)})
    out = jaxckpt.CheckpointManager(root).restore(1)
    for value in out.values():
        assert not value.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            value[0] = 1.0
    np.testing.assert_array_equal(out["many_chunks"], np.arange(64.0))


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("jaxckpt-write")]


@pytest.mark.usefixtures("plain_by_default")
@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_writer_nice_lowers_the_save_thread_only(root):
    main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    state = {"w": jnp.arange(8.0)}
    with jaxckpt.CheckpointManager(root, writer_nice=max(7, main_nice)) as mgr:
        mgr.save(1, state)
        mgr.wait()
        (writer,) = [t for t in _writer_threads() if t.is_alive()]
        assert writer.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == max(7, main_nice)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_nice
        np.testing.assert_array_equal(mgr.restore(1)["w"], np.arange(8.0))
    with jaxckpt.CheckpointManager(root) as mgr:  # the default leaves the thread alone
        mgr.save(2, state)
        mgr.wait()
        (writer,) = [t for t in _writer_threads() if t.is_alive()]
        assert writer.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == main_nice


@pytest.mark.parametrize("nice", [-1, 20, True])
def test_writer_nice_is_validated(nice):
    with pytest.raises(ValueError, match="writer_nice"):
        jaxckpt.CheckpointOptions(writer_nice=nice)
