"""Torture run: many writers, kills, races and transient faults; invariants after every round.

Usage::

    python scripts/torture.py --minutes 30 [--backends local,s3,gcs] [--seed S] [--json OUT]
    python scripts/torture.py --rounds 11 --seed 1 --json out.json   # the test suite's short run

It starts its own loopback servers (moto for S3, the patched GCS emulator;
``tests/servers.py``) with a fault-injecting proxy in front of each
(``scripts/faultproxy.py``), then runs rounds until the time or round budget
is spent. Every round picks a backend and a scenario (seeded) and starts real
writer processes (``scripts/torture_child.py``) against a root that lives for
a few rounds, so each round starts from what earlier ones left:

* ``kill``: a writer resumes and saves in a loop; it is SIGKILLed at a random
  moment (while opening, restoring, saving, committing or deleting).
* ``zombie``: writer A saves in a loop with retention; a restarted writer B
  opens the same root (fencing A), restores and saves a few steps. A keeps
  going until fenced (or is SIGKILLed at random); half of the fault-free
  rounds run an operator's ``jaxckpt gc`` while B saves, which must neither
  fence B nor touch its in-flight attempt.
* ``race``: two writers save the same step, released at one wall-clock
  instant, either opening together or the second opening while the first saves.
* ``faults``: one writer saves through the proxy at twice the fault rates
  (object stores only). The other scenarios also run through the proxy with
  faults on in about half of the object-store rounds.

After every round, with fresh processes and managers talking to the servers
directly (never through the proxy):

1. every listed step restores bit-exactly (a step's content is a function of
   its writer and step, and names its writer) and ``verify`` passes; the
   marker's epoch is its writer's;
2. nothing a fenced writer committed after the takeover is listed: a listed
   step's marker was begun (``before_marker``, timestamped by the child)
   before any newer writer finished opening; at most one marker per step is
   visible; a restarted writer resumes from at least the newest step committed
   before it opened; the newest writer's committed steps are listed;
3. ``jaxckpt gc --grace 0`` (no writer is alive) leaves the committed set as
   it was and nothing under ``attempts/``, ``pending/`` or ``commits/``
   except what the visible markers name; ``jaxckpt ls`` shows no partial,
   fenced or damaged step.

Also counted as violations: a child that hangs, dies with an exception that is
not a ``CheckpointError``, a zombie that is never fenced, and a failed save of
the newest writer in a fault-free round. The run prints a table (rounds,
kills, faults injected, steps verified, violations) and exits non-zero on any
violation.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))  # servers.py: the suite's loopback servers

import servers  # noqa: E402
import torture_child  # noqa: E402
from faultproxy import FAULT_KINDS, NO_FAULTS, FaultPlan, FaultProxy  # noqa: E402

SCENARIOS = ("kill", "zombie", "race", "faults")
BACKENDS = ("local", "s3", "gcs")
DEFAULT_FAULTS = "error=0.04,reset=0.02,lost=0.02,slow=0.04,slow_s=0.3"
# Short backoff, more attempts: the faults are frequent but brief.
CHILD_STORAGE_OPTIONS = {"max_retries": 8, "initial_delay_s": 0.02, "max_delay_s": 0.5}
START_TIMEOUT_S = 90.0  # a child's start-up (importing jax) on a loaded machine
ROUND_TIMEOUT_S = 240.0  # a writer's whole life
FENCE_TIMEOUT_S = 90.0  # how long a zombie may keep going after the takeover
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


# -- the run -------------------------------------------------------------------------


class Torture:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.workdir = workdir
        self.fault_plan = FaultPlan.parse(args.fault_rates)
        self.servers: dict[str, servers.Server] = {}
        self.proxies: dict[str, FaultProxy] = {}
        self.roots: dict[str, Root] = {}
        self.results: list[RoundResult] = []
        self.next_seed = 1
        self.child_env = self._base_env()

    # -- set-up --------------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            JAX_PLATFORMS="cpu",
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
            PYTHONUNBUFFERED="1",
        )
        return env

    def start_servers(self) -> None:
        logs = self.workdir / "server-logs"
        logs.mkdir(exist_ok=True)
        if "s3" in self.args.backends:
            self.servers["s3"] = servers.start_moto(logs)
            os.environ["AWS_ENDPOINT_URL_S3"] = self.servers["s3"].endpoint
        if "gcs" in self.args.backends:
            self.servers["gcs"] = servers.start_gcs_emulator(logs)
            os.environ["STORAGE_EMULATOR_HOST"] = self.servers["gcs"].endpoint
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = self.servers["gcs"].endpoint
        for i, (name, server) in enumerate(sorted(self.servers.items())):
            self.proxies[name] = FaultProxy(server.endpoint, seed=self.args.seed * 10 + i)

    def close(self) -> None:
        for proxy in self.proxies.values():
            proxy.close()
        for server in self.servers.values():
            server.stop()

    def env_for(self, backend: str) -> dict[str, str]:
        """A writer's environment: object stores through the proxy."""
        env = dict(self.child_env)
        if backend == "s3":
            env["AWS_ENDPOINT_URL_S3"] = self.proxies["s3"].endpoint
        elif backend == "gcs":
            env["STORAGE_EMULATOR_HOST"] = self.proxies["gcs"].endpoint
            env["TENSORSTORE_GCS_HTTP_URL"] = self.proxies["gcs"].endpoint
        return env

    # -- roots -----------------------------------------------------------------------

    def root_for(self, backend: str) -> Root:
        root = self.roots.get(backend)
        if root is not None and root.rounds < self.args.rounds_per_root:
            return root
        if root is not None:
            self.drop_root(root)
        name = f"torture-{uuid.uuid4().hex[:12]}"
        if backend == "local":
            uri = str(self.workdir / "roots" / name)
        else:
            scheme = "s3" if backend == "s3" else "gs"
            uri = f"{scheme}://{servers.BUCKET}/{name}"
        root = Root(backend=backend, uri=uri, kib=self.args.kib)
        self.roots[backend] = root
        return root

    def drop_root(self, root: Root) -> None:
        """Deletes a root that passed its checks (a root with violations is kept)."""
        if root.backend == "local":
            shutil.rmtree(root.uri, ignore_errors=True)
            return
        from jaxckpt._storage import open_storage

        with contextlib.suppress(Exception):
            open_storage(root.uri).delete_prefix("")

    # -- writers -----------------------------------------------------------------------

    def spawn(
        self, root: Root, result: RoundResult, label: str, *args: str, go: bool = False
    ) -> Writer:
        seed = self.next_seed
        self.next_seed += 1
        argv = [
            sys.executable,
            str(HERE / "torture_child.py"),
            root.uri,
            "--seed",
            str(seed),
            "--kib",
            str(root.kib),
            *args,
        ]
        if root.backend != "local":
            argv += ["--storage-options", json.dumps(CHILD_STORAGE_OPTIONS)]
        if go:
            argv.append("--go")
        writer = Writer(seed=seed, label=label, round=result.number, kib=root.kib)
        writer.child = Child(f"{label}(seed {seed})", argv, self.env_for(root.backend))
        root.writers[seed] = writer
        return writer

    def await_event(
        self, result: RoundResult, writer: Writer, name: str, timeout: float = START_TIMEOUT_S
    ) -> Event | None:
        assert writer.child is not None
        event = writer.child.wait_for(name, timeout)
        if event is None and not writer.child.join(5.0):
            result.violations.append(
                f"{writer.label}: no {name} within {timeout:.0f}s (hang?)\n{writer.child.tail()}"
            )
        return event

    def finish(self, result: RoundResult, writer: Writer, timeout: float) -> None:
        """Waits for a writer to end (a hang is a violation: it is killed) and reads its events."""
        child = writer.child
        assert child is not None
        if not child.join(timeout):
            result.violations.append(
                f"{writer.label}: still running after {timeout:.0f}s (hang)\n{child.tail()}"
            )
            child.kill()
        writer.absorb()

    def kill(self, result: RoundResult, writer: Writer) -> None:
        assert writer.child is not None
        if writer.child.proc.poll() is None:
            writer.child.kill()
            if writer.child.killed:
                result.kills += 1
        writer.absorb()

    # -- scenarios ---------------------------------------------------------------------

    def scenario_kill(self, root: Root, result: RoundResult) -> list[Writer]:
        keep = self.rng.choice([2, 3, 5])
        args = ["--restore", "--steps", "1000", "--keep-last", str(keep)]
        writer = self.spawn(root, result, "writer", *args)
        window = 1.5 if root.backend == "local" else 4.0
        delay = self.rng.uniform(0.0, window)
        result.variant = f"kill {delay:.2f}s after open"
        if self.await_event(result, writer, "OPENED") is not None:
            time.sleep(delay)
        self.kill(result, writer)
        return [writer]

    def scenario_zombie(self, root: Root, result: RoundResult) -> list[Writer]:
        zombie = self.spawn(
            root, result, "zombie", "--restore", "--steps", "100000", "--keep-last", "2"
        )
        if self.await_event(result, zombie, "COMMITTED") is None:
            self.kill(result, zombie)
            return [zombie]
        time.sleep(self.rng.uniform(0.0, 1.0))
        keep = self.rng.choice([None, 2])
        args = ["--restore", "--steps", str(self.args.restarted_steps)]
        args += ["--keep-last", str(keep)] if keep else []
        restarted = self.spawn(root, result, "restarted", *args)
        operator_gc = not result.faulty and self.rng.random() < 0.5
        kill_zombie = self.rng.random() < 0.3
        result.variant = (
            "zombie"
            + (" + operator gc" if operator_gc else "")
            + (" + zombie killed" if kill_zombie else "")
        )
        if self.await_event(result, restarted, "OPENED") is not None:
            if operator_gc:
                self.await_event(result, restarted, "SAVING", timeout=60.0)
                self.operator_gc(root, result)
            if kill_zombie:
                time.sleep(self.rng.uniform(0.0, 1.0))
                self.kill(result, zombie)
        self.finish(result, restarted, ROUND_TIMEOUT_S)
        self.finish(result, zombie, FENCE_TIMEOUT_S)
        assert zombie.child is not None
        if not zombie.child.killed and zombie.child.first("FENCED") is None:
            result.violations.append(
                f"the zombie was never fenced (exit {zombie.child.proc.returncode})\n"
                + zombie.child.tail()
            )
        return [zombie, restarted]

    def operator_gc(self, root: Root, result: RoundResult) -> None:
        """An operator's ``jaxckpt gc`` (default grace) while a writer saves."""
        done = self.cli(result, "gc", root.uri, subprocess_=True)
        result.operator_gcs += 1
        if done is not None and done.returncode != 0:
            result.violations.append(f"operator gc failed: {done.stderr[-2000:]}")

    def scenario_race(self, root: Root, result: RoundResult) -> list[Writer]:
        steps = self.rng.choice([1, 2])
        start = self.latest(root) + 1
        args = ["--start", str(start), "--steps", str(steps)]
        a = self.spawn(root, result, "racer-1", *args, go=True)
        b = self.spawn(root, result, "racer-2", *args, go=True)
        ready = [self.await_event(result, w, "READY") for w in (a, b)]
        staggered = self.rng.random() < 0.5
        result.variant = f"race on {steps} step(s), " + (
            "staggered open" if staggered else "together"
        )
        if all(ready):
            assert a.child is not None and b.child is not None
            now = time.time()
            save_at = now + (0.8 if root.backend == "local" else 2.0)
            if staggered:
                a.child.send(f"GO {now + 0.2:.6f} {save_at:.6f}")
                b.child.send(f"GO {save_at + self.rng.uniform(0.0, 0.6):.6f} 0")
            else:
                for w in (a, b):
                    w.child.send(f"GO {now + 0.2:.6f} {save_at:.6f}")  # type: ignore[union-attr]
        for w in (a, b):
            self.finish(result, w, ROUND_TIMEOUT_S)
        tried = [set(w.child.steps("SAVING")) for w in (a, b) if w.child is not None]
        result.contested_steps += len(set.intersection(*tried)) if len(tried) == 2 else 0
        return [a, b]

    def scenario_faults(self, root: Root, result: RoundResult) -> list[Writer]:
        result.variant = "one writer, faults x2"
        writer = self.spawn(root, result, "writer", "--restore", "--steps", "4", "--keep-last", "3")
        self.finish(result, writer, ROUND_TIMEOUT_S)
        return [writer]

    # -- one round -------------------------------------------------------------------------

    def run_round(self, number: int, backend: str, scenario: str, faulty: bool) -> RoundResult:
        t0 = time.monotonic()
        root = self.root_for(backend)
        root.rounds += 1
        result = RoundResult(number=number, backend=backend, scenario=scenario, faulty=faulty)
        proxy = self.proxies.get(backend)
        before = proxy.snapshot() if proxy else Counter()
        if proxy is not None:
            plan = self.fault_plan.scaled(2.0) if scenario == "faults" else self.fault_plan
            proxy.plan = plan if faulty else NO_FAULTS
        try:
            writers = getattr(self, f"scenario_{scenario}")(root, result)
        finally:
            if proxy is not None:
                proxy.plan = NO_FAULTS
        for w in writers:  # nothing may outlive the round
            if w.child is not None and w.child.proc.poll() is None:
                self.kill(result, w)
        if proxy is not None:
            after = proxy.snapshot()
            result.faults = Counter(
                {k: after[k] - before[k] for k in FAULT_KINDS if after[k] > before[k]}
            )
        self.check_writers(root, result, writers)
        self.check_root(root, result)
        result.seconds = time.monotonic() - t0
        if result.violations:
            root.rounds = self.args.rounds_per_root  # keep it for a post-mortem; start a new one
            self.roots.pop(backend, None)
            result.notes.append(f"root kept for inspection: {root.uri}")
        return result

    # -- checks ------------------------------------------------------------------------------

    def check_writers(self, root: Root, result: RoundResult, writers: list[Writer]) -> None:
        """What the writers' own output must show."""
        from jaxckpt._fence import EpochReader
        from jaxckpt._storage import open_storage

        newest_epoch = EpochReader(open_storage(root.uri)).newest()
        for w in writers:
            child = w.child
            assert child is not None
            w.absorb()
            for e in child.all("ERROR"):
                result.violations.append(
                    f"{w.label}: died with a non-CheckpointError: {' '.join(e.args)}\n"
                    + child.tail()
                )
            for e in child.all("RESTORED"):
                if e.args[2:3] != ["ok"]:
                    result.violations.append(
                        f"{w.label}: restored a wrong state: {' '.join(e.args)}"
                    )
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

    def check_root(self, root: Root, result: RoundResult) -> None:
        """Invariants 1-3 of the module docstring, with fresh processes and managers."""
        import jaxckpt
        from jaxckpt._commit import CommitProtocol
        from jaxckpt._storage import open_storage

        protocol = CommitProtocol(open_storage(root.uri))
        if protocol.storage.read("jaxckpt.json") is None and not protocol.storage.list(""):
            return  # every writer died before creating the root
        listing = self.ls(result, root)
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
                self.check_step(root, result, reader, protocol, step)
        self.check_visibility(root, result, protocol, listed)
        self.check_newest_writer(root, result, listed)
        # 3. gc with no writer alive leaves exactly the committed steps.
        done = self.cli(result, "gc", root.uri, "--grace", "0")
        if done is None or done.returncode != 0:
            result.violations.append(f"gc failed: {done.stderr[-2000:] if done else ''}")
            return
        after = self.ls(result, root)
        if after is None:
            return
        if [c["step"] for c in after["committed"]] != listed:
            result.violations.append(f"gc changed the committed steps: {listed} -> {after}")
        for kind in ("partial", "fenced", "damaged"):
            if after[kind]:
                result.violations.append(f"after gc, ls still shows {kind}: {after[kind]}")
        self.check_keys(result, protocol)

    def check_step(
        self, root: Root, result: RoundResult, reader: Any, protocol: Any, step: int
    ) -> None:
        try:
            restored = reader.restore(step)
            report = reader.verify(step)
        except Exception as e:  # any failure to read a listed step is a violation
            result.violations.append(
                f"listed step {step} does not restore: {type(e).__name__}: {e}"
            )
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

    def check_visibility(
        self, root: Root, result: RoundResult, protocol: Any, listed: list[int]
    ) -> None:
        """2. No listed step was committed by a writer after a newer one took over."""
        epochs = protocol.epochs.load()
        visible: dict[int, list[int]] = {}
        for ref in protocol.marker_refs():
            if epochs.visible(ref):
                visible.setdefault(ref.step, []).append(ref.epoch)
        for step, seen in visible.items():
            if len(seen) > 1:
                result.violations.append(
                    f"step {step} has {len(seen)} visible markers: epochs {seen}"
                )
        for step in listed:
            marker = protocol.read_marker(step)
            if marker is None:
                continue
            owners = [w for w in root.writers.values() if w.epoch == marker.epoch]
            for w in owners:
                begun = w.marker_begun.get(step)
                if begun is None:
                    result.violations.append(
                        f"step {step}: {w.label} (epoch {w.epoch}) never reported "
                        "beginning its marker"
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

    def check_newest_writer(self, root: Root, result: RoundResult, listed: list[int]) -> None:
        """The steps the root's newest writer committed are listed (its retention aside)."""
        from jaxckpt._fence import EpochReader
        from jaxckpt._storage import open_storage

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

    def check_keys(self, result: RoundResult, protocol: Any) -> None:
        """Nothing under attempts/, pending/, commits/ that the visible markers do not name."""
        from jaxckpt._layout import ATTEMPTS, COMMITS, LEGACY_STEPS, PENDING

        markers = protocol.committed()
        named_keys = {m.key for m in markers.values()}
        prefixes = tuple(m.location.prefix for m in markers.values())
        stray = [k for k in protocol.storage.list(COMMITS) if k not in named_keys]
        stray += protocol.storage.list(PENDING)
        for data in (ATTEMPTS, LEGACY_STEPS):
            stray += [k for k in protocol.storage.list(data) if not k.startswith(prefixes)]
        if stray:
            result.violations.append(f"after gc: {len(stray)} stray keys, e.g. {stray[:5]}")

    # -- command line tools ----------------------------------------------------------------

    def cli(
        self, result: RoundResult, *args: str, subprocess_: bool = False
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

    def ls(self, result: RoundResult, root: Root) -> dict[str, Any] | None:
        done = self.cli(result, "ls", root.uri, "--json")
        if done is None:
            return None
        if done.returncode != 0:
            result.violations.append(f"jaxckpt ls failed: {done.stderr[-2000:]}")
            return None
        listing: dict[str, Any] = json.loads(done.stdout)
        return listing

    def latest(self, root: Root) -> int:
        from jaxckpt._commit import CommitProtocol
        from jaxckpt._storage import open_storage

        protocol = CommitProtocol(open_storage(root.uri))
        with contextlib.suppress(Exception):
            marker = protocol.latest()
            return marker.step if marker else 0
        return 0

    # -- schedule ------------------------------------------------------------------------------

    def schedule(self) -> Iterator[tuple[str, str, bool]]:
        """Every (backend, scenario) once, faults alternating on object stores; then at random."""
        first = [
            (b, s) for b in self.args.backends for s in SCENARIOS if s != "faults" or b != "local"
        ]
        self.rng.shuffle(first)
        flip: dict[str, bool] = {}
        for backend, scenario in first:
            if backend == "local":
                yield backend, scenario, False
            elif scenario == "faults":
                yield backend, scenario, True
            else:
                flip[backend] = not flip.get(backend, False)
                yield backend, scenario, flip[backend]
        while True:
            backend = self.rng.choice(self.args.backends)
            choices = [s for s in SCENARIOS if s != "faults" or backend != "local"]
            weights = [3, 3, 3, 1][: len(choices)]
            scenario = self.rng.choices(choices, weights=weights)[0]
            faulty = backend != "local" and (scenario == "faults" or self.rng.random() < 0.5)
            yield backend, scenario, faulty

    def run(self) -> None:
        deadline = time.monotonic() + self.args.minutes * 60.0
        for number, (backend, scenario, faulty) in enumerate(self.schedule(), start=1):
            if number > self.args.rounds or time.monotonic() >= deadline:
                break
            result = self.run_round(number, backend, scenario, faulty)
            self.results.append(result)
            flag = f"  VIOLATIONS: {len(result.violations)}" if result.violations else ""
            print(
                f"round {number:4d} {backend:5s} {scenario:6s}"
                f"{' +faults' if faulty else '        '} "
                f"{result.seconds:5.1f}s kills={result.kills} faults={sum(result.faults.values())} "
                f"verified={result.steps_verified} fenced={result.fenced_writers} "
                f"hidden={result.hidden_commits}  [{result.variant}]{flag}",
                flush=True,
            )
            for v in result.violations:
                print("  VIOLATION: " + v.replace("\n", "\n    "), flush=True)
            if self.args.verbose:
                for n in result.notes:
                    print("  note: " + n, flush=True)


def _keep_last(argv: list[str]) -> int | None:
    return int(argv[argv.index("--keep-last") + 1]) if "--keep-last" in argv else None


# -- report --------------------------------------------------------------------------------------


def summarize(results: list[RoundResult]) -> dict[str, Any]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        row = rows.setdefault(
            (r.backend, r.scenario),
            {
                "backend": r.backend,
                "scenario": r.scenario,
                "rounds": 0,
                "faulty_rounds": 0,
                "kills": 0,
                "faults": Counter(),
                "steps_verified": 0,
                "fenced_writers": 0,
                "hidden_commits": 0,
                "contested_steps": 0,
                "operator_gcs": 0,
                "save_failures": 0,
                "violations": 0,
                "seconds": 0.0,
            },
        )
        row["rounds"] += 1
        row["faulty_rounds"] += int(r.faulty)
        row["faults"].update(r.faults)
        for key in (
            "kills",
            "steps_verified",
            "fenced_writers",
            "hidden_commits",
            "contested_steps",
            "operator_gcs",
            "save_failures",
            "seconds",
        ):
            row[key] += getattr(r, key)
        row["violations"] += len(r.violations)
    table = [dict(row, faults=dict(row["faults"])) for _, row in sorted(rows.items())]
    totals: dict[str, Any] = {"rounds": len(results)}
    for key in (
        "kills",
        "steps_verified",
        "fenced_writers",
        "hidden_commits",
        "contested_steps",
        "operator_gcs",
        "save_failures",
        "violations",
    ):
        totals[key] = sum(row[key] for row in table)
    totals["faults"] = dict(sum((Counter(row["faults"]) for row in table), Counter()))
    return {"table": table, "totals": totals}


def _faults_text(faults: dict[str, int]) -> str:
    if not faults:
        return "0"
    return f"{sum(faults.values())} ({', '.join(f'{k} {v}' for k, v in sorted(faults.items()))})"


def print_table(summary: dict[str, Any]) -> None:
    header = [
        "backend",
        "scenario",
        "rounds",
        "+faults",
        "kills",
        "faults injected",
        "steps verified",
        "fenced",
        "hidden",
        "violations",
    ]
    lines = [header]
    for row in [*summary["table"], {"backend": "total", "scenario": "", **summary["totals"]}]:
        faults = row["faults"]
        lines.append(
            [
                row["backend"],
                row["scenario"],
                str(row["rounds"]),
                str(row.get("faulty_rounds", "")),
                str(row["kills"]),
                _faults_text(faults),
                str(row["steps_verified"]),
                str(row["fenced_writers"]),
                str(row["hidden_commits"]),
                str(row["violations"]),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--minutes", type=float, default=1.0, help="time budget (default 1)")
    p.add_argument("--rounds", type=int, default=10**9, help="stop after this many rounds")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: local,s3,gcs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--kib", type=float, default=192.0, help="state size per step, KiB")
    p.add_argument("--rounds-per-root", type=int, default=6, help="rounds before a fresh root")
    p.add_argument("--fault-rates", default=DEFAULT_FAULTS, help=f"default {DEFAULT_FAULTS}")
    p.add_argument("--workdir", type=Path, default=None, help="local roots and server logs")
    p.add_argument("--restarted-steps", type=int, default=3, help="steps a restarted writer saves")
    p.add_argument("-v", "--verbose", action="store_true", help="print notes too")
    args = p.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = set(args.backends) - set(BACKENDS)
    if unknown or not args.backends:
        p.error(f"--backends takes a subset of {BACKENDS}, got {args.backends}")
    return args


def _divert_native_stderr(path: Path) -> None:
    """Sends file descriptor 2 (TensorStore's credential-chain chatter) to ``path``.

    Python's ``sys.stderr`` keeps writing to the original stderr.
    """
    original = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    sys.stderr = os.fdopen(original, "w", buffering=1)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    servers.isolate_cloud_env(os.environ, tempfile.gettempdir())
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="jaxckpt-torture-"))
    workdir.mkdir(parents=True, exist_ok=True)
    _divert_native_stderr(workdir / "native-stderr.log")
    torture = Torture(args, workdir)
    started = time.time()
    try:
        torture.start_servers()
        torture.run()
    finally:
        torture.close()
    summary = summarize(torture.results)
    print_table(summary)
    violations = [
        {
            "round": r.number,
            "backend": r.backend,
            "scenario": r.scenario,
            "variant": r.variant,
            "violation": v,
        }
        for r in torture.results
        for v in r.violations
    ]
    if args.json is not None:
        report = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "seconds": time.time() - started,
            **summary,
            "rounds": [
                {**dataclasses.asdict(r), "faults": dict(r.faults)} for r in torture.results
            ],
            "violations": violations,
        }
        args.json.write_text(json.dumps(report, indent=1, default=str))
    if args.workdir is None and not violations:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
