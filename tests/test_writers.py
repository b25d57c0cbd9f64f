"""Many writers, one truth: immutable attempts, writer fencing, damage that deletes nothing.

Real processes (``writer_child.py``) race on one step and play a zombie job
beside a restarted one, on a local directory, S3 (moto) and GCS (emulator).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import harness
import jax.numpy as jnp
import numpy as np
import pytest
import writer_child as child
from rootpaths import marker_path, step_dir
from triggers import HANG_S, Hold, Interrupter, main_thread_in, wait_until

import jaxckpt
from jaxckpt import cli
from jaxckpt.commit import CommitProtocol, scan
from jaxckpt.records import marker_key, parse_marker_key
from jaxckpt.restoring import _stepreader as _restore
from jaxckpt.storage import Storage, open_storage

CHILD = Path(__file__).with_name("writer_child.py")

CHILD_TIMEOUT_S = 120.0  # importing jax on a loaded 2-core machine, plus a few saves

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def root(tmp_path: Path) -> str:
    return str(tmp_path / "ckpt")


def _spawn(root: str, *args: str) -> harness.Child:
    env = harness.child_env(inherit_jaxckpt=True, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return harness.Child(
        [sys.executable, str(CHILD), root, *args], env=env, timeout_s=CHILD_TIMEOUT_S
    )


def _finish(proc: harness.Child) -> list[str]:
    rc = proc.finish()
    assert rc == 0, "\n".join(proc.stderr)[-3000:]
    return proc.stdout


def _bits(tree: dict[str, Any]) -> dict[str, bytes]:
    return {k: np.ascontiguousarray(v).tobytes() for k, v in sorted(tree.items())}


def _attempt_prefixes(storage: Storage) -> set[str]:
    return {"/".join(k.split("/")[:3]) + "/" for k in storage.list("attempts/")}


# -- two writers of one step ---------------------------------------------------------

START_MARGIN_S = 0.25  # from the go file to the shared instant: each racer polls it every 5 ms


def _start_at(go: Path, at: float) -> None:
    """Gives the racers waiting on ``go`` their shared start instant (written atomically)."""
    tmp = go.with_suffix(".tmp")
    tmp.write_text(repr(at))
    os.replace(tmp, go)


@pytest.mark.parametrize("rounds", [2])
def test_two_processes_saving_one_step_commit_exactly_one_writers_data(
    storage_root: str, rounds: int, tmp_path: Path
) -> None:
    for r in range(rounds):
        root = f"{storage_root.rstrip('/')}/round{r}"
        go = tmp_path / f"go{r}"
        procs = {v: _spawn(root, "race", "--step", "5", "--value", str(v), "--go", str(go))
                 for v in (100 + r, 200 + r)}  # fmt: skip
        for p in procs.values():
            p.expect("READY")  # jax imported: the start costs the racers nothing more
        _start_at(go, time.time() + START_MARGIN_S)
        outs = {v: _finish(p) for v, p in procs.items()}
        epochs = {
            v: int(x.split()[1]) for v, xs in outs.items() for x in xs if x.startswith("EPOCH")
        }
        marker = CommitProtocol(open_storage(root)).require_marker(5)
        (winner,) = [v for v, e in epochs.items() if e == marker.epoch]
        loser = next(v for v in outs if v != winner)
        assert "COMMITTED 5" in outs[winner], outs
        if "COMMITTED 5" in outs[loser]:  # its fence check passed just before the takeover:
            # its marker is hidden (or already retracted by the winner's gc on open).
            hidden = scan(CommitProtocol(open_storage(root)), full=False).hidden
            assert [(m.step, m.epoch) for m in hidden] in ([], [(5, epochs[loser])]), outs
        else:
            assert any(x.startswith(("FENCED", "EXISTS")) for x in outs[loser]), outs
        reader = jaxckpt.CheckpointManager(root, read_only=True)
        assert reader.steps() == [5]
        assert _bits(reader.restore(5)) == _bits(child.state(winner))
        assert reader.verify(5).ok
        with jaxckpt.CheckpointManager(root) as writer:  # collects the loser's attempt
            assert writer.steps() == [5]
        storage = open_storage(root)
        marker = CommitProtocol(storage).require_marker(5)
        assert _attempt_prefixes(storage) == {marker.location.prefix}
        assert storage.list("pending/") == []


def test_older_writer_is_fenced_and_the_committed_step_is_the_newer_ones(root: str) -> None:
    from jaxckpt.formats import _tsio

    # plain: its chunks go through ArrayWriter.write, which the test holds (packs do not)
    old = jaxckpt.CheckpointManager(root, chunk_bytes=4096, layout="plain")
    old.save(1, child.state(1))
    old.wait()
    slow = threading.Event()
    write = _tsio.ArrayWriter.write

    def slow_write(self: Any, *a: Any, **k: Any) -> Any:
        slow.wait(HANG_S)  # released once the new writer took over
        return write(self, *a, **k)

    _tsio.ArrayWriter.write = slow_write  # type: ignore[method-assign]
    try:
        old.save(5, child.state(500))  # in flight when the new writer takes over
        new = jaxckpt.CheckpointManager(root, chunk_bytes=4096, layout="plain")
        assert new.epoch == old.epoch + 1  # type: ignore[operator]
    finally:
        _tsio.ArrayWriter.write = write  # type: ignore[method-assign]
        slow.set()
    new.save(5, child.state(5))
    new.wait()
    with pytest.raises(jaxckpt.WriterFencedError, match="fenced by epoch"):
        old.wait()
    for call in (lambda: old.save(6, child.state(6)), old.wait, old.close):
        with pytest.raises(jaxckpt.WriterFencedError):
            call()
    with pytest.raises(jaxckpt.WriterFencedError):
        old._protocol.delete(5)  # an older epoch never deletes a newer writer's step
    assert new.steps() == [1, 5]
    assert _bits(new.restore(5)) == _bits(child.state(5))
    new.close()


# -- a zombie beside a restarted job --------------------------------------------------


def test_zombie_job_is_fenced_and_never_wins(storage_root: str) -> None:
    zombie = _spawn(storage_root, "loop", "--start", "1", "--pause", "0.05", "--keep-last", "2")
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    for _ in range(3):
        zombie.search(r"^COMMITTED", timeout=max(0.0, deadline - time.monotonic()))
    with jaxckpt.CheckpointManager(storage_root, chunk_bytes=4096) as job:  # the restarted job
        resumed = job.latest_step()
        assert resumed is not None
        assert _bits(job.restore()) == _bits(child.state(resumed))
        mine = list(range(resumed + 1000, resumed + 1003))
        for step in mine:
            job.save(step, child.state(step))
        job.wait()
    lines = _finish(zombie)
    assert lines[-1].startswith("FENCED"), lines
    reader = jaxckpt.CheckpointManager(storage_root, read_only=True)
    listed = reader.steps()
    assert set(mine) <= set(listed), listed  # the zombie's retention deleted none of them
    zombie_steps = [s for s in listed if s < 1000]
    assert zombie_steps and max(zombie_steps) <= resumed, (listed, resumed)
    for step in listed:
        assert _bits(reader.restore(step)) == _bits(child.state(step)), step
        assert reader.verify(step).ok, step
    with jaxckpt.CheckpointManager(storage_root) as gc:
        gc.garbage_collect(older_than_s=0)
    storage = open_storage(storage_root)
    protocol = CommitProtocol(storage)
    named = {m.location.prefix for m in protocol.committed().values()}
    assert _attempt_prefixes(storage) == named
    assert storage.list("pending/") == []
    assert sorted(r.step for r in protocol.marker_refs()) == listed


def test_marker_committed_after_a_takeover_is_never_listed(root: str) -> None:
    """The fence check races with a takeover; visibility alone must hide the late commit."""
    old = jaxckpt.CheckpointManager(root)
    old.save(1, {"w": jnp.arange(4.0)})
    old.wait()
    new = jaxckpt.CheckpointManager(root)
    old._protocol.check_fence = lambda action, epochs=None: None  # type: ignore[method-assign]
    old.save(2, {"w": jnp.arange(4.0) * 2})  # committed by a writer that missed the fence
    old.wait()
    assert new.steps() == [1]
    assert jaxckpt.CheckpointManager(root, read_only=True).steps() == [1]
    assert new.latest_step() == 1
    assert [m.step for m in scan(new._protocol, full=False).hidden] == [2]
    new.save(2, {"w": jnp.arange(4.0) * 3})  # the late marker does not block the new writer
    new.wait()
    np.testing.assert_array_equal(new.restore(2)["w"], np.arange(4.0) * 3)
    assert new.garbage_collect() == [2]  # the hidden step of the fenced epoch
    markers = [k for k in open_storage(root).list("commits/") if parse_marker_key(k)]
    assert markers == [marker_key(1, 1), marker_key(2, 2)]
    new.close()


# -- operators beside a live job -----------------------------------------------------


def test_gc_and_prune_by_an_operator_leave_the_live_save_alone(
    root: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    resume = tmp_path / "resume"
    resume.mkdir()
    env = harness.child_env(
        inherit_jaxckpt=True,
        pause_at="data_written",
        resume_dir=resume,
        pause_s=60,
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
    )
    crash_child = Path(__file__).with_name("crash_child.py")
    args = ["--seed", "1", "--start", "1", "--steps", "3", "--mb", "1", "--arm", "save:3"]
    argv = [sys.executable, str(crash_child), root, *args]
    with harness.running(argv, env=env, timeout_s=CHILD_TIMEOUT_S) as proc:
        proc.wait_phase("data_written", 3)  # the child never paused: PhaseNotReachedError
        assert cli.main(["gc", root]) == 0  # default grace: the live attempt is kept
        assert cli.main(["prune", root, "--keep-last=1"]) == 0
        assert "keep (within grace period) step 3" in capsys.readouterr().out
        assert proc.proc.poll() is None  # still paused: the operators ran beside the live save
        harness.resume(resume, "data_written", 3)
        out = _finish(proc)
    assert "COMMITTED 3" in out, out
    reader = jaxckpt.CheckpointManager(root, read_only=True)
    assert reader.steps() == [2, 3] and reader.verify(3).ok


# -- damage is corruption, not garbage ------------------------------------------------


def test_a_flipped_byte_in_a_marker_deletes_nothing(
    root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with jaxckpt.CheckpointManager(root) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"w": jnp.full(8, float(s))})
    data = step_dir(root, 3)
    marker = marker_path(root, 3)
    raw = bytearray(marker.read_bytes())
    raw[raw.index(b'"nbytes":') + 9] ^= 0x01  # a digit of nbytes: still JSON, CRC fails
    marker.write_bytes(bytes(raw))
    with jaxckpt.CheckpointManager(root) as mgr:  # a writable open deletes nothing
        assert mgr.steps() == [1, 2]
        with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"step 3 .*damaged"):
            mgr.restore(3)
        np.testing.assert_array_equal(mgr.restore()["w"], np.full(8, 2.0))
    assert os.path.isdir(data) and marker.exists()
    capsys.readouterr()
    assert cli.main(["ls", root]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].endswith("2 committed steps (72 B), 1 DAMAGED"), lines[0]
    assert any(line.split()[:2] == ["3", "DAMAGED"] for line in lines), out
    assert cli.main(["verify", root, "--all"]) == 1
    assert "step 3: the commit marker is damaged" in capsys.readouterr().err
    assert cli.main(["gc", root, "--grace=0"]) == 0
    assert os.path.isdir(data) and marker.exists()
    assert cli.main(["gc", root, "--grace=0", "--force"]) == 0
    assert not os.path.exists(data) and not marker.exists()


def test_data_without_a_marker_is_reported_orphaned_and_collected(
    root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": jnp.arange(4.0)})
        mgr.save(2, {"w": jnp.arange(4.0)})
    data = step_dir(root, 1)
    marker_path(root, 1).unlink()  # an operator's rm
    capsys.readouterr()
    assert cli.main(["ls", root, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(p["step"], p["kind"]) for p in listing["partial"]] == [(1, "orphaned")]
    with jaxckpt.CheckpointManager(root) as mgr:
        assert os.path.isdir(data)  # opening only reads pending/: orphans need a full scan
        assert mgr.garbage_collect() == [1]  # of a fenced epoch (the writer that saved it)
    assert not os.path.exists(data)


def test_an_attempt_refilled_while_collected_keeps_its_pending_record(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fenced writer still writing into its attempt: the next collection finishes it."""
    from jaxckpt.storage import LocalStorage

    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": jnp.arange(8.0)})
        mgr.save(2, {"w": jnp.arange(8.0)})
    data = step_dir(root, 2)
    attempt = os.path.basename(data.rstrip("/"))
    marker_path(root, 2).unlink()  # as if the writer was fenced before its marker
    pending = os.path.join(root, "pending", "2", f"{attempt}.json")
    os.makedirs(os.path.dirname(pending), exist_ok=True)
    with open(pending, "w") as f:
        f.write(json.dumps({"format": "jaxckpt", "version": 2, "operation": "save", "started": 0}))
    remove = LocalStorage.delete_prefix

    def refilled(self: LocalStorage, prefix: str) -> None:  # the late chunk write lands
        remove(self, prefix)
        # Only after the attempt's own prefix went: its other prefixes (it has a few, holding
        # its name too) are removed by other threads at once, which would race the refill.
        if os.path.join(root, prefix).rstrip("/") == data.rstrip("/"):
            os.makedirs(os.path.join(data, "arrays", "w", "c"), exist_ok=True)
            Path(data, "arrays", "w", "c", "0").write_bytes(b"late")

    with monkeypatch.context() as m:
        m.setattr(LocalStorage, "delete_prefix", refilled)
        jaxckpt.CheckpointManager(root).close()  # collects: the data comes back
    assert os.path.isdir(data) and os.path.exists(pending)  # not an orphan: still partial
    assert [a.step for a in scan(CommitProtocol(open_storage(root)), full=False).attempts] == [2]
    jaxckpt.CheckpointManager(root).close()  # the writer is gone: this time it goes
    assert not os.path.exists(data) and not os.path.exists(pending)


# -- Ctrl-C, restores racing deletes, listing at scale --------------------------------


@pytest.mark.usefixtures("plain_by_default", "sigint_default")
def test_close_after_ctrl_c_in_wait_commits_or_raises(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jaxckpt.formats import _tsio

    mgr = jaxckpt.CheckpointManager(root)
    mgr.save(1, {"w": jnp.arange(4.0)})
    mgr.wait()
    # Step 2's write holds until the caller is inside close(); Ctrl-C (a process-directed
    # SIGINT, as a terminal sends it) comes while the caller blocks in wait() on it, so
    # close() is the one that must wait for the commit, whatever the machine's load.
    hold = Hold(_tsio.ArrayWriter.write)
    monkeypatch.setattr(_tsio.ArrayWriter, "write", hold.as_method())
    in_wait, in_close = main_thread_in("wait"), main_thread_in("close")

    def release_once_closing() -> None:
        try:
            wait_until(in_close, what="the caller calling close()")
        finally:
            hold.release()

    releaser = threading.Thread(target=release_once_closing, daemon=True)
    try:
        mgr.save(2, {"w": jnp.arange(4.0) * 2})
        with (
            Interrupter(lambda: hold.entered.is_set() and in_wait(), what="the write held") as c,
            pytest.raises(KeyboardInterrupt),
        ):
            mgr.wait()
        assert c.sent.is_set() and hold.returned == 0  # interrupted while the write was held
        releaser.start()
        mgr.close()  # returns only once step 2 is committed
    finally:
        hold.release()
        if releaser.is_alive():
            releaser.join(HANG_S)
    reader = jaxckpt.CheckpointManager(root, read_only=True)
    assert reader.steps() == [1, 2]
    np.testing.assert_array_equal(reader.restore(2)["w"], np.arange(4.0) * 2)
    assert open_storage(root).list("pending/") == []


def test_a_step_deleted_during_its_restore_is_reported_as_deleted(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": jnp.arange(4096.0)})
    reader = jaxckpt.CheckpointManager(root, read_only=True)
    restore = _restore.StepReader.restore

    def delete_first(self: Any, loaded: Any, *args: Any, **kwargs: Any) -> Any:
        CommitProtocol(open_storage(root)).delete(loaded.marker.step)  # an operator's prune
        return restore(self, loaded, *args, **kwargs)

    monkeypatch.setattr(_restore.StepReader, "restore", delete_first)
    with pytest.raises(jaxckpt.StepNotFoundError, match="deleted while it was being restored"):
        reader.restore(1)


def _counted_reads(storage: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys read through ``storage``'s class from now on, in order."""
    reads: list[str] = []
    read = type(storage).read

    def counting_read(self: Any, key: str) -> Any:
        reads.append(key)
        return read(self, key)

    monkeypatch.setattr(type(storage), "read", counting_read)
    return reads


def test_inside_latest_once_the_newest_marker_is_read_once_on_that_thread(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": jnp.arange(4.0)})
    storage = open_storage(root)
    protocol = CommitProtocol(storage)
    reads = _counted_reads(storage, monkeypatch)

    def markers_read() -> int:
        return len([k for k in reads if parse_marker_key(k)])

    with protocol.latest_once():
        first = protocol.latest()
        assert first is not None and first.step == 1 and markers_read() == 1
        assert protocol.latest() is first and markers_read() == 1  # not read again
        thread = threading.Thread(target=protocol.latest)  # another thread reads for itself
        thread.start()
        thread.join()
        assert markers_read() == 2
    assert protocol.latest() == first and markers_read() == 3  # after it: read each time


def test_opening_and_latest_step_read_few_markers_at_300_steps(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": jnp.arange(4.0)})
    storage = open_storage(root)
    marker = CommitProtocol(storage).require_marker(1)
    protocol = CommitProtocol(storage)
    for step in range(2, 301):  # 299 more markers (their data is never read here)
        copy = type(marker)(**{**marker.__dict__, "step": step})
        storage.write(copy.key, copy.to_bytes(), exclusive=True)
    reads = _counted_reads(storage, monkeypatch)
    mgr = jaxckpt.CheckpointManager(root)
    assert mgr.latest_step() == 300
    markers_read = [k for k in reads if parse_marker_key(k)]
    # the newest marker twice: the writer's open checks its format version (a newer one
    # refuses saves), then latest_step reads it; never the other 299
    assert markers_read == [marker_key(300, 1)] * 2, reads
    reads.clear()
    assert mgr.steps() == list(range(1, 301))
    assert len([k for k in reads if parse_marker_key(k)]) == 300
    assert protocol.epochs.newest() == 2
    mgr.close()
