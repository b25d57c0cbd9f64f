"""Crash safety: a writer is SIGKILLed at every phase of a save and a delete.

Each test starts ``tests/crash_child.py`` in a fresh process, lets it commit a
few steps, and kills it with SIGKILL either while it is paused at a named
phase of the protocol (``JAXCKPT_PAUSE_AT``, see ``jaxckpt/commit/_phases.py``) or,
while it saves in a loop, a seeded random fraction of the way through a seeded
random phase (``JAXCKPT_TRACE`` and ``crash_child.py --end-in``: a kernel timer
whose SIGALRM, with no handler, ends it as SIGKILL does). Storage must first show
the post-condition of the phase where the kill landed (``tests/protocol_state.py``);
then:

a. a read-only manager lists exactly the committed steps, each backed by a
   valid marker whose files are intact, and changes nothing on storage;
b. the newest committed step restores bit-exactly;
c. the next writer (a writable manager) removes every file of the partial
   step, leaving only the root record and committed steps;
d. the next writer can save the killed step number again and restore it.

Roots come from conftest's ``storage_root`` fixture. Every kill point runs on
a local directory and the ones in ``OBJECT_STORE_POINTS`` (every phase) also
on S3 and GCS; a new kind of root is one more name in ``OBJECT_STORES``.

Layouts: every kill point runs the library's default layout (``packed``:
``CheckpointOptions().layout``), the one users get, as does the save paused at
every phase in turn on every kind of root. The other layout (``plain``, one
object per chunk) runs the kill points in ``PLAIN_POINTS`` (the phases where
the two layouts store different things) and the paused save on a local root;
the random kills on every kind of root run the default (``RANDOM_KILLS_LAYOUT``);
``test_layouts_cover_every_phase`` keeps both covered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crash_child as child
import harness
import numpy as np
import protocol_state as state
import pytest

import jaxckpt
from jaxckpt.commit import PHASES
from jaxckpt.records import pack_name
from jaxckpt.storage import Storage, open_storage

CHILD_PATH = Path(__file__).with_name("crash_child.py")

SEED = 7
PHASE_TIMEOUT_S = 60.0  # child start-up (importing jax) plus the saves before the pause
EXIT_TIMEOUT_S = 60.0  # a resumed child finishing its save and closing: only a hang reaches it
RANDOM_KILLS = {"local": 8, "s3": 4, "gcs": 4}

pytestmark = pytest.mark.timeout(150)


# -- roots --------------------------------------------------------------------

# Kinds of root, as conftest's ``storage_root`` fixture names them. Every kill
# point runs on a local directory. The object stores (a Python S3 server and
# the GCS emulator, both far slower than a disk) run the kill points named
# here, with smaller states, so the file stays fast.
LOCAL = "local"
OBJECT_STORES = ("s3", "gcs")
OBJECT_STORE_POINTS = (
    "pending_written-later",
    "data_started-later",
    "data_written-later",
    "manifest_written-later",
    "before_marker-later",
    "marker_written-later",
    "delete_retracted-middle",
)
OBJECT_STORE_MB = 3.0

# Layouts, as ``CheckpointOptions.layout`` names them.
DEFAULT_LAYOUT = jaxckpt.CheckpointOptions().layout
LAYOUTS = ("packed", "plain")
OTHER_LAYOUT = next(layout for layout in LAYOUTS if layout != DEFAULT_LAYOUT)
# The kill points the non-default layout runs too (on a local root): the phases
# whose storage differs between layouts (chunk objects or packs, and the
# manifest that names them), and a delete of such a step.
PLAIN_POINTS = ("data_started-later", "manifest_written-later", "delete_retracted-middle")
# The random kills' layout: the default. A watched packed save starts its other packs
# only once the first is durable, so each kill lands after the phase it follows
# (test_a_watched_packed_save_announces_data_started_before_its_other_packs_land).
RANDOM_KILLS_LAYOUT = DEFAULT_LAYOUT


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


def _kinds(test_id: str, mb: float) -> list[tuple[str, float, str]]:
    """``(kind of root, state MiB, layout)`` for each run of the kill point ``test_id``."""
    kinds = [(LOCAL, mb)] + [
        (kind, OBJECT_STORE_MB) for kind in OBJECT_STORES if test_id in OBJECT_STORE_POINTS
    ]
    runs = [(kind, size, DEFAULT_LAYOUT) for kind, size in kinds]
    runs += [(LOCAL, mb, OTHER_LAYOUT)] if test_id in PLAIN_POINTS else []
    return runs


@pytest.fixture(autouse=True)
def _no_pause_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pause hook is for the children; this process must never sleep in it."""
    monkeypatch.delenv("JAXCKPT_PAUSE_AT", raising=False)


# -- the child process ----------------------------------------------------------


class Child(harness.Child):
    """``crash_child.py`` running in its own process (see ``harness.Child``)."""

    def __init__(
        self,
        root: CrashRoot,
        *args: str,
        pause_at: str | None = None,
        resume_dir: Path | None = None,
        trace: bool = False,
    ) -> None:
        env = harness.child_env(
            pause_at=pause_at,
            resume_dir=resume_dir,
            trace=trace,
            pause_s=600,  # far longer than any test: the kill lands during the pause
            JAX_PLATFORMS="cpu",
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
            PYTHONUNBUFFERED="1",
        )
        argv = [sys.executable, str(CHILD_PATH), root.uri, "--seed", str(SEED), *args]
        super().__init__(argv, env=env, timeout_s=PHASE_TIMEOUT_S, exit_timeout_s=EXIT_TIMEOUT_S)

    def steps_said(self, word: str) -> list[int]:
        return [int(line.split()[1]) for line in self.stdout if line.startswith(word + " ")]

    def traced(self) -> list[tuple[str, int]]:
        """``(phase, step)`` of every ``JAXCKPT_TRACE`` line, in order."""
        lines = (line.split() for line in self.stderr if line.startswith("JAXCKPT_TRACE "))
        return [(phase, int(step)) for _, phase, step in lines]


@contextlib.contextmanager
def run_child(root: CrashRoot, *args: str, **kwargs: Any) -> Iterator[Child]:
    proc = Child(root, *args, **kwargs)
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
        assert state.valid_marker_steps(storage) == committed
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
        stray = state.stray_objects(storage, committed)
        assert stray == [], f"left behind after the crash of step {killed}: {stray}"
        assert state.pending_operation(storage, killed) is None
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
    layout: str = DEFAULT_LAYOUT

    @property
    def id(self) -> str:
        return f"{self.phase}-{self.variant}"

    def child_args(self) -> list[str]:
        args = ["--start", str(self.start), "--steps", str(self.steps), "--mb", str(self.mb)]
        args += ["--layout", self.layout]
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


def _kill_points() -> list[Any]:
    points = []
    for phase in state.SAVE_PHASES:
        points += [
            # the very first save into an empty root
            KillPoint(phase=phase, variant="first", start=1, steps=1, mb=4, step=1),
            # after two committed steps
            KillPoint(phase=phase, variant="later", start=1, steps=3, mb=8, step=3),
        ]
    # Re-saving a step whose earlier attempt crashed, without GC on open: the
    # save clears the debris before pending_written, so later phases add nothing.
    points.append(
        KillPoint(
            phase="pending_written",
            variant="resave",
            start=1,
            steps=2,
            mb=4,
            step=2,
            no_gc=True,
            leftovers=True,
        )
    )
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
            dataclasses.replace(p, mb=mb, layout=layout),
            id=f"{kind}-{p.id}" + ("" if layout == DEFAULT_LAYOUT else f"-{layout}"),
        )
        for p in points
        for kind, mb, layout in _kinds(p.id, p.mb)
    ]


# The protocol's phases, in order, as this file knows them. A new, renamed or
# reordered phase fails test_phases_cover_the_protocol until it has a
# post-condition in protocol_state.check_phase and kill points here.
KNOWN_PHASES = (
    "pending_written",
    "data_started",
    "data_written",
    "manifest_written",
    "before_marker",
    "marker_written",
    "delete_retracted",
)


def test_phases_cover_the_protocol() -> None:
    """Every phase jaxckpt names has kill points on every kind of root (default layout)."""
    assert tuple(PHASES) == KNOWN_PHASES
    covered: dict[str, set[str]] = {}
    for param in _kill_points():
        kind, point = param.values
        if point.layout == DEFAULT_LAYOUT:
            covered.setdefault(kind, set()).add(point.phase)
    assert covered == {kind: set(KNOWN_PHASES) for kind in (LOCAL, *OBJECT_STORES)}


def test_layouts_cover_every_phase() -> None:
    """The default layout is killed at every phase on every kind of root
    (test_phases_cover_the_protocol) and paused at every save phase on every kind;
    the other layout is killed at its points and paused at every save phase on a
    local root, and killed at random on every kind of root."""
    assert set(LAYOUTS) == {DEFAULT_LAYOUT, OTHER_LAYOUT} and DEFAULT_LAYOUT == "packed"
    other = {param.values[1].id for param in _kill_points() if param.values[0] == LOCAL}
    other &= {p.values[1].id for p in _kill_points() if p.values[1].layout == OTHER_LAYOUT}
    assert other == set(PLAIN_POINTS)
    assert set(PHASES_IN_ORDER) == {
        *((kind, DEFAULT_LAYOUT) for kind in (LOCAL, *OBJECT_STORES)),
        (LOCAL, OTHER_LAYOUT),
    }
    assert RANDOM_KILLS_LAYOUT == DEFAULT_LAYOUT and set(RANDOM_KILLS) == {LOCAL, *OBJECT_STORES}


@pytest.mark.parametrize(("storage_root", "point"), _kill_points(), indirect=["storage_root"])
def test_kill_at_phase(crash_root: CrashRoot, point: KillPoint) -> None:
    storage = crash_root.storage()
    stray = state.plant_leftovers(storage, point.step) if point.leftovers else []

    with run_child(crash_root, *point.child_args(), pause_at=point.phase) as proc:
        proc.wait_phase(point.phase, point.step)
        proc.kill()

    last_announced = point.start + point.steps if point.op == "delete" else point.step
    assert proc.steps_said("COMMITTED") == list(range(point.start, last_announced)), (
        proc.transcript()
    )
    state.check_phase(storage, point.step, point.phase)
    check_layout(storage, point)
    keys = storage.list("")
    assert set(stray) <= set(keys), "a save deleted another attempt's files"
    check_recovery(crash_root, killed=point.step, committed=point.committed_after(), mb=point.mb)


def check_layout(storage: Storage, point: KillPoint) -> None:
    """The killed step's data objects are the layout's: pack objects (the first one
    durable from ``data_started`` on; several for the larger local state) or chunk objects."""
    if point.phase == "pending_written" or point.op == "delete":
        return
    data = state.data_objects(storage, point.step)
    packs = {name for kind, name in data if kind == "packs"}
    if point.layout == "plain":
        assert data and not packs, data
        return
    assert packs and packs == {name for _, name in data}, data
    assert pack_name(0, 0).removeprefix("packs/") in packs, data  # the first one is durable
    if point.mb >= 8 and point.phase != "data_started":  # 8 MiB: more than one pack
        assert len(state.expected_data_objects(storage, point.step)) > 1, data


# (kind of root, layout) of the saves paused at every phase in turn.
PHASES_IN_ORDER = [(kind, DEFAULT_LAYOUT) for kind in (LOCAL, *OBJECT_STORES)]
PHASES_IN_ORDER += [(LOCAL, OTHER_LAYOUT)]


@pytest.mark.parametrize(("storage_root", "layout"), PHASES_IN_ORDER, indirect=["storage_root"])
def test_save_passes_every_phase_in_order(
    crash_root: CrashRoot, tmp_path: Path, layout: str
) -> None:
    """One save paused (and resumed) at every phase shows each post-condition in turn."""
    storage = crash_root.storage()
    mb = 4.0 if crash_root.local_path is not None else OBJECT_STORE_MB
    resume = tmp_path / "resume"
    resume.mkdir()
    args = ["--start", "1", "--steps", "2", "--mb", str(mb), "--arm", "save:2"]
    args += ["--layout", layout]
    pause_at = ",".join(state.SAVE_PHASES)
    with run_child(crash_root, *args, pause_at=pause_at, resume_dir=resume) as proc:
        for phase in state.SAVE_PHASES:
            proc.wait_phase(phase, 2)
            state.check_phase(storage, 2, phase)
            harness.resume(resume, phase, 2)
        assert proc.finish() == 0, proc.transcript()
    paused = [line.split()[1] for line in proc.stderr if line.startswith("JAXCKPT_PHASE ")]
    assert paused == list(state.SAVE_PHASES), proc.transcript()
    assert proc.stdout[-2:] == ["COMMITTED 2", "DONE"], proc.transcript()
    assert state.valid_marker_steps(storage) == [1, 2]
    assert state.stray_objects(storage, [1, 2]) == []
    with crash_root.manager(read_only=True) as reader:
        assert_bit_exact(reader.restore(2), child.host_state(SEED, 2, mb))


def test_a_watched_packed_save_announces_data_started_before_its_other_packs_land(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A traced save does each phase's action before it announces the phase, in order
    (``jaxckpt.commit._phases.watched``): at data_started, only the first pack is durable.

    The first pack's upload is slowed, so the others land first unless the writer waits
    for it before it starts them (as the plain layout's writer waits for its first chunk).
    """
    from jaxckpt.formats import _packed as _pack

    root = CrashRoot(uri=str(tmp_path / "root"))
    storage = root.storage()
    first = pack_name(0, 0)
    upload, announce = _pack.PackWriter._upload, _pack.reached
    seen: dict[int, set[tuple[str, str]]] = {}

    def first_pack_slow(self: Any, key: str, pieces: Any) -> None:
        if key.endswith(first):
            time.sleep(0.5)
        upload(self, key, pieces)

    def record(phase: str, step: int) -> None:
        if phase == "data_started":
            seen[step] = state.data_objects(storage, step)
        announce(phase, step)

    monkeypatch.setenv(harness.TRACE, "1")
    monkeypatch.setattr(_pack.PackWriter, "_upload", first_pack_slow)
    monkeypatch.setattr(_pack, "reached", record)
    with root.manager(layout="packed") as mgr:
        mgr.save(1, child.host_state(SEED, 1, 12))
    assert len(state.expected_data_objects(storage, 1)) > 2  # 12 MiB: several packs
    assert seen == {1: {("packs", first.removeprefix("packs/"))}}


def _random_kills() -> list[Any]:
    """Seeded (phase, step, fraction) per kill; phases cycle so the kills spread over them."""
    params = []
    for kind, n in RANDOM_KILLS.items():
        rng = random.Random(f"20260601-{kind}")
        phases = list(state.SAVE_PHASES)
        rng.shuffle(phases)
        kills = [
            (phases[i % len(phases)], rng.choice((2, 3)), round(rng.uniform(0, 1), 4))
            for i in range(n)
        ]
        params.append(pytest.param(kind, kills, id=kind))
    return params


# Up to 8 writers one after another, each bounded by its own PHASE_TIMEOUT_S waits: the
# module's 150 s is a guess that a loaded machine outlasted (4 on S3 at load 30); this
# bound is one only a hang reaches.
@pytest.mark.timeout(max(RANDOM_KILLS.values()) * (2 * PHASE_TIMEOUT_S + EXIT_TIMEOUT_S))
@pytest.mark.parametrize(("storage_root", "kills"), _random_kills(), indirect=["storage_root"])
def test_kill_at_random_instants(
    storage_root: str, kills: list[tuple[str, int, float]], capsys: Any
) -> None:
    """Ends a running (not paused) writer a random fraction of the way through a
    random phase (``crash_child.py --end-in``: a kernel timer the child sets as it
    announces the phase, to that fraction of the phase's length in the step before).

    Where each kill landed is read from the writer's trace and checked
    against storage; the spread over phases is reported and asserted.
    """
    landings = []
    for i, (phase, step, fraction) in enumerate(kills):
        root = f"{storage_root}/kill-{i}" if "://" in storage_root else f"{storage_root}-kill-{i}"
        crash_root = CrashRoot(uri=root)
        landings.append(_kill_once(crash_root, phase, step, fraction))
    spread = sorted(set(landings), key=[*state.SAVE_PHASES, "between saves"].index)
    with capsys.disabled():
        aimed = (
            f"{phase} -> {landing}" for (phase, _, _), landing in zip(kills, landings, strict=True)
        )
        print(f"\n  {len(kills)} random kills, aimed at -> landed after: {', '.join(aimed)}")
    # Each kill lands inside its target phase unless that phase ran faster than in the
    # step before, so the landings spread over at least half of the distinct targets.
    targets = {phase for phase, _, _ in kills}
    assert len(spread) >= max(2, len(targets) // 2), landings


def _kill_once(root: CrashRoot, phase: str, step: int, fraction: float) -> str:
    """One seeded kill; checks storage against the trace and recovery; returns the landing."""
    mb = 4.0 if "://" not in root.uri else OBJECT_STORE_MB
    args = ["--start", "1", "--steps", "100000", "--mb", str(mb), "--layout", RANDOM_KILLS_LAYOUT]
    args += ["--end-in", f"{phase}:{step}:{fraction}"]
    with run_child(root, *args, trace=True) as proc:
        proc.expect(rf"JAXCKPT_TRACE {phase} {step}")
        try:
            proc.proc.wait(timeout=PHASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the child outlived its --end-in timer\n{proc.transcript()}")
        proc.kill()  # reads the rest of its output
    assert proc.proc.returncode == -signal.SIGALRM, proc.transcript()
    announced = proc.steps_said("COMMITTED")
    assert announced == list(range(1, len(announced) + 1)), proc.transcript()
    traced = proc.traced()
    killed = max(s for _, s in traced)
    last: str | None = [p for p, s in traced if s == killed][-1]
    storage = root.storage()
    landing = last
    if last == "marker_written":  # the kill landed after that commit, maybe in the next save
        assert state.observed_phase(storage, killed) == "marker_written"
        killed, last, landing = killed + 1, None, "between saves"
    observed = state.observed_phases(storage, killed)
    assert observed & state.AFTER_ANNOUNCED[last], (killed, last, observed, proc.transcript())
    before = list(range(1, killed))
    committed = state.valid_marker_steps(storage)
    assert committed == ([*before, killed] if "marker_written" in observed else before)
    assert announced == before[: len(announced)], (announced, committed)
    check_recovery(root, killed=killed, committed=committed, mb=mb)
    assert landing is not None
    return landing
