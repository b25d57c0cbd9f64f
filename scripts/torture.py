"""Torture run: many writers, kills, races and transient faults; invariants after every round.

Usage::

    python scripts/torture.py --minutes 30 [--backends local,s3,gcs] [--seed S] [--json OUT]
    python scripts/torture.py --rounds 11 --seed 1 --json out.json   # the test suite's short run

It starts its own loopback servers (moto for S3, the patched GCS emulator;
``scripts/benchkit/servers.py``) with a fault-injecting proxy in front of each
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
violation. The checks live in ``torture_checks.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchkit import servers
from faultproxy import FAULT_KINDS, NO_FAULTS, FaultPlan, FaultProxy
from torture_checks import (
    Child,
    Event,
    Root,
    RoundResult,
    Writer,
    check_round,
    cli,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

SCENARIOS = ("kill", "zombie", "race", "faults")
BACKENDS = ("local", "s3", "gcs")
DEFAULT_FAULTS = "error=0.04,reset=0.02,lost=0.02,slow=0.04,slow_s=0.3"
# Short backoff, more attempts: the faults are frequent but brief.
CHILD_STORAGE_OPTIONS = {"max_retries": 8, "initial_delay_s": 0.02, "max_delay_s": 0.5}
START_TIMEOUT_S = 90.0  # a child's start-up (importing jax) on a loaded machine
ROUND_TIMEOUT_S = 240.0  # a writer's whole life
PROXY_DRAIN_S = 60.0  # requests of killed writers still being forwarded
FENCE_TIMEOUT_S = 90.0  # how long a zombie may keep going after the takeover
CLI_TIMEOUT_S = 120.0

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
        from jaxckpt.storage import open_storage

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
        done = cli(result, "gc", root.uri, subprocess_=True)
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
        steps = str(self.args.faults_steps)
        writer = self.spawn(
            root, result, "writer", "--restore", "--steps", steps, "--keep-last", "3"
        )
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
            if not proxy.wait_idle(PROXY_DRAIN_S):  # a dead writer's requests still land
                result.violations.append(f"the proxy still forwards after {PROXY_DRAIN_S:.0f}s")
            after = proxy.snapshot()
            result.faults = Counter(
                {k: after[k] - before[k] for k in FAULT_KINDS if after[k] > before[k]}
            )
        check_round(root, result, writers)
        result.seconds = time.monotonic() - t0
        if result.violations:
            root.rounds = self.args.rounds_per_root  # keep it for a post-mortem; start a new one
            self.roots.pop(backend, None)
            result.notes.append(f"root kept for inspection: {root.uri}")
        return result

    def latest(self, root: Root) -> int:
        from jaxckpt.commit import CommitProtocol
        from jaxckpt.storage import open_storage

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
    p.add_argument("--faults-steps", type=int, default=4, help="steps of a 'faults' round")
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
