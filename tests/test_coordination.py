"""Coordination among real JAX processes: its cost, and failures every host learns of.

Each test starts ``tests/coord_child.py`` once per process (1 CPU device each,
gloo). Checked here:

a. the coordination-service calls of one process for an open, a save and a
   restore do not grow from 2 to 4 processes (counts, not times);
b. one process whose storage refuses its writes of a step (a proxy answers
   403 to its requests only), or whose local check of a save fails: every
   process's save raises within seconds, naming that process, and the next
   save commits on all;
c. one process that cannot read its data during a restore: every process
   raises within 30 s, naming it;
d. the README resume loop goes on after a fallback: with the newest step
   corrupt at rest, the restore falls back and the save of that step replaces
   the corrupt copy.

Every wait has a deadline, and every child is killed in a ``finally``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import harness
import pytest
from benchkit import servers
from denyproxy import DenyProxy
from test_resume_loop import flip_a_byte

import jaxckpt

CHILD = Path(__file__).with_name("coord_child.py")
RUN_TIMEOUT_S = 150.0
SAVE_TIMEOUT_S = 90.0  # far above a failure agreed in seconds: waiting for it fails the test
AGREED_WITHIN_S = 30.0

pytestmark = pytest.mark.timeout(400)


class Group:
    """The processes of one job; their stdout lines."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
        self.procs, self.logs = procs, logs

    def lines(self, i: int, prefix: str) -> list[str]:
        text = self.logs[i].read_text(errors="replace")
        return [
            line[len(prefix) :].strip() for line in text.splitlines() if line.startswith(prefix)
        ]

    def report(self) -> str:
        return "\n".join(
            f"--- process {i} rc={p.poll()}:\n{log.read_text(errors='replace')[-4000:]}\n"
            f"{log.with_suffix('.err').read_text(errors='replace')[-4000:]}"
            for i, (p, log) in enumerate(zip(self.procs, self.logs, strict=True))
        )

    def wait(self) -> None:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"a process still runs after {RUN_TIMEOUT_S:.0f}s\n{self.report()}")
        if any(p.returncode != 0 for p in self.procs):
            pytest.fail(self.report())


@contextlib.contextmanager
def group(
    tmp: Path, root: str, mode: str, n: int, env_for: dict[int, dict[str, str]] | None = None
) -> Iterator[Group]:
    port = servers.free_port()
    procs, logs = [], []
    try:
        for i in range(n):
            out = tmp / f"{mode}-{n}-{uuid.uuid4().hex[:6]}-{i}.out"
            argv = [
                sys.executable,
                "-u",
                str(CHILD),
                f"--coordinator=127.0.0.1:{port}",
                f"--num-processes={n}",
                f"--process-id={i}",
                f"--root={root}",
                f"--mode={mode}",
                f"--save-timeout={SAVE_TIMEOUT_S}",
            ]
            env = harness.child_env(**{**(env_for or {}).get(i, {}), "JAX_PLATFORMS": "cpu"})
            with open(out, "wb") as o, open(out.with_suffix(".err"), "wb") as e:
                procs.append(subprocess.Popen(argv, stdout=o, stderr=e, env=env))
            logs.append(out)
        g = Group(procs, logs)
        g.wait()
        yield g
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_coordination_calls_per_process_do_not_grow_from_2_to_4_processes(
    tmp_path: Path,
) -> None:
    calls: dict[int, dict[str, list[int]]] = {}
    for n in (2, 4):
        with group(tmp_path, str(tmp_path / f"root{n}"), "count", n) as g:
            calls[n] = {
                phase: [
                    int(line.split()[1])
                    for i in range(n)
                    for line in g.lines(i, "CALLS")
                    if line.split()[0] == phase
                ]
                for phase in ("open", "save", "restore")
            }
    for phase in ("open", "save", "restore"):
        two, four = calls[2][phase], calls[4][phase]
        assert len(two) == 2 and len(four) == 4, calls
        # every process but the primary makes the same calls whatever the count of
        # processes; the primary's grow by at most a constant
        assert max(four[1:]) <= max(two[1:]), (phase, calls)
        assert four[0] <= two[0] + 2, (phase, calls)


@pytest.fixture
def denied_root(s3_server: servers.Server) -> Iterator[tuple[str, str]]:
    yield f"s3://{s3_server.bucket}/{uuid.uuid4().hex}", s3_server.endpoint


def _failed(g: Group, i: int, step: int) -> tuple[str, float, str]:
    failed = [line.split()[1:] for line in g.lines(i, "FAILED") if line.split()[0] == str(step)]
    assert len(failed) == 1, g.report()
    kind, seconds = failed[0]
    (message,) = [m.split(" ", 1)[1] for m in g.lines(i, "MESSAGE") if m.split()[0] == str(step)]
    return kind, float(seconds), message


def test_one_process_whose_save_fails_on_its_own_fails_it_everywhere_naming_it(
    tmp_path: Path, denied_root: tuple[str, str]
) -> None:
    """Step 2: process 1's storage refuses its writes; step 3: process 1's local check
    fails (no process enters Orbax's collectives); step 4 commits on every process."""
    root, endpoint = denied_root
    proxy = DenyProxy(endpoint, deny=(("PUT", "/2.e"),))  # its packs: data/<hh>/2.<attempt>/
    try:
        env = {1: {"AWS_ENDPOINT_URL_S3": proxy.endpoint}}
        with group(tmp_path, root, "fail_save", 2, env_for=env) as g:
            for i in range(2):  # every process names the failing one and what failed
                kind, seconds, message = _failed(g, i, 2)
                assert kind == "SaveFailedError" and seconds < AGREED_WITHIN_S, g.report()
                assert "save of step 2" in message and "failed on process 1" in message, message
                assert "/2.e" in message and "AccessDenied" in message, message
                kind, seconds, message = _failed(g, i, 3)
                assert kind == "UnsupportedLeafError" and seconds < AGREED_WITHIN_S, g.report()
                assert "save of step 3" in message and "failed on process 1" in message, message
                assert "['bad']" in message, message
                assert g.lines(i, "COMMITTED") == ["1", "4"], g.report()  # in step again
        assert proxy.denied > 0
    finally:
        proxy.close()


def test_one_process_failing_inside_orbax_s_save_fails_it_everywhere_naming_it(
    tmp_path: Path,
) -> None:
    """Process 1 of 2 runs out of file descriptors after Orbax's first collective of
    the save of step 2: the other waited in the next one (a gloo collective
    without a deadline) for ever. Every process raises, naming process 1 and the
    error, and step 3 commits on all once the cause is gone."""
    root = str(tmp_path / "run")
    with group(tmp_path, root, "fail_orbax", 2) as g:
        for i in range(2):
            kind, seconds, message = _failed(g, i, 2)
            assert seconds < AGREED_WITHIN_S, g.report()
            assert kind == "SaveFailedError", g.report()
            assert "Too many open files" in message, message
            if i != 1:  # the failing process raises its own error
                assert "save of step 2" in message and "failed on process 1" in message, message
            assert g.lines(i, "COMMITTED") == ["1", "3"], g.report()
    with jaxckpt.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.steps() == [1, 3]


def test_a_failure_after_the_snapshots_writes_nothing_of_the_step_anywhere(
    tmp_path: Path,
) -> None:
    """Process 1 of 2 fails after its snapshots, when every process has handed its
    background write over: every process raises naming it, and no process wrote any
    data of step 2 (a write waits until its save's blocking phase has returned)."""
    root = tmp_path / "run"
    with group(tmp_path, str(root), "fail_snapshot", 2) as g:
        for i in range(2):
            kind, seconds, message = _failed(g, i, 2)
            assert seconds < AGREED_WITHIN_S, g.report()
            assert kind == "SaveFailedError", g.report()
            assert "No space left on device (injected" in message, message
            if i != 1:
                assert "save of step 2" in message and "failed on process 1" in message, message
            assert g.lines(i, "COMMITTED") == ["1", "3"], g.report()
    with jaxckpt.CheckpointManager(str(root), read_only=True) as mgr:
        assert mgr.steps() == [1, 3]
    data = [p for p in root.rglob("*") if p.is_file() and {"packs", "arrays"} & set(p.parts)]
    assert {_step_of(p.relative_to(root)) for p in data} == {1, 3}, sorted(map(str, data))


def _step_of(path: Path) -> int:
    """The step of a file of array data: ``attempts/<step>/<attempt>/arrays/...`` or
    ``data/<slot>/<step>.<attempt>/packs/...``."""
    if path.parts[0] == "attempts":
        return int(path.parts[1])
    return int(path.parts[2].split(".")[0])


def test_one_process_that_cannot_read_its_data_fails_the_restore_everywhere_naming_it(
    tmp_path: Path, denied_root: tuple[str, str]
) -> None:
    root, endpoint = denied_root
    with group(tmp_path, root, "count", 2):  # step 1 committed
        pass
    proxy = DenyProxy(endpoint, deny=(("GET", "/arrays/"), ("GET", "/packs/")))
    try:
        env = {1: {"AWS_ENDPOINT_URL_S3": proxy.endpoint}}
        with group(tmp_path, root, "fail_restore", 2, env_for=env) as g:
            for i in range(2):
                kind, seconds, message = _failed(g, i, 1)
                assert seconds < AGREED_WITHIN_S, g.report()
                assert kind not in ("StepNotFoundError", "CorruptCheckpointError"), message
                assert "restore of step 1" in message and "failed on process 1" in message
                assert "/packs/" in message and "AccessDenied" in message, message
        assert proxy.denied > 0
    finally:
        proxy.close()


def test_the_resume_loop_goes_on_after_a_fallback_on_every_process(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    with group(tmp_path, root, "resume", 2) as g:
        for i in range(2):
            assert g.lines(i, "RESTORED") == ["0"] and g.lines(i, "COMMITTED") == ["1", "2"]
    flip_a_byte(root, 2)
    with group(tmp_path, root, "resume", 2) as g:  # falls back to 1, saves 2 again, then 3
        for i in range(2):
            assert g.lines(i, "RESTORED") == ["1"], g.report()
            assert g.lines(i, "COMMITTED") == ["2", "3"], g.report()
    with jaxckpt.CheckpointManager(root, read_only=True) as mgr:  # the new step 2 is intact
        assert mgr.steps() == [1, 2, 3] and mgr.verify(2).ok
