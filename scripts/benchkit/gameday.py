"""``bench.py gameday``: a training job under a seeded failure schedule, with every tier on.

    python scripts/bench.py gameday [--quick | --smoke] [--processes 4] [--mtbf-s 30] [--json OUT]

A real job (``benchkit/gameday_child.py``: N JAX processes on the CPU, a Flax MLP fed
by grain with ``process_state``) saves to a local tier per process with peer replicas
(``local_replicas=2``), and one promoter sidecar per node (``jaxckpt promote --watch``)
promotes every ``--promote-every``-th step to a durable S3 root (moto behind
``scripts/faultproxy.py``). A supervisor restarts the whole job whenever a process
dies, as a scheduler does, until it reaches ``--steps``. The failures come from a seeded
schedule (:func:`schedule`): the gaps between them are exponential with mean
``--mtbf-s`` seconds of training (counted in executed steps at the reference run's
step time, so both contenders meet each failure after the same computation), the kinds
drawn from :data:`KINDS`:

* ``sigkill``: SIGKILL of one process;
* ``node_loss``: SIGKILL of one process and its node's local tier wiped (a replaced node);
* ``preempt``: SIGTERM to every process, SIGKILL after ``--grace-s``;
* ``storm``: every request to the durable root answered ``503 SlowDown`` for ``--storm-s``;
* ``corrupt``: one process's newest local part is damaged where the restore will need
  it (with peers: its only replica, on the next node, and its own node lost; alone:
  its own copy) and the job is killed: the composed case healing must survive;
* ``disk_full``: one process's local tier (a tmpfs when run as root) filled to the
  last byte, freed at the next restart or after ``--storm-s``.

Then the same schedule with Orbax's ``CheckpointManager`` (durable root only, a local
directory since Orbax 0.12.8 cannot write ``s3://``; its defaults but
``save_interval_steps=--promote-every``): a failure's process part (the kill, the
notice) hits it alike; what has no counterpart there (a local tier to wipe, corrupt or
fill, a storm on S3) does nothing. An uninterrupted ``reference`` run gives the data
order, the final parameters and the step time. jaxckpt runs with
``tolerate_failed_saves=3`` (a save that fails does not end the job; one that found the
local disk full makes room there) and ``compilation_cache=True``, and compiles the step
with ``CheckpointManager.compile`` (each process's executable kept in its local tier: a
restart loads it, a lost node compiles again); Orbax with JAX's defaults (no persistent
cache). Every process but 0 waits until process 0's coordination service listens before
it joins (JAX retries an early client after about a second: a race that added 0 or
1.1 s to a start). jaxckpt's modules are
byte-compiled first, as an installed package's are (with ``PYTHONDONTWRITEBYTECODE`` a
checkout's would be compiled again by every process at every start: 0.14 s of CPU each).
moto and the fault proxy stand for a store on other machines: they run at nice 19
(:data:`CLOUD_NICE`), taking the CPU the job leaves; the sidecars run at their default
nice 10, like any node's.

The full size runs ``--schedules 3``: one reference run, then both contenders on the
schedules of seeds ``seed``, ``seed + 1``, ... (the data order stays ``seed``'s). The
top level of ``--json`` holds their mean ``goodput`` and ``baseline_goodput``, every
failure (with its ``schedule``), ``bit_exact`` and ``wrong_data`` of all; ``schedules``
each day as below.

Reported per schedule: ``goodput`` (:func:`goodput`: kept steps at the reference step
time over wall time, less the supervisor's own reads of the tiers after each failure),
``phases`` (:func:`phases`: where the wall time went), ``baseline_goodput``,
``bit_exact`` (final state digest equals the reference's), ``wrong_data`` (steps whose
batch differs from the reference's, any process, any run), ``failures`` (each ``kind``,
``lost_steps``, ``bound_steps``: the steps from the one reached to the newest step some
tier still held intact after the failure, what a restore that takes the newest held step
loses; and ``interval_steps``, the save interval that bound should stay within, see
:func:`interval_steps`).
"""

from __future__ import annotations

import argparse
import compileall
import dataclasses
import itertools
import json
import os
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, TextIO

from benchkit import servers
from benchkit.common import REPO, _progress

CHILD = Path(__file__).resolve().parent / "gameday_child.py"
KINDS = ("sigkill", "node_loss", "preempt", "storm", "corrupt", "disk_full")
TMPFS_BYTES = 64 << 20
RUN_TIMEOUT_S = 600.0
CLOUD_NICE = 19
"""The durable store (moto) and the fault proxy stand for servers on other machines: at
nice 19 they take only the CPU the job leaves (Orbax's durable root is a directory)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    processes: int = 4
    steps: int = 1500
    every: int | None = None  # None: Daly's interval (see local_interval)
    save_cost_s: float = 0.07
    promote_every: int = 20
    replicas: int = 2
    batch: int = 32
    step_sleep: float = 0.1
    mtbf_s: float = 30.0
    mtbf_steps: int | None = None
    failures: int = 12
    kinds: tuple[str, ...] = KINDS
    seed: int = 0
    schedules: int = 1
    storm_s: float = 60.0
    grace_s: float = 20.0
    baseline: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(KINDS)
        if unknown or not self.kinds:
            raise ValueError(f"unknown failure kinds {sorted(unknown)}; choose from {KINDS}")
        if self.processes < 1 or self.steps < 2 or (self.every or 1) < 1 or self.promote_every < 1:
            raise ValueError("processes >= 1, steps >= 2, every and promote_every >= 1")
        if self.schedules < 1:
            raise ValueError("schedules >= 1")


SIZES = {
    "full": {"schedules": 3},
    "quick": {"processes": 2, "steps": 300, "mtbf_s": 8.0, "failures": 6, "storm_s": 15.0},
    "smoke": {
        "processes": 1,
        "steps": 30,
        "mtbf_steps": 9,
        "failures": 2,
        "kinds": ("sigkill", "node_loss"),
        "every": 5,
        "step_sleep": 0.02,
        "storm_s": 3.0,
        "grace_s": 10.0,
    },
}


@dataclasses.dataclass(frozen=True)
class Failure:
    at_step: int  # fires once the job has executed this many steps (all runs together)
    kind: str
    process: int


def schedule(s: Settings, step_s: float, k: int = 0) -> list[Failure]:
    """The ``k``-th seeded failure schedule (seed ``seed + k``): exponential gaps of
    ``mtbf_s`` seconds of training (``mtbf_steps`` steps if set), kinds and victims drawn
    uniformly; only failures that come before the job's last step."""
    rng = random.Random(s.seed + k)
    mean = s.mtbf_steps if s.mtbf_steps is not None else max(1.0, s.mtbf_s / step_s)
    out, at = [], 0
    while len(out) < s.failures:
        at += max(2, round(rng.expovariate(1.0 / mean)))
        if at >= s.steps - 1:
            break
        out.append(Failure(at, rng.choice(s.kinds), rng.randrange(s.processes)))
    return out


def local_interval(s: Settings, step_s: float) -> int:
    """The steps between two local saves: ``every`` if set, else Daly's optimum
    (``jaxckpt.policy.daly_interval``) for a save that costs the training ``save_cost_s``
    and the schedule's mean time between failures, rounded down to a divisor of
    ``promote_every`` (each promoted step is a saved one), at least 1. ``save_cost_s``
    is what ``--failures 0`` measures (``measured_save_cost_s``: the step time's excess
    over the reference run's, per save)."""
    if s.every is not None:
        return s.every
    from jaxckpt.policy import daly_interval

    mtbf_s = s.mtbf_s if s.mtbf_steps is None else s.mtbf_steps * step_s
    best = daly_interval(s.save_cost_s, mtbf_s) / step_s
    return max(d for d in range(1, s.promote_every + 1) if s.promote_every % d == 0 and d <= best)


def interval_steps(kind: str, s: Settings) -> int:
    """The save interval behind a failure's bound, for the report: one local save
    interval while any tier holds the newest saved step (plus what a save in flight at
    the failure had not committed: the exact bound, ``bound_steps``, is measured from
    the tiers after each failure, see ``Day.newest_held``). A ``storm`` restarts nothing
    (0). A ``corrupt`` part destroys the newest step's only other copy, so the one
    before it is the newest any tier holds (two intervals). A lost node without peers
    leaves only the durable root (one promotion interval)."""
    if kind == "storm":
        return 0
    peers = s.processes > 1 and s.replicas > 1
    every = s.every or 1
    if kind == "corrupt":
        return 2 * every
    if kind == "node_loss" and not peers:
        return s.promote_every
    return every


def goodput(day: dict[str, Any], step_s: float, steps: int) -> dict[str, Any]:
    """Goodput from the supervisor's records of one contender's day: the kept progress
    (``steps`` at the reference run's ``step_s``) over the wall time, with each restart's
    restored step, reached step and lost steps. The one place to swap for
    ``jaxckpt.report(root)`` once the run ledger records the same events."""
    runs = day["runs"]
    restarts = []
    for prev, run in itertools.pairwise(runs):
        restored = run["restored"] or 0
        restarts.append(
            {
                "restored_step": restored,
                "reached_step": prev["reached"],
                "lost_steps": max(0, prev["reached"] - restored),
                "bound_steps": (
                    max(0, prev["reached"] - prev["held"]) if prev.get("held") is not None else None
                ),
                "tier": run["tier"],
                "failure": prev["ended_by"],
            }
        )
    wall = day["wall_s"]
    return {
        "goodput": steps * step_s / wall if wall > 0 and day["finished"] else 0.0,
        "wall_s": wall,
        "restarts": restarts,
        "lost_steps": sum(r["lost_steps"] for r in restarts),
        "startup_s": sum(r.get("startup_s", 0.0) for r in runs),
        "phases": phases(runs),
    }


def phases(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Where the wall time went, summed over the runs (seconds): ``startup`` (launch to the
    first step, or to the end of a run that never trained), ``training`` (first to last
    step), ``ending`` (last step to the run's end: a kill, a preemption's save and exit),
    ``between`` (a run's end to the next launch: the supervisor applying the failure,
    less its own reads of the tiers after it, which the day's wall leaves out too); and
    ``step_s``, the mean time of a trained step."""
    out = dict.fromkeys(("startup", "training", "ending", "between"), 0.0)
    steps = 0
    for prev, run in itertools.pairwise([None, *runs]):
        if prev is not None and "ended_t" in prev and "launched_t" in run:
            out["between"] += run["launched_t"] - prev["ended_t"] - prev.get("measured_s", 0.0)
        if "first_step_t" in run:
            out["startup"] += run["first_step_t"] - run["launched_t"]
            out["training"] += run["last_step_t"] - run["first_step_t"]
            out["ending"] += run["ended_t"] - run["last_step_t"]
            steps += max(0, run["steps"] - 1)
        elif "ended_t" in run:  # it never trained: all of it was starting
            out["startup"] += run["ended_t"] - run["launched_t"]
    out["step_s"] = out["training"] / steps if steps else 0.0
    return out


# ----------------------------------------------------------------------- the job


class Job:
    """One start of the N-process job: its processes and their events, in one queue."""

    def __init__(self, argv: list[str], n: int, env: dict[str, str], logs: Path, tag: str) -> None:
        port = servers.free_port()
        self.events: queue.Queue[tuple[int, list[str] | None]] = queue.Queue()
        self.procs: list[subprocess.Popen[str]] = []
        self.logs = [logs / f"{tag}-{i}.log" for i in range(n)]
        for i in range(n):
            log = open(self.logs[i], "ab")  # noqa: SIM115 (closed by the child's end)
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(CHILD),
                    *argv,
                    f"--num-processes={n}",
                    f"--process-id={i}",
                    f"--coordinator=127.0.0.1:{port}",
                ],
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env={**env, "JAXCKPT_NODE_ID": f"node{i}"},  # one node per process
                text=True,
            )
            log.close()
            self.procs.append(proc)
            assert proc.stdout is not None
            events = logs / f"{tag}-{i}.events"  # the timeline, kept with --keep
            threading.Thread(target=self._read, args=(i, proc.stdout, events), daemon=True).start()
        self.open = n

    def _read(self, i: int, stream: TextIO, events: Path) -> None:
        with events.open("w") as kept:  # every step's time: where a run slowed down
            for line in stream:
                words = line.split()
                if words[:1] == ["EV"] and line.endswith("\n"):  # not a line torn by a kill
                    kept.write(line)
                    self.events.put((i, words[1:]))
        self.events.put((i, None))

    def signal(self, sig: int, process: int | None = None) -> None:
        for i, p in enumerate(self.procs):
            if (process is None or i == process) and p.poll() is None:
                p.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=30)


class Day:
    """One contender's game day: the job restarted until done, the schedule applied."""

    def __init__(
        self, contender: str, s: Settings, work: Path, env: dict[str, str], durable: str
    ) -> None:
        self.contender, self.s, self.work, self.env = contender, s, work, env
        self.durable = durable
        self.local = work / "node"
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.crcs: dict[tuple[int, int], str] = {}
        self.wrong: set[tuple[int, int]] = set()
        self.runs: list[dict[str, Any]] = []
        self.fired: list[dict[str, Any]] = []
        self.digest: str | None = None
        self.executed = 0
        self.step_times: list[float] = []
        self.sidecars: dict[int, subprocess.Popen[bytes]] = {}
        self.mounts: list[Path] = []
        self.proxy: Any = None
        self.storm_until = 0.0
        self.fillers: list[tuple[Path, float]] = []
        self.damaged: set[tuple[int, int]] = set()
        self.measured_s = 0.0  # the supervisor's own reads of the tiers, left out of the wall

    def argv(self) -> list[str]:
        s = self.s
        return [
            f"--contender={self.contender}",
            f"--durable={self.durable}",
            f"--local={self.local}",
            f"--steps={s.steps}",
            f"--every={s.every or s.promote_every}",  # resolved before any contender runs
            f"--promote-every={s.promote_every}",
            f"--replicas={s.replicas}",
            f"--batch={s.batch}",
            f"--seed={s.seed}",
            f"--step-sleep={s.step_sleep}",
        ]

    # -- nodes: local tiers (tmpfs when root) and promoter sidecars ------------

    def prepare_nodes(self) -> None:
        if self.contender != "jaxckpt":
            return
        for i in range(self.s.processes):
            node = Path(f"{self.local}{i}")
            node.mkdir(parents=True, exist_ok=True)
            if os.geteuid() == 0 and "disk_full" in self.s.kinds:
                size = f"size={TMPFS_BYTES}"
                subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(node)], check=True)
                self.mounts.append(node)
            self.start_sidecar(i)

    def start_sidecar(self, i: int) -> None:
        if self.contender != "jaxckpt":
            return
        argv = [sys.executable, "-m", "jaxckpt", "promote", f"{self.local}{i}", self.durable]
        argv += ["--watch", "--interval", "1", "--parts-timeout", "120"]
        with open(self.logs / f"promoter-{i}.log", "ab") as log:
            self.sidecars[i] = subprocess.Popen(argv, stdout=log, stderr=log, env=self.env)

    def stop_sidecar(self, i: int, sig: int = signal.SIGTERM) -> None:
        proc = self.sidecars.pop(i, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def close(self) -> None:
        for proc in self.sidecars.values():  # all at once, as a scheduler stops its pods
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for i in list(self.sidecars):
            self.stop_sidecar(i)
        self.free_disks()
        for node in self.mounts:
            subprocess.run(["umount", "-l", str(node)], check=False)

    def wipe(self, i: int) -> None:
        """A replaced node: its local tier is empty (its promoter restarts with it)."""
        self.stop_sidecar(i, signal.SIGKILL)
        node = Path(f"{self.local}{i}")
        for child in node.iterdir() if node.exists() else ():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        self.start_sidecar(i)

    def fill_disk(self, i: int) -> None:
        node = Path(f"{self.local}{i}")
        filler = node / "filler.bin"
        free = shutil.disk_usage(node).free
        if node not in self.mounts:
            _progress(f"  disk_full on {node}: not a tmpfs (not root), nothing filled")
            return
        try:
            with open(filler, "wb") as f:
                f.write(b"\0" * free)
        except OSError:
            pass  # full: what was meant
        self.fillers.append((filler, time.monotonic() + self.s.storm_s))

    def free_disks(self, now: float | None = None) -> None:
        keep = []
        for filler, until in self.fillers:
            if now is None or now >= until:
                filler.unlink(missing_ok=True)
            else:
                keep.append((filler, until))
        self.fillers = keep

    def corrupt(self, i: int, above: int) -> None:
        """Damages process ``i``'s newest part where a restore needs it: its replica on
        the next node (then its own node is lost), or alone its own copy. Only a step
        saved by the run that just died (newer than ``above``, the step it restored):
        an older one is a second fault on a step already found damaged."""
        from jaxckpt.commit import CommitProtocol
        from jaxckpt.storage import open_storage

        own = open_storage(f"{self.local}{i}")
        steps = sorted(CommitProtocol(own).visible_refs())
        if not steps:
            return
        fresh = [step for step in steps if (step, i) not in self.damaged and step > above]
        peers = self.s.processes > 1 and self.s.replicas > 1
        if not fresh:
            if peers:
                self.wipe(i)
            return
        newest = fresh[-1]
        self.damaged.add((newest, i))  # flipping it again would mend it
        if peers:
            holder = open_storage(f"{self.local}{(i + 1) % self.s.processes}")
            keys = holder.list(f"replicas/{newest:012d}/{i}/")
        else:
            holder = own
            keys = [k for k in own.list("data/") if f"/{newest}.e" in k]
        damaged = [k for k in keys if "/packs/" in k or "/arrays/" in k][:1]
        for key in damaged:
            data = bytearray(holder.read(key) or b"")
            if data:
                data[len(data) // 2] ^= 0xFF
                holder.write(key, bytes(data))
        if peers:
            self.wipe(i)

    # -- the day ------------------------------------------------------------------

    def run(self, failures: list[Failure]) -> dict[str, Any]:
        started = time.monotonic()
        self.prepare_nodes()
        pending = list(failures)
        try:
            while True:
                run = self.one_run(pending, len(self.runs))
                self.runs.append(run)
                _progress(
                    f"  {self.contender} run {len(self.runs)}: restored {run['restored']} "
                    f"({run['tier']}), reached {run['reached']}, ended by {run['ended_by']}"
                )
                if run["ended_by"] == "done":
                    break
                if len(self.runs) >= 3 and all(r["reached"] == 0 for r in self.runs[-3:]):
                    raise RuntimeError(
                        f"{self.contender}: three runs in a row trained no step "
                        f"({run['ended_by']}); logs in {self.logs}"
                    )
                if time.monotonic() - started > self.s.steps * 10 + 900:
                    raise RuntimeError(
                        f"{self.contender}: the day ran too long; logs in {self.logs}"
                    )
                self.free_disks()
        finally:
            self.close()
        return {
            "contender": self.contender,
            "wall_s": time.monotonic() - started - self.measured_s,
            "finished": self.runs[-1]["ended_by"] == "done",
            "runs": self.runs,
            "fired": self.fired,
            "digest": self.digest,
            "crcs": self.crcs,
            "wrong": sorted(self.wrong),
        }

    def one_run(self, pending: list[Failure], index: int) -> dict[str, Any]:
        s = self.s
        job = Job(self.argv(), s.processes, self.env, self.logs, f"{self.contender}-{index}")
        run: dict[str, Any] = {"restored": None, "tier": None, "reached": 0, "ended_by": None}
        launched = time.time()
        deadline = time.monotonic() + RUN_TIMEOUT_S
        training = False
        killed_for: str | None = None
        done = 0
        try:
            while job.open:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a run of {self.contender} hangs; logs in {self.logs}")
                self.end_storm()
                self.free_disks(time.monotonic())
                try:
                    i, words = job.events.get(timeout=0.5)
                except queue.Empty:
                    continue
                if words is None:
                    job.open -= 1
                    rc = job.procs[i].wait(timeout=30)
                    if rc != 0 and killed_for is None:
                        killed_for = f"crash (process {i} exited {rc})"
                        job.kill()
                        run["crash_log"] = _tail(job.logs[i], CRASH_LINES)  # kept in --json
                        _progress(f"  {killed_for}; its log ends:\n" + run["crash_log"])
                    continue
                what = words[1]
                if what == "RESTORED" and i == 0:
                    run["restored"], run["tier"] = int(words[2]), words[3]
                elif what == "FRESH" and i == 0:
                    run["restored"], run["tier"] = 0, "fresh"
                elif what == "STEP" and len(words) == 4:  # whole (a kill may tear one)
                    step, crc = int(words[2]), words[3]
                    self.check_data(i, step, crc)
                    if i == 0:
                        if not training:
                            run["startup_s"] = float(words[0]) - launched
                        training = True
                        run["reached"] = max(run["reached"], step)
                        run["steps"] = run.get("steps", 0) + 1
                        run["first_step_t"] = run.get("first_step_t", float(words[0]))
                        run["last_step_t"] = float(words[0])
                        self.executed += 1
                        self.step_times.append(float(words[0]))
                elif what == "DONE":
                    done += 1
                    if i == 0:
                        self.digest = words[3]
                if (
                    training
                    and pending
                    and killed_for is None
                    and self.executed >= pending[0].at_step
                ):
                    failure = pending.pop(0)
                    killed_for = self.fire(failure, job, run)
        finally:
            if any(p.poll() is None for p in job.procs):
                job.kill()
        run["launched_t"], run["ended_t"] = launched, time.time()
        run["ended_by"] = "done" if done == s.processes and killed_for is None else killed_for
        if run["ended_by"] is None:
            run["ended_by"] = "exit"
        self.after(run)
        return run

    def fire(self, f: Failure, job: Job, run: dict[str, Any]) -> str | None:
        """Applies a failure; what ended the run (None: it goes on)."""
        record = {"kind": f.kind, "process": f.process, "at_reached": run["reached"]}
        self.fired.append(record)
        _progress(f"  {self.contender}: {f.kind} of process {f.process} at step {run['reached']}")
        jaxckpt = self.contender == "jaxckpt"
        if f.kind == "storm":
            if jaxckpt and self.proxy is not None:
                import faultproxy

                self.proxy.plan = faultproxy.FaultPlan(throttle=1.0)
                self.storm_until = time.monotonic() + self.s.storm_s
            return None
        if f.kind == "disk_full":
            if jaxckpt:
                self.fill_disk(f.process)
            return None
        if f.kind == "preempt":
            job.signal(signal.SIGTERM)
            end = time.monotonic() + self.s.grace_s
            while time.monotonic() < end and any(p.poll() is None for p in job.procs):
                time.sleep(0.1)
            record["exit_codes"] = [p.poll() for p in job.procs]  # None: killed after grace
            job.kill()
            record["pending_action"] = None
            return "preempt"
        job.kill()  # sigkill, node_loss, corrupt: the scheduler restarts the whole job
        record["pending_action"] = f.kind if jaxckpt else None
        return f.kind

    def end_storm(self) -> None:
        if self.storm_until and time.monotonic() >= self.storm_until:
            import faultproxy

            self.proxy.plan = faultproxy.NO_FAULTS
            self.storm_until = 0.0

    def after(self, run: dict[str, Any]) -> None:
        """What the failure did to the nodes, applied before the restart; a crash ends
        a disk-full (the node is replaced, its disk freed). Then the newest step some
        tier still holds intact, which bounds what the restart may lose."""
        last = self.fired[-1] if self.fired else {}
        action = last.pop("pending_action", None)
        if action == "node_loss":
            self.wipe(last["process"])
        elif action == "corrupt":
            self.corrupt(last["process"], run["restored"] or 0)
        if run["ended_by"] and run["ended_by"].startswith("crash"):
            self.free_disks()
        if run["ended_by"] != "done" and self.contender == "jaxckpt":
            start = time.monotonic()  # the benchmark's own measurement: not the job's time
            run["held"] = self.newest_held()
            run["measured_s"] = time.monotonic() - start
            self.measured_s += run["measured_s"]

    def newest_held(self) -> int:
        """The newest step every process's part of which some tier holds intact: its own
        local root, a replica on a peer, or the durable root (0: none)."""
        from jaxckpt.commit import CommitProtocol
        from jaxckpt.records import REPLICAS, parse_replica_index_key
        from jaxckpt.storage import open_storage

        n = self.s.processes
        parts: dict[int, set[int]] = {}
        for p in range(n):
            node = Path(f"{self.local}{p}")
            if not (node / "jaxckpt.json").exists():
                continue
            storage = open_storage(str(node))
            for step in CommitProtocol(storage).visible_refs():
                if (step, p) not in self.damaged:
                    parts.setdefault(step, set()).add(p)
            for key in storage.list(REPLICAS):
                held = parse_replica_index_key(key)
                if held is not None and (held[0], held[1]) not in self.damaged:
                    parts.setdefault(held[0], set()).add(held[1])
        steps = {step for step, ps in parts.items() if len(ps) == n}
        try:
            steps |= set(CommitProtocol(open_storage(self.durable)).visible_refs())
        except Exception as e:  # a root not created yet
            _progress(f"  (durable root not listed: {e})")
        return max(steps, default=0)

    def check_data(self, process: int, step: int, crc: str) -> None:
        key = (process, step)
        if key in self.crcs and self.crcs[key] != crc:
            self.wrong.add(key)
        self.crcs.setdefault(key, crc)


# ----------------------------------------------------------------------- report


def assess(day: dict[str, Any], ref: dict[str, Any], s: Settings, step_s: float) -> dict[str, Any]:
    g = goodput(day, step_s, s.steps)
    wrong = set(map(tuple, day["wrong"]))
    wrong |= {k for k, crc in day["crcs"].items() if ref["crcs"].get(k, crc) != crc}
    failures = []
    restarting = [f for f in day["fired"] if f["kind"] not in ("storm", "disk_full")]
    for f in day["fired"]:  # a storm or a full disk restarts nothing by itself
        if f["kind"] in ("storm", "disk_full"):
            failures.append(_failure(f["kind"], f["process"], f["at_reached"], 0, 0, s))
    for r in g["restarts"]:  # each restart, after the failure that ended its run
        if restarting and r["failure"] == restarting[0]["kind"]:
            f = restarting.pop(0)
            kind, process, at = f["kind"], f["process"], f["at_reached"]
        else:  # not scheduled: a crash the day found
            kind, process, at = f"unplanned: {r['failure']}", None, r["reached_step"]
        failures.append(_failure(kind, process, at, r["lost_steps"], r["bound_steps"], s))
    failures.sort(key=lambda f: f["at_step"])
    return {
        "goodput": g["goodput"],
        "wall_s": g["wall_s"],
        "startup_s": g["startup_s"],
        "phases": g["phases"],
        "restarts": g["restarts"],
        "bit_exact": day["digest"] is not None and day["digest"] == ref["digest"],
        "wrong_data": len(wrong),
        "failures": failures,
        "crash_logs": [r["crash_log"] for r in day["runs"] if "crash_log" in r],
    }


CRASH_LINES = 40
"""The lines of a crashed process's log the day keeps (the full run keeps no logs)."""


def _tail(path: Path, lines: int) -> str:
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
        return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")


def _failure(
    kind: str, process: int | None, at: int, lost: int, bound: int | None, s: Settings
) -> dict[str, Any]:
    interval = interval_steps(kind, s) if kind in KINDS else s.every or 1
    return {
        "kind": kind,
        "process": process,
        "at_step": at,
        "lost_steps": lost,
        "bound_steps": bound,
        "interval_steps": interval,
    }


def render(result: dict[str, Any]) -> str:
    settings, days = result["settings"], result["schedules"]
    lines = [
        f"game day: {settings['processes']} processes, {settings['steps']} steps, reference "
        f"step {result['step_s'] * 1000:.0f} ms, {len(days)} failure schedule(s)",
        f"goodput {result['goodput']:.3f} (Orbax baseline {_num(result['baseline_goodput'])})"
        + (" on average" if len(days) > 1 else "")
        + f", bit-exact {result['bit_exact']}, wrong data {result['wrong_data']}",
    ]
    for day in days:
        lines += render_day(day, settings)
    return "\n".join(lines)


def render_day(result: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """One schedule's day: its failures against their bounds, both contenders' phases."""
    lines = [
        f"schedule of seed {result['seed']}: goodput {result['goodput']:.3f} (Orbax "
        f"{_num(result['baseline_goodput'])})",
        "| kind | process | at step | lost steps | bound | interval | within |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in result["failures"]:
        ok = f["bound_steps"] is not None and f["lost_steps"] <= f["bound_steps"]
        lines.append(
            f"| {f['kind']} | {f['process']} | {f['at_step']} | {f['lost_steps']} | "
            f"{f['bound_steps']} | {f['interval_steps']} | {'yes' if ok else 'NO'} |"
        )
    if result.get("baseline"):
        b = result["baseline"]
        lost = ", ".join(str(f["lost_steps"]) for f in b["failures"])
        lines.append(
            f"Orbax: lost steps per failure {lost}; bit-exact {b['bit_exact']}, "
            f"wrong data {b['wrong_data']}, wall {b['wall_s']:.0f} s ({_phases(b)}; "
            f"a save every {settings['promote_every']} steps cost "
            f"{b['measured_save_cost_s'] * 1000:.0f} ms)"
        )
    lines.append(
        f"jaxckpt: wall {result['wall_s']:.0f} s ({_phases(result)}; a save every "
        f"{settings['every']} steps cost {result['measured_save_cost_s'] * 1000:.0f} ms)"
    )
    if (led := result.get("ledger")) is not None:
        told = (
            f"error {led['error']}"
            if "error" in led
            else f"goodput {led['goodput']:.3f} over {led['wall_s']:.0f} s, lost steps per "
            f"restart {led['lost_steps']}, compiles {led['compile']}"
        )
        lines.append(f"jaxckpt report of the durable root: {told}")
    return lines


def ledger_view(root: str, plot_to: Path | None) -> dict[str, Any]:
    """jaxckpt's day as its run ledger tells it (``jaxckpt.report``), beside the supervisor's
    records; with ``plot_to`` (``.png``, ``.html``) its timeline. A SIGKILL loses the
    reached steps the ledger had not flushed yet (``ledger_flush_s``), so its lost steps
    are at most the supervisor's."""
    import jaxckpt
    from jaxckpt.ledger import plot

    try:
        r = jaxckpt.report(root)
    except jaxckpt.CheckpointError as e:
        return {"error": str(e)}
    if plot_to is not None:
        plot(r, str(plot_to))
    return {
        "goodput": r.goodput,
        "wall_s": r.wall_s,
        "badput_s": dataclasses.asdict(r.badput_s),
        "lost_steps": [x.lost_steps for x in r.restarts],
        "tiers": [x.tier for x in r.restarts],
        "compile": [x.compile for x in r.restarts],
        "plot": None if plot_to is None else str(plot_to),
    }


def _phases(result: dict[str, Any]) -> str:
    p = result["phases"]
    return (
        f"startups {p['startup']:.0f} s, training {p['training']:.0f} s at "
        f"{p['step_s'] * 1000:.0f} ms a step, endings {p['ending']:.0f} s, "
        f"between runs {p['between']:.0f} s"
    )


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def parse_args(argv: list[str]) -> tuple[Settings, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="bench.py gameday", description=__doc__.split("\n\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="2 processes, ~6 failures (minutes)")
    size.add_argument("--smoke", action="store_true", help="1 process, 2 failures (the suite's)")
    p.add_argument("--processes", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--mtbf-s", type=float)
    p.add_argument("--mtbf-steps", type=int)
    p.add_argument("--failures", type=int)
    p.add_argument("--kinds", help=f"comma-separated, of {','.join(KINDS)}")
    p.add_argument("--seed", type=int, help="the data order's; schedule k's is seed + k")
    p.add_argument("--schedules", type=int, help="failure schedules, each run by both (full: 3)")
    p.add_argument("--storm-s", type=float)
    p.add_argument("--step-sleep", type=float)
    p.add_argument("--no-baseline", action="store_true", help="skip the Orbax run")
    p.add_argument("--json", type=Path, help="write the result here ('-': stdout)")
    p.add_argument("--plot", type=Path, help="jaxckpt's day as `jaxckpt report --plot` draws it")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (logs)")
    args = p.parse_args(argv)
    chosen: dict[str, Any] = dict(
        SIZES["quick" if args.quick else "smoke" if args.smoke else "full"]
    )
    for name in (
        "processes",
        "steps",
        "mtbf_s",
        "mtbf_steps",
        "failures",
        "seed",
        "schedules",
        "storm_s",
        "step_sleep",
    ):
        if getattr(args, name) is not None:
            chosen[name] = getattr(args, name)
    if args.kinds:
        chosen["kinds"] = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    chosen["baseline"] = not args.no_baseline
    return Settings(**chosen), args


def main(argv: list[str] | None = None) -> int:
    s, args = parse_args(sys.argv[1:] if argv is None else argv)
    work = Path(tempfile.mkdtemp(prefix="gameday-"))
    servers.isolate_cloud_env(os.environ, str(work))
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCKPT_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "scripts")]))
    env.update(PYTHONFAULTHANDLER="1")  # a process that aborts leaves its threads' stacks
    moto = servers.start_moto(work, nice=CLOUD_NICE)
    os.environ["AWS_ENDPOINT_URL_S3"] = moto.endpoint  # the supervisor's own listings
    sys.path.insert(0, str(REPO / "scripts"))
    import faultproxy

    # Byte-compiled as an installed package is (Orbax's is): a checkout run with
    # PYTHONDONTWRITEBYTECODE compiles its modules again in every process of every run.
    compileall.compile_dir(REPO / "jaxckpt", quiet=1)

    proxy = faultproxy.FaultProxy(moto.endpoint, seed=s.seed, nice=CLOUD_NICE)
    started = time.monotonic()
    try:
        _progress("gameday: the uninterrupted reference run")
        ref_day = Day(
            "reference", dataclasses.replace(s, kinds=s.kinds), work / "reference", env, ""
        )
        ref = ref_day.run([])
        step_s = reference_step_s(ref_day)
        s = dataclasses.replace(s, every=local_interval(s, step_s))
        day = Contest(s, work, env, proxy, moto.bucket, ref, step_s)
        result = {
            "settings": {**dataclasses.asdict(s), "kinds": list(s.kinds)},
            "step_s": step_s,
            **combine([day.contend(k, args.plot if k == 0 else None) for k in range(s.schedules)]),
        }
        result["elapsed_s"] = time.monotonic() - started
    finally:
        proxy.close()
        moto.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(render(result))
    if args.json is not None:
        text = json.dumps(result, indent=1, default=str)
        if str(args.json) == "-":
            print(text)
        else:
            args.json.write_text(text)
    return 0 if healthy(result) else 1


@dataclasses.dataclass
class Contest:
    """Both contenders on the same failure schedules, after one reference run."""

    s: Settings
    work: Path
    env: dict[str, str]
    proxy: Any
    bucket: str
    ref: dict[str, Any]
    step_s: float

    def contend(self, k: int, plot: Path | None) -> dict[str, Any]:
        """Schedule ``k``: jaxckpt's day (S3 behind the proxy), then Orbax's."""
        s, step_s = self.s, self.step_s
        failures = schedule(s, step_s, k)
        _progress(
            f"gameday: schedule {k + 1} of {s.schedules} (seed {s.seed + k}), a local save "
            f"every {s.every} steps; {len(failures)} failures: "
            f"{[(f.at_step, f.kind) for f in failures]}"
        )
        work = self.work / f"schedule{k}"
        env_s3 = {**self.env, "AWS_ENDPOINT_URL_S3": self.proxy.endpoint}
        durable = f"s3://{self.bucket}/gameday-{uuid.uuid4().hex[:8]}"
        ours = Day("jaxckpt", s, work / "jaxckpt", env_s3, durable)
        ours.proxy = self.proxy
        mine = assess(ours.run(failures), self.ref, s, step_s)
        mine["measured_save_cost_s"] = save_cost(mine, step_s, s.every)
        mine["ledger"] = ledger_view(ours.durable, plot)
        out: dict[str, Any] = {"seed": s.seed + k, **mine, "baseline_goodput": None}
        out["baseline"] = None
        if s.baseline:
            theirs = Day("orbax", s, work / "orbax", self.env, str(work / "orbax" / "durable"))
            base = assess(theirs.run(failures), self.ref, s, step_s)
            base["measured_save_cost_s"] = save_cost(base, step_s, s.promote_every)
            out["baseline"], out["baseline_goodput"] = base, base["goodput"]
        return out


def combine(days: list[dict[str, Any]]) -> dict[str, Any]:
    """The schedules together: each contender's mean goodput, every failure (with its
    schedule's seed), bit-exact and no wrong data only if every day was."""
    baselines = [d["baseline_goodput"] for d in days]
    return {
        "goodput": statistics.fmean(d["goodput"] for d in days),
        "baseline_goodput": None if None in baselines else statistics.fmean(baselines),
        "bit_exact": all(d["bit_exact"] for d in days),
        "wrong_data": sum(d["wrong_data"] for d in days),
        "failures": [{**f, "schedule": d["seed"]} for d in days for f in d["failures"]],
        "schedules": days,
    }


def healthy(result: dict[str, Any]) -> bool:
    """Whether jaxckpt's day kept its promises: every failure within its bound, the final
    state bit-exact, no wrong data (the exit status; the figures are reported either way)."""
    within = all(
        f["bound_steps"] is not None and f["lost_steps"] <= f["bound_steps"]
        for f in result["failures"]
    )
    return within and result["bit_exact"] and result["wrong_data"] == 0


def save_cost(assessed: dict[str, Any], step_s: float, every: int | None) -> float:
    """What a save cost the training: the trained step's excess over the reference run's
    step time, times the steps between saves."""
    return max(0.0, assessed["phases"]["step_s"] - step_s) * (every or 1)


def reference_step_s(day: Day) -> float:
    """The reference run's step time: its wall time from the first to the last step over
    the steps between (startup and compilation excluded)."""
    times = day.step_times
    if len(times) < 2:
        return 0.1
    return (times[-1] - times[0]) / (len(times) - 1)
