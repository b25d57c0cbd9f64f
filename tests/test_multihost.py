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
c. SIGKILLing a process mid-save: process 0 (which hosts JAX's coordination
   service) raises SaveTimeoutError after ``save_timeout_s``, whether the dead
   process was a worker or the primary; when process 0 itself dies JAX aborts
   the others; either way the step is never listed;
d. the primary reaches ``before_marker`` only once every process's manifest
   part is durable (what tells it from ``manifest_written``);
e. every process restores the same step, also when the newest step is
   corrupt only in the region one process reads;
f. on GCS, with process 1 as the primary, a save policy's answer is the
   primary's on every process and only the primary writes the records;
g. replicated leaves (restored ``P()`` on several processes) are read once
   in all, locally, on S3 and from packs: the bytes each child read add up to
   at most 1.05x the step's bytes; a chunk read in parts by two processes is
   checked as a whole; a peer SIGKILLed before the exchange's collective
   makes the survivor raise ``CheckpointError`` within the timeout.

Every wait has a deadline, and every child is killed in a ``finally``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import harness
import multihost_child as child
import numpy as np
import protocol_state as state
import pytest
from benchkit import servers
from rootpaths import chunk_path

import jaxckpt
from jaxckpt.commit import CommitProtocol, list_attempt
from jaxckpt.records import ManifestPart
from jaxckpt.storage import open_storage

CHILD_PATH = Path(__file__).with_name("multihost_child.py")

ARRAYS = [*child.SHARDED, *child.REPLICATED, *child.HOST, *child.BIG]
STEPS = (1, 2)
RUN_TIMEOUT_S = 90.0  # one group: start-up (importing jax, joining the group) plus its work
PHASE_TIMEOUT_S = 60.0
DIE_SAVE_TIMEOUT_S = 5.0  # save_timeout_s of the save whose peer is killed (only that one: see
# multihost_child.py --mode save_and_die), or of the restore a peer dies in
# When process 0 (the coordination service) dies, JAX aborts the others once it
# notices, which can take more than 10 s on a loaded 2-core machine: a longer
# save timeout keeps jaxckpt's own timeout out of that race.
PRIMARY_DIE_SAVE_TIMEOUT_S = 60.0
BARRIER_WINDOW_S = 2.0  # how long a primary waiting for a paused peer is watched
TRAILER = 4  # every stored chunk is raw bytes + a 4-byte crc32c

pytestmark = pytest.mark.timeout(240)


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


PORT_ATTEMPTS = 4
PORT_LOST = ("Failed to start RPC server", "Failed to add port")


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
    primary_host: int = 0,
    steps: tuple[int, ...] = STEPS,
    env_for: dict[int, dict[str, str]] | None = None,
    layout: str = "plain",
    extra: tuple[str, ...] = (),
) -> Iterator[list[Proc]]:
    """Starts one group; SIGKILLs whatever is still running when the block exits.

    The coordinator's port is picked here, so another process may take it
    before process 0 binds it: then process 0 exits at start-up and the whole
    group is started again on another port.
    """
    procs: list[Proc] = []
    try:
        for _ in range(PORT_ATTEMPTS):
            procs = _start_group(
                logs,
                root,
                port=servers.free_port(),
                mode=mode,
                processes=processes,
                devices=devices,
                mesh=mesh,
                spec=spec,
                save_timeout_s=save_timeout_s,
                primary_host=primary_host,
                steps=steps,
                env_for=env_for or {},
                layout=layout,
                extra=extra,
            )
            if not _lost_port_race(procs[0], procs):
                break
            _kill_all(procs)
        else:
            pytest.fail(f"no free coordinator port in {PORT_ATTEMPTS} attempts")
        yield procs
    finally:
        _kill_all(procs)


def _start_group(
    logs: Path,
    root: str,
    *,
    port: int,
    mode: str,
    processes: int,
    devices: int,
    mesh: str,
    spec: str,
    save_timeout_s: float,
    primary_host: int,
    steps: tuple[int, ...],
    env_for: dict[int, dict[str, str]],
    layout: str,
    extra: tuple[str, ...],
) -> list[Proc]:
    name = f"{mode}-{processes}x{devices}-{uuid.uuid4().hex[:6]}"
    procs = []
    for i in range(processes):
        env = harness.child_env(**{**env_for.get(i, {}), "JAX_PLATFORMS": "cpu"})
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
            f"--steps={','.join(map(str, steps))}",
            f"--save-timeout={save_timeout_s}",
            f"--primary-host={primary_host}",
            f"--layout={layout}",
            *extra,
        ]
        out, err = logs / f"{name}-{i}.out", logs / f"{name}-{i}.err"
        with open(out, "wb") as fout, open(err, "wb") as ferr:
            popen = subprocess.Popen(argv, stdout=fout, stderr=ferr, env=env)
        procs.append(Proc(i, popen, out, err))
    return procs


def _lost_port_race(coordinator: Proc, procs: list[Proc]) -> bool:
    """Waits until process 0 joined its group (True if it lost the port race)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not coordinator.said("READY"):
        if coordinator.popen.poll() is not None:
            return any(text in coordinator.stderr() for text in PORT_LOST)
        if time.monotonic() > deadline:
            pytest.fail("process 0 did not start\n" + "\n".join(p.report() for p in procs))
        time.sleep(0.05)
    return False


def _kill_all(procs: list[Proc]) -> None:
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
    # close() removed every agreement key (epoch, attempts, decisions) from the KV store.
    assert procs[0].said("AGREEMENT KEYS LEFT") == ["AGREEMENT KEYS LEFT 0"], procs[0].report()


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

    loc = marker.location
    parts = [k for k in list_attempt(storage, loc) if "/manifest/" in k]
    assert sorted(parts) == sorted(loc.key(f"manifest/{p}.json") for p in range(processes))
    writers: dict[tuple[str, str], list[int]] = {}
    for p in range(processes):
        data = storage.read(loc.key(f"manifest/{p}.json"))
        assert data is not None
        part = ManifestPart.from_bytes(data, f"{root}/{loc.key(f'manifest/{p}.json')}")
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


def test_every_process_records_its_saves_in_the_run_ledger(saved_local: str) -> None:
    from jaxckpt.ledger import read_ledger

    run = read_ledger(open_storage(saved_local))[0]  # the save (restores by others follow)
    assert run.processes == 2 and sorted(run.events) == [0, 1]
    for p in (0, 1):  # every process's wait in save(), and its exit
        assert [e["step"] for e in run.of("save_call", p)] == list(STEPS)
        assert [e["kind"] for e in run.events[p]][-1] == "exit"
    assert [e["step"] for e in run.of("save", 0)] == list(STEPS) and run.of("save", 1) == []
    assert run.of("reached", 1) == [] and run.of("reached", 0)[-1]["step"] == STEPS[-1]
    report = jaxckpt.report(saved_local)
    assert report.saves["count"] == len(STEPS)
    stored = CommitProtocol(open_storage(saved_local)).committed()
    assert report.saves["bytes"] == sum(stored[s].nbytes for s in STEPS)  # both parts'
    slowest = {s: max(e["seconds"] for e in run.of("save_call") if e["step"] == s) for s in STEPS}
    assert report.saves["blocking_s"]["max"] == max(slowest.values())


def test_restore_on_one_process_with_four_devices(saved_local: str, tmp_path: Path) -> None:
    (p,) = restore(tmp_path, saved_local, processes=1, devices=4, mesh="1x4", spec="None,model")
    assert restored_steps([p]) == [STEPS[-1]]
    # x, y, z and the four replicated arrays on 4 devices each, plus the host array.
    assert p.said("CHECKED") == [f"CHECKED {7 * 4 + 1}"], p.report()


def test_packed_layout_each_process_writes_a_few_packs_read_on_another_topology(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "packed")
    procs = run_group(
        tmp_path, root, mode="save", processes=2, devices=2, mesh="2x2", layout="packed"
    )
    for p in procs:
        assert p.said("COMMITTED") == [f"COMMITTED {s}" for s in STEPS], p.report()
    storage = open_storage(root)
    protocol = CommitProtocol(storage)
    for step in STEPS:
        marker = protocol.require_marker(step)
        loc = marker.location
        parts = protocol.read_manifest(marker)
        assert [p.process for p in parts] == [0, 1]
        owners: dict[tuple[str, str], int] = {}
        for part in parts:
            assert part.layout == "packed" and 1 <= len(part.packs) <= 4, part.packs
            assert all(name.startswith(f"packs/{part.process}.") for name in part.packs)
            for name, records in part.arrays.items():
                for r in records:
                    assert r.pack in part.packs and r.offset + r.size <= part.packs[r.pack]
                    assert owners.setdefault((name, r.key), part.process) == part.process
            ends: dict[str, int] = {}
            for records in part.arrays.values():
                for r in records:
                    assert r.pack is not None and r.offset % 64 == 0
                    ends[r.pack] = max(ends.get(r.pack, 0), r.offset + r.size)
            assert ends == dict(part.packs)
        # No replica written twice: each chunk has one writer, the bytes are the logical bytes.
        logical = sum(child.expected(name, step).nbytes for name in ARRAYS)
        assert sum(p.nbytes for p in parts) - TRAILER * len(owners) == logical
        packs = sorted(loc.key(n) for part in parts for n in part.packs)
        assert sorted(k for k in list_attempt(storage, loc) if "/packs/" in k) == packs
        assert [k for k in storage.list(loc.arrays_prefix) if not k.endswith("/zarr.json")] == []
    (p,) = restore(tmp_path, root, processes=1, devices=4, mesh="1x4", spec="None,model")
    assert restored_steps([p]) == [STEPS[-1]]
    assert p.said("CHECKED") == [f"CHECKED {7 * 4 + 1}"], p.report()
    # On 2 processes the replicated leaves are read once, in ranges of the packs.
    procs = restore(tmp_path, root, processes=2, devices=2, mesh="2x2", spec="data")
    for p in procs:
        assert p.said("CHECKED") == [f"CHECKED {7 * 2 + 1}"], p.report()
    check_read_once(root, procs)


def test_restore_on_four_processes(saved_local: str, tmp_path: Path) -> None:
    procs = restore(tmp_path, saved_local, processes=4, devices=1, mesh="2x2", spec="model,data")
    assert restored_steps(procs) == [STEPS[-1]] * 4
    for p in procs:
        assert p.said("CHECKED") == [f"CHECKED {7 + 1}"], p.report()
    # big and wide (1.5 and 2 MiB, replicated on restore) were read once in all,
    # each process a quarter (every chunk in parts); without the exchange: 4x.
    check_read_once(saved_local, procs)
    assert procs[0].said("AGREEMENT KEYS LEFT") == ["AGREEMENT KEYS LEFT 0"], procs[0].report()


def bytes_read(procs: list[Proc]) -> list[int]:
    """The bytes of array data each process read from storage during its restore."""
    out = []
    for p in procs:
        (line,) = p.said("BYTES READ")
        out.append(int(line.split()[2]))
    return out


def check_read_once(root: str, procs: list[Proc]) -> None:
    """Replicated leaves were read once over all processes, in about equal shares."""
    stored = CommitProtocol(open_storage(root)).require_marker(STEPS[-1]).nbytes
    read = bytes_read(procs)
    assert sum(read) <= 1.05 * stored, (read, stored)
    big = sum(child.expected(name, STEPS[-1]).nbytes for name in child.BIG)
    for n in read:  # each process read its share of the big leaves, not more
        assert big / len(procs) * 0.9 <= n <= big / len(procs) + (stored - big), (read, stored)


def test_replicated_leaves_read_once_on_two_processes(saved_local: str, tmp_path: Path) -> None:
    """2 processes x 2 devices, x sharded over the processes and replicated within
    them (a mix): each process reads half of big (its one chunk, in ranged reads
    of at most 100 KiB) and one of wide's two chunks whole; every shard is checked."""
    procs = restore(
        tmp_path,
        saved_local,
        processes=2,
        devices=2,
        mesh="2x2",
        spec="data",
        extra=(f"--exchange-part-bytes={100 << 10}",),
    )
    assert restored_steps(procs) == [STEPS[-1]] * 2
    for p in procs:
        assert p.said("CHECKED") == [f"CHECKED {7 * 2 + 1}"], p.report()
    check_read_once(saved_local, procs)
    assert procs[0].said("AGREEMENT KEYS LEFT") == ["AGREEMENT KEYS LEFT 0"], procs[0].report()


def test_chunk_read_in_parts_is_checked_as_a_whole(saved_local: str, tmp_path: Path) -> None:
    """big's one chunk is read half by each process, in ranged reads of at most
    100 KiB: neither can check its CRC32C alone; combined through the KV store,
    both find it corrupt and fall back."""
    root = tmp_path / "root"
    shutil.copytree(saved_local, root)
    servers.corrupt_object(chunk_path(str(root), STEPS[-1], "big", 0, 0), offset=100)
    procs = restore(
        tmp_path,
        str(root),
        processes=2,
        devices=2,
        mesh="2x2",
        spec="data",
        extra=(f"--exchange-part-bytes={100 << 10}",),
    )
    assert restored_steps(procs) == [STEPS[0]] * 2
    for p in procs:
        assert p.said("CHECKED") == [f"CHECKED {7 * 2 + 1}"], p.report()
        assert f"falling back to step {STEPS[0]}" in p.stderr(), p.report()
        assert "chunk c/0/0" in p.stderr() and "read in parts" in p.stderr(), p.report()


@pytest.mark.parametrize(
    ("phase", "says"),
    [
        pytest.param(
            "exchange_read", "no 'restore-exchange' from process 1", id="before-the-gather"
        ),
        pytest.param("exchange_settled", "the collective did not finish", id="in-the-collective"),
    ],
)
def test_dead_peer_during_the_exchange_is_bounded(
    phase: str, says: str, saved_local: str, tmp_path: Path
) -> None:
    """Process 1 is SIGKILLed after its reads, before it publishes them (process 0
    waits in the key-value gather), or once every process has published them
    (process 0 waits in the collective): either way process 0 raises a
    CheckpointError within the timeout instead of waiting forever."""
    pause = {child.PAUSE_ENV: phase, "JAXCKPT_PAUSE_S": "300"}
    with spawn(
        tmp_path,
        saved_local,
        mode="restore_and_die",
        processes=2,
        devices=2,
        mesh="2x2",
        spec="data",
        save_timeout_s=DIE_SAVE_TIMEOUT_S,
        env_for={1: pause},
    ) as procs:
        survivor, target = procs
        wait_for_phase(target, f"JAXCKPT_PHASE {phase} {STEPS[1]}", procs)
        kill_and_outlive(
            target,
            survivor,
            DIE_SAVE_TIMEOUT_S + LOAD_MARGIN_S,
            "process 0 hangs after its peer died",
        )
    assert survivor.popen.returncode == 0, survivor.report()
    (failed,) = survivor.said("FAILED")
    _, error, seconds = failed.split()
    assert error == "CheckpointError", survivor.report()
    assert float(seconds) < DIE_SAVE_TIMEOUT_S + LOAD_MARGIN_S, failed
    assert says in survivor.stderr(), survivor.report()


def test_hosts_agree_when_one_host_reads_a_corrupt_chunk(saved_local: str, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(saved_local, root)
    # y is saved in 8x4 chunks; restored with P('model', 'data') on a 2x2 mesh
    # over 4 processes, chunk c/1/1 (rows 8:16, columns 4:8) is read by process 3 only.
    servers.corrupt_object(chunk_path(str(root), STEPS[-1], "y", 1, 1))
    procs = restore(tmp_path, str(root), processes=4, devices=1, mesh="2x2", spec="model,data")
    assert restored_steps(procs) == [STEPS[0]] * 4  # all fell back to the older step
    for p in procs:
        assert p.said("CHECKED") == [f"CHECKED {7 + 1}"], p.report()
        assert f"falling back to step {STEPS[0]}" in p.stderr(), p.report()
    # Only process 3 read the damaged chunk; the others learned it from process 3
    # (before the exchange of the replicated leaves, which never started).
    assert "chunk c/1/1" in procs[3].stderr(), procs[3].report()
    told = [p.index for p in procs if "process 3 could not read its part" in p.stderr()]
    assert told == [0, 1, 2], [p.report() for p in procs]


# A loaded 2-core machine may run a process late; a deadline never allows less
# slack than this beyond what the configured timeouts imply.
LOAD_MARGIN_S = 20.0

KILLS = [
    pytest.param(0, 1, "data_written", id="worker-after-its-data"),
    pytest.param(0, 1, "data_started", id="worker-after-its-first-chunk"),
    pytest.param(1, 1, "data_written", id="primary-1-after-its-data"),
]


@pytest.mark.parametrize(("primary", "victim", "phase"), KILLS)
def test_killed_peer_times_the_save_out(
    primary: int, victim: int, phase: str, tmp_path: Path
) -> None:
    """Step 1 commits; during step 2 process 1 pauses at ``phase`` and is SIGKILLed.

    Process 0 hosts JAX's coordination service and survives: whether process 1
    was a worker or the primary, its save raises SaveTimeoutError once
    ``save_timeout_s`` has passed, and the step is never listed.
    """
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
        primary_host=primary,
        env_for={victim: pause},
    ) as procs:
        target, survivor = procs[victim], procs[0]
        wait_for_phase(target, f"JAXCKPT_PHASE {phase} {STEPS[1]}", procs)
        kill_and_outlive(
            target,
            survivor,
            DIE_SAVE_TIMEOUT_S + LOAD_MARGIN_S,
            "process 0 hangs after its peer died",
        )
    assert survivor.popen.returncode == 0, survivor.report()
    assert survivor.said("COMMITTED") == [f"COMMITTED {STEPS[0]}"], survivor.report()
    (failed,) = survivor.said("FAILED")
    _, error, seconds = failed.split()
    assert error == "SaveTimeoutError", survivor.report()
    # The save began before the kill, so it cannot time out sooner than the
    # timeout after the kill; it is measured from save() in the child.
    assert DIE_SAVE_TIMEOUT_S <= float(seconds) < DIE_SAVE_TIMEOUT_S + LOAD_MARGIN_S, failed
    assert committed_steps(root) == [STEPS[0]]


def test_killed_primary_on_process_0_aborts_the_others(tmp_path: Path) -> None:
    """Process 0 hosts the coordination service: when it dies, the others never hang
    and nothing is committed. Which comes first is a race inside JAX: its error
    poller aborts the process (SIGABRT, with its message), or the save's barrier RPC
    fails at once (UNAVAILABLE) and ``wait()`` raises a ``CheckpointError``, long
    before ``save_timeout_s``. Each outcome is checked in full."""
    root = str(tmp_path / "root")
    pause = {child.PAUSE_ENV: "data_written", "JAXCKPT_PAUSE_S": "300"}
    with spawn(
        tmp_path,
        root,
        mode="save_and_die",
        processes=2,
        devices=2,
        mesh="2x2",
        save_timeout_s=PRIMARY_DIE_SAVE_TIMEOUT_S,
        env_for={0: pause},
    ) as procs:
        target, survivor = procs
        wait_for_phase(target, f"JAXCKPT_PHASE data_written {STEPS[1]}", procs)
        kill_and_outlive(
            target,
            survivor,
            PRIMARY_DIE_SAVE_TIMEOUT_S + LOAD_MARGIN_S,
            "process 1 hangs after the primary died",
        )
    assert survivor.said("COMMITTED") == [f"COMMITTED {STEPS[0]}"], survivor.report()
    failed = survivor.said("FAILED")
    if survivor.popen.returncode == -signal.SIGABRT:
        assert failed == [], survivor.report()
        assert "JAX distributed service detected fatal errors" in survivor.stderr()
    else:  # the barrier RPC failed first: the save raised, promptly
        assert survivor.popen.returncode == 0, survivor.report()
        (line,) = failed
        _, error, elapsed = line.split()
        assert error in ("SaveTimeoutError", "SaveFailedError"), survivor.report()
        assert float(elapsed) < PRIMARY_DIE_SAVE_TIMEOUT_S, survivor.report()
        assert "Failed to send RPC to coordination service" in survivor.stderr()
    assert committed_steps(root) == [STEPS[0]]


def test_primary_writes_the_marker_only_after_every_part(tmp_path: Path) -> None:
    """Tells manifest_written from before_marker, which look alike on one process.

    Process 1 pauses after its data; the primary (0) reaches manifest_written
    with only its own part, and must not reach before_marker until process 1's
    part is durable too. Then the primary is killed there: nothing is committed.
    """
    root = str(tmp_path / "root")
    resume = tmp_path / "resume"
    resume.mkdir()
    common = {"JAXCKPT_RESUME_DIR": str(resume), "JAXCKPT_PAUSE_S": "300"}
    env_for = {
        0: {child.PAUSE_ENV: "manifest_written,before_marker", **common},
        1: {child.PAUSE_ENV: "data_written", **common},
    }
    step = STEPS[1]
    with spawn(
        tmp_path, root, mode="save_and_die", processes=2, devices=2, mesh="2x2", env_for=env_for
    ) as procs:
        primary, worker = procs
        storage = open_storage(root)
        wait_for_phase(worker, f"JAXCKPT_PHASE data_written {step}", procs)
        wait_for_phase(primary, f"JAXCKPT_PHASE manifest_written {step}", procs)
        state.check_phase(storage, step, "manifest_written", processes=2, process=0)
        assert state.manifest_parts(storage, step) == {0}
        (resume / f"manifest_written-{step}.resume").touch()
        # Process 1 is still paused: the primary must wait in the barrier. A
        # primary that went on would announce before_marker within this window.
        time.sleep(BARRIER_WINDOW_S)
        assert f"before_marker {step}" not in primary.stderr(), primary.report()
        (resume / f"data_written-{step}.resume").touch()
        wait_for_phase(primary, f"JAXCKPT_PHASE before_marker {step}", procs)
        state.check_phase(storage, step, "before_marker", processes=2)
        primary.popen.send_signal(signal.SIGKILL)
    assert committed_steps(root) == [STEPS[0]]
    with jaxckpt.CheckpointManager(root) as writer:  # the next writer removes the partial step
        assert writer.steps() == [STEPS[0]]
        assert state.stray_objects(storage, [STEPS[0]]) == []


def kill_and_outlive(target: Proc, survivor: Proc, timeout_s: float, hang: str) -> None:
    """SIGKILLs ``target``; ``survivor`` must exit within ``timeout_s``, else the test fails."""
    harness.kill_and_outlive(target.popen, survivor.popen, timeout_s, hang, survivor.report)


def wait_for_phase(target: Proc, line: str, procs: list[Proc]) -> None:
    """Waits until ``target`` printed ``line`` (a phase it paused at)."""
    harness.wait_until(
        lambda: line in target.stderr(),
        what=f"{line!r} from process {target.index}",
        timeout_s=PHASE_TIMEOUT_S,
        gone=lambda: target.popen.poll() is not None or target.said(f"COMMITTED {STEPS[1]}"),
        report=lambda: "\n".join(p.report() for p in procs),
        poll_s=0.1,
    )


def test_s3_save_and_restore(s3_server: servers.Server, tmp_path: Path) -> None:
    """(a) and (b) on the S3 server; the children inherit its endpoint and credentials."""
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    save_2x2(tmp_path, root)
    assert committed_steps(root) == list(STEPS)
    check_written_once(root, STEPS[-1], processes=2)
    procs = restore(tmp_path, root, processes=4, devices=1, mesh="2x2", spec="model,data")
    assert restored_steps(procs) == [STEPS[-1]] * 4
    check_read_once(root, procs)


def test_gcs_primary_on_process_1_and_save_policy_agreement(
    gcs_server: servers.Server, tmp_path: Path
) -> None:
    """On the GCS emulator, with process 1 as the primary and a save policy that
    answers differently on each process: every process follows the primary's
    answer, only the primary writes the protocol records, and the saved steps
    restore exactly."""
    root = f"gs://{gcs_server.bucket}/{uuid.uuid4().hex}"
    steps = (1, 2, 3, 4, 5, 6)
    trace = {"JAXCKPT_TRACE": "1"}
    procs = run_group(
        tmp_path,
        root,
        mode="policy",
        processes=2,
        devices=2,
        mesh="2x2",
        primary_host=1,
        steps=steps,
        env_for={0: trace, 1: trace},
    )
    for p in procs:  # the primary saves even steps; process 0 alone would save 3 and 6
        assert p.said("DECIDED") == [f"DECIDED {s} {s % 2 == 0}" for s in steps], p.report()
    assert committed_steps(root) == [2, 4, 6]
    data_phases = {"data_started", "data_written", "manifest_written"}
    for p in procs:
        traced = {line.split()[1] for line in p.stderr().splitlines() if "JAXCKPT_TRACE " in line}
        primary_only = {"pending_written", "before_marker", "marker_written"}
        assert traced == (data_phases | primary_only if p.index == 1 else data_phases), p.index
    check_written_once(root, 6, processes=2)
    restored = jaxckpt.CheckpointManager(root, read_only=True).restore(6)
    for name in ARRAYS:
        np.testing.assert_array_equal(restored[name], child.expected(name, 6), err_msg=name)
