"""What a torture round observes, and the invariants checked after it (see ``torture.py``).

A :class:`Child` is a ``torture_child.py`` process whose timestamped events are
read by two threads; a :class:`Writer` is what those events say about one
writer of a root (its epoch, when it opened, when it began each commit
marker, what it committed); a :class:`Root` keeps every writer that ever
opened it, so a round's checks also cover what earlier rounds left.

:func:`check_round` runs the checks with fresh managers and the ``jaxckpt``
command line in this process, talking to the servers directly, and appends
what it finds to the round's :class:`RoundResult`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import torture_child

CLI_TIMEOUT_S = 120.0

# -- child processes ---------------------------------------------------------------


@dataclasses.dataclass
class Event:
    t: float
    name: str
    args: list[str]


class Child:
    """A ``torture_child.py`` process; its timestamped events are read by two threads."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str]) -> None:
        self.label = label
        self.argv = argv
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.events: list[Event] = []
        self.stderr: list[str] = []
        self.killed = False
        self._queue: queue.Queue[Event | None] = queue.Queue()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._read_out, daemon=True),
            threading.Thread(target=self._read_err, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            words = line.split()
            try:
                event = Event(float(words[0]), words[1], words[2:])
            except (IndexError, ValueError):
                event = Event(time.time(), "RAW", words)
            with self._lock:
                self.events.append(event)
            self._queue.put(event)
        self._queue.put(None)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._lock:
                self.stderr.append(line.rstrip("\n"))
                del self.stderr[:-200]

    def wait_for(self, name: str, timeout: float) -> Event | None:
        """The next event ``name`` (None: the child ended or the time ran out)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if event is None:
                self._queue.put(None)  # keep the end visible to later waits
                return None
            if event.name == name:
                return event

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.killed = True
        self.join(30.0)

    def join(self, timeout: float) -> bool:
        """Waits for the exit and the end of the output; False on timeout."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        for t in self._threads:
            t.join(timeout=10.0)
        return True

    def all(self, name: str) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e.name == name]

    def first(self, name: str) -> Event | None:
        found = self.all(name)
        return found[0] if found else None

    def steps(self, name: str) -> list[int]:
        return [int(e.args[0]) for e in self.all(name) if e.args and e.args[0].isdigit()]

    def tail(self, n: int = 25) -> str:
        with self._lock:
            out = [f"{e.t:.3f} {e.name} {' '.join(e.args)}" for e in self.events[-n:]]
            err = [line for line in self.stderr if "AuthCredentials" not in line][-n:]
        return "\n".join([" ".join(self.argv), "stdout:", *out, "stderr:", *err])


# -- what the run knows about each writer ------------------------------------------


@dataclasses.dataclass
class Writer:
    """A writer process of a root, as its events describe it."""

    seed: int
    label: str
    round: int
    kib: float
    child: Child | None = None
    epoch: int | None = None
    opening: float | None = None
    opened: float | None = None
    marker_begun: dict[int, float] = dataclasses.field(default_factory=dict)
    committed: dict[int, float] = dataclasses.field(default_factory=dict)

    def absorb(self) -> None:
        """Reads the child's events into the fields above."""
        child = self.child
        if child is None:
            return
        if (e := child.first("OPENING")) is not None:
            self.opening = e.t
        if (e := child.first("OPENED")) is not None:
            self.opened = e.t
            self.epoch = int(e.args[0])
        for e in child.all("PHASE"):
            if e.args[:1] == [torture_child.MARKER_PHASE]:
                self.marker_begun[int(e.args[1])] = float(e.args[2].split("=", 1)[1])
        for e in child.all("COMMITTED"):
            self.committed[int(e.args[0])] = e.t


@dataclasses.dataclass
class Root:
    """One checkpoint root, used for a few rounds, and every writer that ever opened it."""

    backend: str
    uri: str
    kib: float
    writers: dict[int, Writer] = dataclasses.field(default_factory=dict)
    rounds: int = 0


@dataclasses.dataclass
class RoundResult:
    number: int
    backend: str
    scenario: str
    faulty: bool
    variant: str = ""
    kills: int = 0
    faults: Counter[str] = dataclasses.field(default_factory=Counter)
    steps_verified: int = 0
    fenced_writers: int = 0
    hidden_commits: int = 0
    contested_steps: int = 0
    operator_gcs: int = 0
    save_failures: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def check_round(root: Root, result: RoundResult, writers: list[Writer]) -> None:
    """Every check of a round: the writers' own output, then the root."""
    check_writers(root, result, writers)
    check_root(root, result)


# -- checks ----------------------------------------------------------------------


def check_writers(root: Root, result: RoundResult, writers: list[Writer]) -> None:
    """What the writers' own output must show."""
    from jaxckpt.commit import EpochReader
    from jaxckpt.storage import open_storage

    newest_epoch = EpochReader(open_storage(root.uri)).newest()
    for w in writers:
        child = w.child
        assert child is not None
        w.absorb()
        for e in child.all("ERROR"):
            result.violations.append(
                f"{w.label}: died with a non-CheckpointError: {' '.join(e.args)}\n" + child.tail()
            )
        for e in child.all("RESTORED"):
            if e.args[2:3] != ["ok"]:
                result.violations.append(f"{w.label}: restored a wrong state: {' '.join(e.args)}")
        if child.first("FENCED") is not None:
            result.fenced_writers += 1
        failed = child.all("FAILED")
        result.save_failures += len(failed)
        # A writer that failed while opening has no known epoch: judge it as the newest.
        newest = w.epoch is None or w.epoch == newest_epoch
        for e in failed:
            text = " ".join(e.args)
            if newest and not result.faulty and "committed by another writer" not in text:
                result.violations.append(f"{w.label} (newest writer) failed: {text}")
            else:
                result.notes.append(f"{w.label} (epoch {w.epoch}) failed: {text[:300]}")
        if w.epoch is not None and newest and child.first("FENCED") is not None:
            result.violations.append(f"{w.label} has the newest epoch yet was fenced")
    # A restarted writer resumes from at least every step committed before it opened.
    for w in writers:
        restored = w.child.first("RESTORED") if w.child else None
        if w.opening is None or w.child is None or w.child.first("OPENED") is None:
            continue
        if "--restore" not in w.child.argv:
            continue
        earlier = [
            s
            for o in root.writers.values()
            if o is not w
            for s, t in o.committed.items()
            if t < w.opening
        ]
        if earlier and (restored is None or int(restored.args[0]) < max(earlier)):
            if w.child.killed and restored is None:
                continue  # killed before it restored
            got = restored.args[0] if restored else "nothing"
            result.violations.append(
                f"{w.label} opened after step {max(earlier)} was committed, but restored {got}"
            )


def check_root(root: Root, result: RoundResult) -> None:
    """Invariants 1-3 of the module docstring, with fresh processes and managers."""
    import jaxckpt
    from jaxckpt.commit import CommitProtocol
    from jaxckpt.records import ROOT_RECORD
    from jaxckpt.storage import open_storage

    protocol = CommitProtocol(open_storage(root.uri))
    if protocol.storage.read(ROOT_RECORD) is None and not protocol.storage.list(""):
        return  # every writer died before creating the root
    listing = ls(result, root)
    if listing is None:
        return
    result.hidden_commits += len(listing["fenced"])
    for d in listing["damaged"]:
        result.violations.append(f"step {d['step']} has a damaged marker: {d['marker']}")
    listed = [c["step"] for c in listing["committed"]]
    with jaxckpt.CheckpointManager(root.uri, read_only=True) as reader:
        if reader.steps() != listed:
            result.violations.append(f"steps() {reader.steps()} != ls {listed}")
        for step in listed:
            check_step(root, result, reader, protocol, step)
    check_visibility(root, result, protocol, listed)
    check_newest_writer(root, result, listed)
    # 3. gc with no writer alive leaves exactly the committed steps.
    done = cli(result, "gc", root.uri, "--grace", "0")
    if done is None or done.returncode != 0:
        result.violations.append(f"gc failed: {done.stderr[-2000:] if done else ''}")
        return
    after = ls(result, root)
    if after is None:
        return
    if [c["step"] for c in after["committed"]] != listed:
        result.violations.append(f"gc changed the committed steps: {listed} -> {after}")
    for kind in ("partial", "fenced", "damaged"):
        if after[kind]:
            result.violations.append(f"after gc, ls still shows {kind}: {after[kind]}")
    check_keys(result, protocol)


def check_step(root: Root, result: RoundResult, reader: Any, protocol: Any, step: int) -> None:
    try:
        restored = reader.restore(step)
        report = reader.verify(step)
    except Exception as e:  # any failure to read a listed step is a violation
        result.violations.append(f"listed step {step} does not restore: {type(e).__name__}: {e}")
        return
    if not report.ok:
        result.violations.append(f"listed step {step} fails verify: {report.problems[:3]}")
    kib_of = {s: w.kib for s, w in root.writers.items()}.get
    seed, problems = torture_child.check_restored(restored, step, kib_of)
    result.violations += problems
    marker = protocol.read_marker(step)
    writer = root.writers.get(seed) if seed is not None else None
    if writer is not None and marker is not None and writer.epoch != marker.epoch:
        result.violations.append(
            f"step {step} holds {writer.label}'s data (epoch {writer.epoch}) "
            f"under a marker of epoch {marker.epoch}"
        )
    if not problems and report.ok:
        result.steps_verified += 1


def check_visibility(root: Root, result: RoundResult, protocol: Any, listed: list[int]) -> None:
    """2. No listed step was committed by a writer after a newer one took over."""
    epochs = protocol.epochs.load()
    visible: dict[int, list[int]] = {}
    for ref in protocol.marker_refs():
        if epochs.visible(ref):
            visible.setdefault(ref.step, []).append(ref.epoch)
    for step, seen in visible.items():
        if len(seen) > 1:
            result.violations.append(f"step {step} has {len(seen)} visible markers: epochs {seen}")
    for step in listed:
        marker = protocol.read_marker(step)
        if marker is None:
            continue
        owners = [w for w in root.writers.values() if w.epoch == marker.epoch]
        for w in owners:
            begun = w.marker_begun.get(step)
            if begun is None:
                result.violations.append(
                    f"step {step}: {w.label} (epoch {w.epoch}) never reported beginning its marker"
                )
                continue
            for newer in root.writers.values():
                if (
                    newer.epoch
                    and newer.epoch > marker.epoch
                    and newer.opened
                    and begun > newer.opened
                ):
                    result.violations.append(
                        f"step {step} is listed, but {w.label} (epoch {w.epoch}) began its "
                        f"marker {begun - newer.opened:.3f}s after {newer.label} "
                        f"(epoch {newer.epoch}) took over"
                    )


def check_newest_writer(root: Root, result: RoundResult, listed: list[int]) -> None:
    """The steps the root's newest writer committed are listed (its retention aside)."""
    from jaxckpt.commit import EpochReader
    from jaxckpt.storage import open_storage

    newest = EpochReader(open_storage(root.uri)).newest()
    for w in root.writers.values():
        if w.epoch != newest or w.child is None or w.child.killed or not w.committed:
            continue
        if w.child.proc.returncode != 0:
            continue
        mine = sorted(w.committed)
        keep = _keep_last(w.child.argv)
        expected = mine[-keep:] if keep else mine
        if result.number != w.round:
            expected = mine[-1:]  # later rounds' writers may have deleted the rest
        missing = [s for s in expected if s not in listed]
        if missing:
            result.violations.append(
                f"{w.label} (newest epoch {newest}) committed {missing}, which are not listed"
            )


def check_keys(result: RoundResult, protocol: Any) -> None:
    """Nothing under attempts/, data/, pending/, commits/ that the visible markers do not name."""
    from jaxckpt.records import (
        ATTEMPTS,
        COMMITS,
        DATA,
        LEGACY_STEPS,
        PENDING,
        latest_hint_key,
        parse_data_key,
    )

    markers = protocol.committed()
    # The newest epoch's hint is the only other object gc keeps under commits/.
    named_keys = {m.key for m in markers.values()} | {latest_hint_key(protocol.epochs.newest())}
    prefixes = tuple(m.location.prefix for m in markers.values())
    stray = [k for k in protocol.storage.list(COMMITS) if k not in named_keys]
    stray += protocol.storage.list(PENDING)
    for data in (ATTEMPTS, LEGACY_STEPS):
        stray += [k for k in protocol.storage.list(data) if not k.startswith(prefixes)]
    named = {m.location for m in markers.values()}  # format 4: packs and parts under data/
    stray += [k for k in protocol.storage.list(DATA) if parse_data_key(k) not in named]
    if stray:
        result.violations.append(f"after gc: {len(stray)} stray keys, e.g. {stray[:5]}")


# -- command line tools ----------------------------------------------------------------


def cli(
    result: RoundResult, *args: str, subprocess_: bool = False
) -> subprocess.CompletedProcess[str] | None:
    """``jaxckpt ARGS``: in this process (the checks), or in a new one (an operator)."""
    if not subprocess_:
        import io

        from jaxckpt.cli import main as cli_main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli_main(list(args))
            except Exception as e:  # the CLI turns CheckpointErrors into exit codes
                code, _ = 1, err.write(f"{type(e).__name__}: {e}")
        return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
    argv = [sys.executable, "-m", "jaxckpt", *args]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        result.violations.append(f"`jaxckpt {' '.join(args)}` hung for {CLI_TIMEOUT_S:.0f}s")
        return None


def ls(result: RoundResult, root: Root) -> dict[str, Any] | None:
    done = cli(result, "ls", root.uri, "--json")
    if done is None:
        return None
    if done.returncode != 0:
        result.violations.append(f"jaxckpt ls failed: {done.stderr[-2000:]}")
        return None
    listing: dict[str, Any] = json.loads(done.stdout)
    return listing


def _keep_last(argv: list[str]) -> int | None:
    return int(argv[argv.index("--keep-last") + 1]) if "--keep-last" in argv else None
