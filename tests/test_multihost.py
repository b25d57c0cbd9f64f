"""Multi-host saves and restores with real JAX processes on 127.0.0.1.

Each test starts ``tests/multihost_child.py`` once per process; the processes
form a ``jax.distributed`` group (CPU devices, gloo collectives) and save or
restore through ``jaxckpt.CheckpointManager``. Checked here:

a. a checkpoint saved by 2 processes x 2 devices restores onto 1 process x 4
   devices with ``P(None, 'model')`` and onto 4 processes x 1 device, every
   addressable shard compared with its expected values (in the children);
b. the chunk objects stored hold exactly the logical bytes (no duplicate
   writes of replicated arrays), and each chunk is in exactly one process's
   manifest part;
c. SIGKILLing one process mid-save makes the survivors fail within the save
   timeout, and the step is never listed;
d. every process restores the same step, also when the newest step is
   corrupt only in the region one process reads.

Every wait has a deadline, and every child is killed in a ``finally``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import servers
from rootpaths import chunk_path

import jaxckpt
from jaxckpt._commit import CommitProtocol
from jaxckpt._records import ManifestPart
from jaxckpt._storage import open_storage

CHILD_PATH = Path(__file__).with_name("multihost_child.py")
_spec = importlib.util.spec_from_file_location("jaxckpt_multihost_child", CHILD_PATH)
assert _spec is not None and _spec.loader is not None
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)

ARRAYS = [*child.SHARDED, *child.REPLICATED, *child.HOST]
STEPS = (1, 2)
RUN_TIMEOUT_S = 90.0  # one group: start-up (importing jax, joining the group) plus its work
PHASE_TIMEOUT_S = 60.0
DIE_SAVE_TIMEOUT_S = 10.0  # save_timeout_s of the processes whose peer is killed
TRAILER = 4  # every stored chunk is raw bytes + a 4-byte crc32c

pytestmark = pytest.mark.timeout(240)


class PhaseNotReachedError(AssertionError):
    """The process to kill finished or exited before it reached the pause phase."""


class HostsDisagreeError(AssertionError):
    """The processes of one restore() restored different steps."""


# -- running a group of processes ---------------------------------------------


@dataclasses.dataclass
class Proc:
    """One child process and the files its stdout and stderr go to."""

    index: int
    popen: subprocess.Popen[bytes]
    out: Path
    err: Path

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def said(self, prefix: str) -> list[str]:
        """The protocol lines starting with ``prefix``, in order."""
        return [line for line in self.stdout().splitlines() if line.startswith(prefix)]

    def report(self) -> str:
        return (
            f"--- process {self.index} (rc={self.popen.poll()}) stdout:\n{self.stdout()[-1500:]}"
            f"\n--- stderr:\n{self.stderr()[-3000:]}"
        )


@contextlib.contextmanager
def spawn(
    logs: Path,
    root: str,
    *,
    mode: str,
    processes: int,
    devices: int,
    mesh: str,
    spec: str = "data",
    save_timeout_s: float = 60.0,
    env_for: dict[int, dict[str, str]] | None = None,
) -> Iterator[list[Proc]]:
    """Starts one group; SIGKILLs whatever is still running when the block exits."""
    port = servers.free_port()
    name = f"{mode}-{processes}x{devices}-{uuid.uuid4().hex[:6]}"
    procs: list[Proc] = []
    try:
        for i in range(processes):
            env = dict(os.environ)
            env.pop(child.PAUSE_ENV, None)
            env.update((env_for or {}).get(i, {}))
            env["JAX_PLATFORMS"] = "cpu"
            argv = [
                sys.executable,
                "-u",
                str(CHILD_PATH),
                f"--coordinator=127.0.0.1:{port}",
                f"--num-processes={processes}",
                f"--process-id={i}",
                f"--devices={devices}",
                f"--root={root}",
                f"--mode={mode}",
                f"--mesh={mesh}",
                f"--spec={spec}",
                f"--steps={','.join(map(str, STEPS))}",
                f"--save-timeout={save_timeout_s}",
            ]
            out, err = logs / f"{name}-{i}.out", logs / f"{name}-{i}.err"
            with open(out, "wb") as fout, open(err, "wb") as ferr:
                popen = subprocess.Popen(argv, stdout=fout, stderr=ferr, env=env)
            procs.append(Proc(i, popen, out, err))
        yield procs
    finally:
        for p in procs:
            if p.popen.poll() is None:
                p.popen.kill()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=10)


def wait_all(procs: list[Proc], timeout_s: float = RUN_TIMEOUT_S) -> None:
    """Waits for every process; fails with their logs on a timeout or a nonzero exit."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logs = "\n".join(q.report() for q in procs)
            pytest.fail(f"process {p.index} still running after {timeout_s:.0f}s\n{logs}")
    failed = [p for p in procs if p.popen.returncode != 0]
    if failed:
        pytest.fail("\n".join(p.report() for p in failed))


def run_group(logs: Path, root: str, **kwargs: Any) -> list[Proc]:
    with spawn(logs, root, **kwargs) as procs:
        wait_all(procs)
    return procs


def save_2x2(logs: Path, root: str) -> None:
    """Saves steps 1 and 2 from 2 processes x 2 devices (mesh data=2 over processes)."""
    procs = run_group(logs, root, mode="save", processes=2, devices=2, mesh="2x2")
    for p in procs:
        assert p.said("COMMITTED") == [f"COMMITTED {s}" for s in STEPS], p.report()


def restored_steps(procs: list[Proc]) -> list[int]:
    steps = []
    for p in procs:
        lines = p.said("RESTORED")
        assert len(lines) == 1, p.report()
        steps.append(int(lines[0].split()[1]))
    return steps


def restore(logs: Path, root: str, **kwargs: Any) -> list[Proc]:
    """Restores ``restore()`` (no step) in a group; each child checks its own shards."""
    procs = run_group(logs, root, mode="restore", **kwargs)
    steps = restored_steps(procs)
    if len(set(steps)) != 1:
        raise HostsDisagreeError(f"processes restored steps {steps}")
    return procs


def committed_steps(root: str) -> list[int]:
    """The steps a fresh single-process, read-only manager lists."""
    manager = jaxckpt.CheckpointManager(root, read_only=True)
    try:
        return manager.steps()
    finally:
        manager.close()


# -- what a save must have stored ---------------------------------------------


def check_written_once(root: str, step: int, processes: int) -> None:
    """The chunk objects hold exactly the logical bytes; each has one writer."""
    storage = open_storage(root)
    marker = CommitProtocol(storage).read_marker(step)
    assert marker is not None
    prefix = marker.location.arrays_prefix
    stored: dict[tuple[str, str], int] = {}
    for key in storage.list(prefix):
        name, _, chunk = key[len(prefix) :].partition("/")
        if chunk in ("", "zarr.json"):
            continue
        assert chunk == "c" or chunk.startswith("c/"), key
        data = storage.read(key)
        assert data is not None, key
        stored[(name, chunk)] = len(data)
    logical = sum(child.expected(name, step).nbytes for name in ARRAYS)
    assert sum(size - TRAILER for size in stored.values()) == logical, stored
    assert {name for name, _ in stored} == set(ARRAYS)

    manifest = marker.location.prefix + "manifest/"
    assert storage.list(manifest) == [f"{manifest}{p}.json" for p in range(processes)]
    writers: dict[tuple[str, str], list[int]] = {}
    for p in range(processes):
        data = storage.read(f"{manifest}{p}.json")
        assert data is not None
        part = ManifestPart.from_bytes(data, f"{root}/{manifest}{p}.json")
        assert (part.step, part.process, part.num_processes) == (step, p, processes)
        assert any(part.arrays.values()), f"process {p} wrote no chunk"
        for name, records in part.arrays.items():
            for record in records:
                writers.setdefault((name, record.key), []).append(p)
                assert stored.get((name, record.key)) == record.size, (name, record)
    shared = {chunk: ps for chunk, ps in writers.items() if len(ps) != 1}
    assert not shared, f"chunks in more than one manifest part: {shared}"
    assert set(writers) == set(stored), set(writers) ^ set(stored)
    assert marker.num_processes == processes
    assert marker.nbytes == sum(stored.values())


# -- tests --------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_local(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local root with steps 1 and 2 saved by 2 processes x 2 devices."""
    logs = tmp_path_factory.mktemp("multihost-save")
    root = str(logs / "root")
    save_2x2(logs, root)
    return root


def test_save_writes_each_chunk_once(saved_local: str) -> None:
    assert committed_steps(saved_local) == list(STEPS)
    for step in STEPS:
        check_written_once(saved_local, step, processes=2)


def test_restore_on_one_process_with_four_devices(saved_local: str, tmp_path: Path) -> None:
    (p,) = restore(tmp_path, saved_local, processes=1, devices=4, mesh="1x4", spec="None,model")
    assert restored_steps([p]) == [STEPS[-1]]
    # x, y, z and the two replicated arrays on 4 devices each, plus the host array.
    assert p.said("CHECKED") == [f"CHECKED {5 * 4 + 1}"], p.report()


def test_restore_on_four_processes(saved_local: str, tmp_path: Path) -> None:
    procs = restore(tmp_path, saved_local, processes=4, devices=1, mesh="2x2", spec="model,data")
    assert restored_steps(procs) == [STEPS[-1]] * 4
    for p in procs:
        assert p.said("CHECKED") == [f"CHECKED {5 + 1}"], p.report()


def test_hosts_agree_when_one_host_reads_a_corrupt_chunk(saved_local: str, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(saved_local, root)
    # y is saved in 8x4 chunks; restored with P('model', 'data') on a 2x2 mesh
    # over 4 processes, chunk c/1/1 (rows 8:16, columns 4:8) is read by process 3 only.
    servers.corrupt_object(chunk_path(str(root), STEPS[-1], "y", 1, 1))
    restore(tmp_path, str(root), processes=4, devices=1, mesh="2x2", spec="model,data")


KILLS = [
    pytest.param(1, "data_written", id="worker-after-its-data"),
    pytest.param(1, "data_started", id="worker-after-its-first-chunk"),
    pytest.param(0, "data_written", id="primary-after-its-data"),
]


@pytest.mark.parametrize(("victim", "phase"), KILLS)
def test_killed_process_fails_the_save(victim: int, phase: str, tmp_path: Path) -> None:
    """Step 1 commits; during step 2 one process pauses at ``phase`` and is SIGKILLed."""
    root = str(tmp_path / "root")
    pause = {child.PAUSE_ENV: phase, "JAXCKPT_PAUSE_S": "300"}
    with spawn(
        tmp_path,
        root,
        mode="save_and_die",
        processes=2,
        devices=2,
        mesh="2x2",
        save_timeout_s=DIE_SAVE_TIMEOUT_S,
        env_for={victim: pause},
    ) as procs:
        target = procs[victim]
        wait_for_phase(target, f"JAXCKPT_PHASE {phase} {STEPS[1]}", procs)
        target.popen.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        survivors = [p for p in procs if p is not target]
        for p in survivors:
            try:
                p.popen.wait(timeout=DIE_SAVE_TIMEOUT_S + 30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"survivor {p.index} hangs after its peer died\n{p.report()}")
        waited = time.monotonic() - killed_at
    assert waited < DIE_SAVE_TIMEOUT_S + 20, waited
    for p in survivors:
        assert p.said("COMMITTED") == [f"COMMITTED {STEPS[0]}"], p.report()
        failed = p.said("FAILED")
        if failed:
            _, error, seconds = failed[0].split()
            assert issubclass(getattr(jaxckpt, error), jaxckpt.CheckpointError), error
            assert float(seconds) < DIE_SAVE_TIMEOUT_S + 10, failed
            assert p.popen.returncode == 0, p.report()
        else:
            # The coordination service runs in process 0: when it dies, JAX
            # terminates the other processes itself (SIGABRT) before any
            # timeout of jaxckpt's. That is a prompt failure, not a hang.
            assert victim == 0, p.report()
            assert p.popen.returncode == -signal.SIGABRT, p.report()
            assert "JAX distributed service detected fatal errors" in p.stderr(), p.report()
    assert committed_steps(root) == [STEPS[0]]


def wait_for_phase(target: Proc, line: str, procs: list[Proc]) -> None:
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while line not in target.stderr():
        if target.popen.poll() is not None or target.said(f"COMMITTED {STEPS[1]}"):
            raise PhaseNotReachedError(f"process {target.index} went past {line!r}")
        if time.monotonic() > deadline:
            logs = "\n".join(p.report() for p in procs)
            pytest.fail(f"no {line!r} within {PHASE_TIMEOUT_S:.0f}s\n{logs}")
        time.sleep(0.1)


def test_s3_save_and_restore(s3_server: servers.Server, tmp_path: Path) -> None:
    """(a) and (b) on the S3 server; the children inherit its endpoint and credentials."""
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    save_2x2(tmp_path, root)
    assert committed_steps(root) == list(STEPS)
    check_written_once(root, STEPS[-1], processes=2)
    procs = restore(tmp_path, root, processes=4, devices=1, mesh="2x2", spec="model,data")
    assert restored_steps(procs) == [STEPS[-1]] * 4
