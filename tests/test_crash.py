"""Crash safety: a writer is SIGKILLed at every phase of a save and a delete.

Each test starts ``tests/crash_child.py`` in a fresh process, lets it commit a
few steps, and kills it with SIGKILL either while it is paused at a named
phase of the protocol (``JAXCKPT_PAUSE_AT``, see ``jaxckpt/_phases.py``) or
after a seeded random delay while it saves in a loop. Then:

a. a read-only manager lists exactly the committed steps, each backed by a
   valid marker whose files are intact, and changes nothing on storage;
b. the newest committed step restores bit-exactly;
c. the next writer (a writable manager) removes every file of the partial
   step, leaving only the root record and committed steps;
d. the next writer can save the killed step number again and restore it.

Roots come from conftest's ``storage_root`` fixture. Every kill point runs on
a local directory and the ones in ``OBJECT_STORE_POINTS`` also on S3 and GCS;
a new kind of root is one more name in ``OBJECT_STORES``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import jaxckpt
from jaxckpt._layout import (
    StepLocation,
    is_latest_hint,
    new_attempt,
    parse_marker_key,
    parse_pending_key,
)
from jaxckpt._phases import PHASES
from jaxckpt._records import CommitMarker, FileDigest, json_record
from jaxckpt._storage import Storage, open_storage
from jaxckpt.errors import CorruptCheckpointError

CHILD_PATH = Path(__file__).with_name("crash_child.py")
_spec = importlib.util.spec_from_file_location("jaxckpt_crash_child", CHILD_PATH)
assert _spec is not None and _spec.loader is not None
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)

SEED = 7
PHASE_TIMEOUT_S = 60.0  # child start-up (importing jax) plus the saves before the pause
EXIT_TIMEOUT_S = 20.0
RANDOM_KILLS = 8
RANDOM_WINDOW_S = 0.8  # random kills land within this long after the first save returns

pytestmark = pytest.mark.timeout(150)


# -- roots --------------------------------------------------------------------

# Kinds of root, as conftest's ``storage_root`` fixture names them. Every kill
# point runs on a local directory. The object stores (a Python S3 server and
# the GCS emulator, both far slower than a disk) run the kill points named
# here, with smaller states, so the file stays fast.
LOCAL = "local"
OBJECT_STORES = ("s3", "gcs")
OBJECT_STORE_POINTS = (
    "data_written-later",
    "before_marker-later",
    "marker_written-later",
    "delete_retracted-middle",
    "random-1",
)
OBJECT_STORE_MB = 3.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class CrashRoot:
    """A checkpoint root; object-store endpoints come from the environment (see conftest)."""

    uri: str
    local_path: Path | None = None

    def manager(self, **kwargs: Any) -> Any:
        return jaxckpt.CheckpointManager(self.uri, chunk_bytes=child.CHUNK_BYTES, **kwargs)

    def storage(self) -> Storage:
        return open_storage(self.uri)


@pytest.fixture
def crash_root(storage_root: str) -> Iterator[CrashRoot]:
    local = "://" not in storage_root
    path = Path(storage_root) if local else None
    yield CrashRoot(uri=storage_root, local_path=path)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)  # keep pytest's kept temp dirs small


def _kinds(test_id: str, mb: float) -> list[tuple[str, float]]:
    """``(kind of root, state MiB)`` for each kind of root that runs ``test_id``."""
    return [(LOCAL, mb)] + [
        (kind, OBJECT_STORE_MB) for kind in OBJECT_STORES if test_id in OBJECT_STORE_POINTS
    ]


@pytest.fixture(autouse=True)
def _no_pause_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pause hook is for the children; this process must never sleep in it."""
    monkeypatch.delenv("JAXCKPT_PAUSE_AT", raising=False)


# -- the child process ----------------------------------------------------------


class PhaseNotReachedError(AssertionError):
    """The child exited or timed out without printing the awaited line."""


class Child:
    """``crash_child.py`` running in its own process, its output read by two threads."""

    def __init__(self, root: CrashRoot, *args: str, pause_at: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCKPT_PAUSE")}
        env.update(
            JAX_PLATFORMS="cpu",
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
            JAXCKPT_PAUSE_S="600",  # far longer than any test: the kill lands during the pause
            PYTHONUNBUFFERED="1",
        )
        if pause_at is not None:
            env["JAXCKPT_PAUSE_AT"] = pause_at
        self.argv = [sys.executable, str(CHILD_PATH), root.uri, "--seed", str(SEED), *args]
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.log: list[str] = []
        self.stdout: list[str] = []
        self._lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self._readers = [
            threading.Thread(target=self._read, args=(name, stream), daemon=True)
            for name, stream in (("out", self.proc.stdout), ("err", self.proc.stderr))
        ]
        for t in self._readers:
            t.start()
        self._open_streams = 2

    def _read(self, name: str, stream: Any) -> None:
        for line in stream:
            self._lines.put((name, line.rstrip("\n")))
        self._lines.put((name, None))

    def _next(self, deadline: float) -> tuple[str, str | None]:
        name, line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        if line is None:
            self._open_streams -= 1
        else:
            self.log.append(f"[{name}] {line}")
            if name == "out":
                self.stdout.append(line)
        return name, line

    def expect(self, pattern: str, *, timeout: float = PHASE_TIMEOUT_S) -> re.Match[str]:
        """Waits for a line matching ``pattern`` on stdout or stderr."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while self._open_streams:
            try:
                _, line = self._next(deadline)
            except queue.Empty:
                break
            match = regex.fullmatch(line) if line is not None else None
            if match:
                return match
        raise PhaseNotReachedError(
            f"no line matching {pattern!r} within {timeout:.0f}s "
            f"(exit code {self.proc.poll()}); child output:\n" + self.transcript()
        )

    def kill(self) -> None:
        """SIGKILL, then read the rest of the output (everything printed before the kill)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=EXIT_TIMEOUT_S)
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while self._open_streams:
            self._next(deadline)
        for t in self._readers:
            t.join(timeout=EXIT_TIMEOUT_S)

    def steps_said(self, word: str) -> list[int]:
        return [int(line.split()[1]) for line in self.stdout if line.startswith(word + " ")]

    def transcript(self) -> str:
        return " ".join(self.argv) + "\n" + "\n".join(self.log[-60:])


@contextlib.contextmanager
def run_child(root: CrashRoot, *args: str, pause_at: str | None = None) -> Iterator[Child]:
    proc = Child(root, *args, pause_at=pause_at)
    try:
        yield proc
    finally:
        proc.kill()  # on success the test already killed it; this is a no-op then


# -- checks ------------------------------------------------------------------------


def assert_bit_exact(actual: Any, expected: Any) -> None:
    """Same tree, same leaf types, and arrays with the same dtype, shape and bytes."""
    import jax

    flat_a, _ = jax.tree_util.tree_flatten_with_path(actual, is_leaf=lambda x: x is None)
    flat_e, _ = jax.tree_util.tree_flatten_with_path(expected, is_leaf=lambda x: x is None)
    paths_a = [jax.tree_util.keystr(p) for p, _ in flat_a]
    assert paths_a == [jax.tree_util.keystr(p) for p, _ in flat_e]
    for (path, a), (_, e) in zip(flat_a, flat_e, strict=True):
        where = jax.tree_util.keystr(path)
        if isinstance(e, np.ndarray):
            assert isinstance(a, np.ndarray), f"{where}: {type(a).__name__}, not ndarray"
            assert (a.dtype, a.shape) == (e.dtype, e.shape), where
            np.testing.assert_array_equal(
                np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                np.ascontiguousarray(e).reshape(-1).view(np.uint8),
                err_msg=where,
            )
        else:
            assert type(a) is type(e) and a == e, f"{where}: {a!r} != {e!r}"


def valid_markers(storage: Storage) -> dict[int, CommitMarker]:
    """Markers under ``commits/`` that parse, check out and name their step; files intact.

    One writer at a time runs here, so no epoch hides a marker.
    """
    markers = {}
    for key in storage.list("commits/"):
        ref = parse_marker_key(key)
        if ref is None:
            continue  # e.g. a create-only write's temporary file (killed mid-create)
        marker = CommitMarker.from_bytes(storage.read(key) or b"", key)  # never torn
        assert marker.step == ref.step, key
        for name, digest in marker.files.items():
            data = storage.read(marker.location.key(name))
            assert data is not None, f"committed step {ref.step}: {name} is missing"
            assert FileDigest.of(data) == digest, f"committed step {ref.step}: {name} is altered"
        markers[ref.step] = marker
    return dict(sorted(markers.items()))


def valid_marker_steps(storage: Storage) -> list[int]:
    return list(valid_markers(storage))


def attempt_keys(storage: Storage, step: int) -> list[str]:
    """Every data key of every attempt of ``step``."""
    return storage.list(f"attempts/{step}/")


def pending_records(storage: Storage, step: int, *, planted: bool = True) -> list[dict[str, Any]]:
    """Pending records of ``step`` (``planted=False``: not those ``plant_leftovers`` wrote)."""
    locs = [(k, loc) for k in storage.list("pending/") if (loc := parse_pending_key(k))]
    keys = [k for k, loc in locs if loc.step == step and (planted or loc.epoch != 0)]
    return [json.loads(storage.read(k) or b"{}") for k in keys]


def marker_of(storage: Storage, step: int) -> bytes | None:
    keys = [k for k in storage.list("commits/") if (r := parse_marker_key(k)) and r.step == step]
    assert len(keys) <= 1, keys
    return storage.read(keys[0]) if keys else None


def chunk_keys(keys: list[str]) -> list[str]:
    return [k for k in keys if "/arrays/" in k and "/c/" in k]


def landing(storage: Storage, step: int) -> str:
    """Where in the protocol the writer of ``step`` stopped, judged from storage."""
    keys = attempt_keys(storage, step)
    marker = marker_of(storage, step)
    pending = pending_records(storage, step)
    if marker is not None:
        try:
            CommitMarker.from_bytes(marker, f"marker of {step}")
        except CorruptCheckpointError:
            return "torn marker"
        return "marker written" + (", pending left" if pending else "")
    if any("/manifest/" in k for k in keys):
        return "manifest written"
    if chunk_keys(keys):
        return "data written (partly or wholly)"
    if pending:
        return "pending written"
    return "between saves"


def assert_landed_at(storage: Storage, step: int, phase: str) -> None:
    """Storage shows the kill really happened at ``phase`` of ``step``."""
    keys = [k for k in attempt_keys(storage, step) if not k.startswith(f"attempts/{step}/e0-")]
    records = pending_records(storage, step, planted=False)
    marker = marker_of(storage, step)
    manifests = [k for k in keys if k.endswith("/manifest/0.json")]
    assert len(records) == 1, f"{phase}: pending records for step {step}: {records}"
    operation = records[0]["operation"]
    assert operation == ("delete" if phase == "delete_retracted" else "save")
    assert (marker is not None) == (phase == "marker_written"), f"{phase}: marker {marker!r}"
    if phase == "pending_written":
        assert keys == [], f"{phase}: leftover files {keys}"
    elif phase in ("data_started", "data_written"):
        assert chunk_keys(keys) and not manifests, f"{phase}: {keys}"
    else:
        assert manifests, f"{phase}: {keys}"


def check_recovery(
    root: CrashRoot,
    *,
    killed: int,
    committed: list[int],
    mb: float,
) -> None:
    """Checks (a)-(d) of the module docstring after a kill."""
    storage = root.storage()
    before = storage.list("")

    # (a) a reader lists exactly the steps with a valid marker, and writes nothing.
    with root.manager(read_only=True) as reader:
        assert reader.steps() == committed
        assert valid_marker_steps(storage) == committed
        # (b) the newest committed step restores bit-exactly and verifies.
        if committed:
            newest = committed[-1]
            assert reader.latest_step() == newest
            assert_bit_exact(reader.restore(), child.host_state(SEED, newest, mb))
            assert reader.verify(newest).ok
        else:
            with pytest.raises(jaxckpt.StepNotFoundError):
                reader.restore()
        if killed not in committed:
            with pytest.raises((jaxckpt.UncommittedStepError, jaxckpt.StepNotFoundError)):
                reader.restore(killed)
    assert storage.list("") == before, "a read-only manager changed the storage"

    # (c) the next writer removes the partial step: only committed steps remain.
    with root.manager() as writer:
        keys = storage.list("")
        markers = valid_markers(storage)
        allowed = {"jaxckpt.json"} | {m.key for m in markers.values()}
        keys = [k for k in keys if not is_latest_hint(k)]
        prefixes = ("writers/", *(m.location.prefix for m in markers.values()))
        stray = [k for k in keys if k not in allowed and not k.startswith(prefixes)]
        assert stray == [], f"left behind after the crash of step {killed}: {stray}"
        assert not any(k.startswith("pending/") for k in keys)
        if killed not in committed:
            assert attempt_keys(storage, killed) == []
        assert writer.steps() == committed

        # (d) the killed step number can be saved again and restores bit-exactly.
        if killed in committed:
            with pytest.raises(jaxckpt.StepAlreadyExistsError):
                writer.save(killed, child.host_state(SEED, killed, mb))
        else:
            assert writer.save(killed, child.device_state(SEED, killed, mb))
            writer.wait()
        assert writer.steps() == sorted({*committed, killed})
        assert_bit_exact(writer.restore(killed), child.host_state(SEED, killed, mb))


# -- kill points ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class KillPoint:
    """Where to pause the child: ``phase`` during the ``op`` of ``step``."""

    phase: str
    variant: str
    start: int
    steps: int
    mb: float
    op: str = "save"
    step: int = 0
    no_gc: bool = False
    leftovers: bool = False  # plant the debris of an earlier crashed save of ``step``

    @property
    def id(self) -> str:
        return f"{self.phase}-{self.variant}"

    def child_args(self) -> list[str]:
        args = ["--start", str(self.start), "--steps", str(self.steps), "--mb", str(self.mb)]
        if self.op == "delete":
            args += ["--delete", str(self.step)]
        if self.no_gc:
            args.append("--no-gc")
        return [*args, "--arm", f"{self.op}:{self.step}"]

    def committed_after(self) -> list[int]:
        saved = range(self.start, self.start + self.steps)
        if self.op == "delete":
            return [s for s in saved if s != self.step]
        return [s for s in saved if s < self.step or self.phase == "marker_written"]


SAVE_PHASES = [p for p in PHASES if p != "delete_retracted"]


def _kill_points() -> list[Any]:
    points = []
    for phase in SAVE_PHASES:
        points += [
            # the very first save into an empty root
            KillPoint(phase=phase, variant="first", start=1, steps=1, mb=4, step=1),
            # after two committed steps
            KillPoint(phase=phase, variant="later", start=1, steps=3, mb=8, step=3),
            # re-saving a step whose earlier attempt crashed, without GC on open
            KillPoint(
                phase=phase,
                variant="resave",
                start=1,
                steps=2,
                mb=4,
                step=2,
                no_gc=True,
                leftovers=True,
            ),
        ]
    points += [
        KillPoint(
            phase="delete_retracted", variant="middle", start=1, steps=3, mb=4, op="delete", step=2
        ),
        KillPoint(
            phase="delete_retracted", variant="newest", start=1, steps=3, mb=4, op="delete", step=3
        ),
    ]
    return [
        pytest.param(
            kind,
            dataclasses.replace(p, mb=mb),
            id=f"{kind}-{p.id}",
        )
        for p in points
        for kind, mb in _kinds(p.id, p.mb)
    ]


def plant_leftovers(storage: Storage, step: int) -> list[str]:
    """The debris of a save of ``step`` by an earlier writer killed before its marker.

    Returns the stray keys: an attempt of epoch 0, which every later writer's epoch fences.
    """
    loc = StepLocation(step, new_attempt(0))
    storage.write(loc.pending_key, json_record(operation="save", started=time.time()))
    stray = [loc.arrays_prefix + "params.w/c/0/0", loc.prefix + "manifest/0.json"]
    for key in stray:
        storage.write(key, b"\xde\xad\xbe\xef" * 64)
    return [loc.pending_key, *stray]


def test_phases_cover_the_protocol() -> None:
    """Every phase jaxckpt names has kill points here (a new phase needs new tests)."""
    covered = {p.values[1].phase for p in _kill_points()}
    assert covered == set(PHASES)


@pytest.mark.parametrize(("storage_root", "point"), _kill_points(), indirect=["storage_root"])
def test_kill_at_phase(crash_root: CrashRoot, point: KillPoint) -> None:
    storage = crash_root.storage()
    stray: list[str] = []
    if point.leftovers:
        storage.write("jaxckpt.json", json_record(created=time.time()))
        stray = plant_leftovers(storage, point.step)

    with run_child(crash_root, *point.child_args(), pause_at=point.phase) as proc:
        proc.expect(rf"JAXCKPT_PHASE {point.phase} {point.step}")
        proc.kill()

    last_announced = point.start + point.steps if point.op == "delete" else point.step
    assert proc.steps_said("COMMITTED") == list(range(point.start, last_announced)), (
        proc.transcript()
    )
    assert_landed_at(storage, point.step, point.phase)
    keys = storage.list("")
    assert set(stray) <= set(keys), "a save deleted another attempt's files"
    check_recovery(crash_root, killed=point.step, committed=point.committed_after(), mb=point.mb)


def _random_delays() -> list[Any]:
    """Seeded delays, one per stratum of the window, so the kills spread over it."""
    rng = random.Random(20260601)
    width = RANDOM_WINDOW_S / RANDOM_KILLS
    params = []
    for i in range(RANDOM_KILLS):
        delay = round((i + rng.random()) * width, 4)
        for kind, mb in _kinds(f"random-{i}", 4.0):
            params.append(pytest.param(kind, delay, mb, id=f"{kind}-random-{i}"))
    return params


@pytest.mark.parametrize(
    ("storage_root", "delay_s", "mb"), _random_delays(), indirect=["storage_root"]
)
def test_kill_at_random_time(
    crash_root: CrashRoot, delay_s: float, mb: float, request: pytest.FixtureRequest, capsys: Any
) -> None:
    with run_child(crash_root, "--start", "1", "--steps", "100000", "--mb", str(mb)) as proc:
        proc.expect(r"SAVED 1")
        time.sleep(delay_s)
        proc.kill()

    announced = proc.steps_said("COMMITTED")
    assert announced == list(range(1, len(announced) + 1)), proc.transcript()
    killed = len(announced) + 1  # the save under way (or about to start) when killed
    storage = crash_root.storage()
    where = landing(storage, killed)
    if request.config.get_verbosity() > 0:
        with capsys.disabled():
            print(f" [killed after {delay_s:.3f}s: step {killed}, {where}]", end=" ")
    committed = valid_marker_steps(storage)
    # A commit the child had no time to announce is still a commit.
    assert committed in (announced, [*announced, killed]), (committed, announced)
    check_recovery(crash_root, killed=killed, committed=committed, mb=mb)
