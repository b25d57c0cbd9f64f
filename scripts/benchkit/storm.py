"""``bench.py storm``: a save and a restore through a store that throttles every request.

The target: "a save and a restore through a proxy that answers every
request with ``503 SlowDown`` for 60 s both complete (slower), and
commit/restore the right step". ``--processes`` real JAX processes (one CPU
device each; ``benchkit/scale_child.py --mode storm``) talk to a loopback S3
server (moto) through one fault proxy (``scripts/faultproxy.py``). Two runs,
one after the other, on fresh roots, with the same bytes:

* ``baseline``: no faults;
* ``storm``: from the moment every process is about to save (a gate after the
  save's barrier) the proxy answers ``503 SlowDown`` to every request for
  ``--seconds``; likewise from the moment every process is about to restore
  (with a fresh manager, as after a restart; ``--with-open``: from the moment
  it is about to open that manager).

In each run the processes first save step 1 (unthrottled), then step 2 (other
values) in the storm, then a fresh manager restores the newest step, which must
be step 2 with every byte equal. After each run the parent reads the root
(read-only, straight to moto) for the committed steps. Reported side by side:
whether both calls completed on every process, the newest committed step, the
restored step and whether its bytes are equal, the slowest process's seconds
of ``save()`` until committed, of ``restore()`` and of the fresh manager's open
plus ``restore()``, and the requests the proxy throttled. The managers run with
their defaults (``save_timeout_s`` 600 s bounds every request's retries;
backoff windows of 0.5-8 s) unless ``--save-timeout``/``--max-delay`` say
otherwise.

    python scripts/bench.py storm [--seconds 60] [--processes 2] [--json results/bench_storm.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import faultproxy

from benchkit import servers
from benchkit.common import _progress
from benchkit.group import run_group

STORMED = {"save": "close", "restore": "close2"}
"""The gates a storm starts at -- a save (its manager open), a restore (a fresh
manager open) -- and the gate that ends it if it still runs (the call finished
or failed inside it)."""
WITH_OPEN = {"save": "close", "reopen": "close2"}
"""``--with-open``: the second storm covers a whole restart (a fresh manager's open,
then its restore)."""


class Storms:
    """Starts a storm of ``seconds`` on the proxy at each gate in ``stormed``
    (:data:`STORMED`); its timer or the gate that follows the stormed call ends it."""

    def __init__(
        self,
        proxy: faultproxy.FaultProxy,
        seconds: float,
        stormed: dict[str, str] | None = None,
    ) -> None:
        self.proxy, self.seconds = proxy, seconds
        self.stormed = STORMED if stormed is None else stormed
        self.throttled: dict[str, int] = {}
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._storm: tuple[str, int] | None = None  # the gate, the throttle count before it

    def __call__(self, gate: str) -> None:
        if gate in self.stormed or gate in self.stormed.values():
            self.calm()
        if gate in self.stormed and self.seconds > 0:
            with self._lock:
                self._storm = gate, self.proxy.snapshot()["throttle"]
                self.proxy.plan = faultproxy.FaultPlan(throttle=1.0)
            self._timer = threading.Timer(self.seconds, self._end)
            self._timer.start()

    def _end(self) -> None:
        with self._lock:
            self.proxy.plan = faultproxy.NO_FAULTS
            if self._storm is not None:
                gate, before = self._storm
                self.throttled[gate] = self.proxy.snapshot()["throttle"] - before
                self._storm = None

    def calm(self) -> None:
        """Ends a storm still running (a call that finished or failed inside it)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join()
            self._timer = None
        self._end()


def measure(
    kind: str, server: servers.Server, scratch: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """One run (``baseline`` or ``storm``) of ``args.processes`` processes on a fresh root."""
    root = f"s3://{server.bucket}/storm-{kind}-{uuid.uuid4().hex[:8]}"
    proxy = faultproxy.FaultProxy(server.endpoint)
    stormed = WITH_OPEN if args.with_open else STORMED
    storms = Storms(proxy, args.seconds if kind == "storm" else 0.0, stormed)
    child_args = ["--mode=storm", f"--leaves={args.leaves}", f"--leaf-kib={args.leaf_kib}"]
    if args.save_timeout is not None:
        child_args.append(f"--save-timeout={args.save_timeout}")
    if args.max_delay is not None:
        child_args.append(f"--max-delay={args.max_delay}")
    started = time.monotonic()
    try:
        reports = run_group(
            args.processes,
            root,
            [proxy.endpoint] * args.processes,
            scratch,
            *child_args,
            on_gate=storms,
            tag=f"storm-{kind}",
        )
    finally:
        storms.calm()
        counts = proxy.snapshot()
        proxy.close()
    return {
        "run": kind,
        "root": root,
        "elapsed_s": time.monotonic() - started,
        "storm_s": args.seconds if kind == "storm" else 0.0,
        "throttled": storms.throttled,
        "requests": counts["requests"],
        "committed": committed_steps(root, server.endpoint),
        "per_process": [r["outcomes"] for r in reports],
        "summary": summarize([r["outcomes"] for r in reports]),
    }


def committed_steps(root: str, endpoint: str) -> list[int]:
    """The root's committed steps, read straight from the server."""
    import jaxckpt

    with jaxckpt.CheckpointManager(
        root, read_only=True, storage_options={"endpoint": endpoint}
    ) as mgr:
        return list(mgr.steps())


def summarize(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every process: completed, the slowest save and restore, the restored step."""
    saves = [o["save"] for o in outcomes]
    restores = [o["restore"] for o in outcomes]
    errors = [
        f"process {i} {phase}: {o[phase]['error']}: {o[phase]['message'][:300]}"
        for i, o in enumerate(outcomes)
        for phase in ("prime", "save", "reopen", "restore")
        if not o[phase]["ok"]
    ]
    steps = {r.get("step") for r in restores}
    return {
        "completed": not errors,
        "errors": errors,
        "save_s": max(s["seconds"] for s in saves),
        "restart_s": max(o["reopen"]["seconds"] + o["restore"]["seconds"] for o in outcomes),
        "restore_s": max(r["seconds"] for r in restores),
        "restored_step": steps.pop() if len(steps) == 1 else sorted(map(str, steps)),
        "bytes_equal": all(r.get("equal", False) for r in restores),
    }


def render(runs: list[dict[str, Any]]) -> str:
    """The runs side by side, one row each."""
    lines = [
        "| run | storm s | completed | committed steps | restored step | bytes equal "
        "| save s | restore s | open + restore s | throttled save / restore |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        s, t = run["summary"], run["throttled"]
        lines.append(
            f"| {run['run']} | {run['storm_s']:g} | {'yes' if s['completed'] else 'NO'} "
            f"| {run['committed']} | {s['restored_step']} | {'yes' if s['bytes_equal'] else 'NO'} "
            f"| {s['save_s']:.1f} | {s['restore_s']:.1f} | {s['restart_s']:.1f} "
            f"| {t.get('save', 0)} / {t.get('restore', t.get('reopen', 0))} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py storm", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="length of each storm")
    p.add_argument("--processes", type=int, default=2, help="real JAX processes")
    p.add_argument("--leaves", type=int, default=8, help="sharded leaves")
    p.add_argument("--leaf-kib", type=int, default=1024, help="KiB of each leaf per process")
    p.add_argument(
        "--with-open", action="store_true", help="storm the restart's open too, not the restore"
    )
    p.add_argument("--save-timeout", type=float, default=None, help="managers' save_timeout_s")
    p.add_argument("--max-delay", type=float, default=None, help="retries' max_delay_s")
    p.add_argument("--json", type=Path, default=None, help="write the runs here")
    args = p.parse_args(argv)
    if args.processes < 1 or args.seconds < 0:
        p.error("--processes must be >= 1 and --seconds >= 0")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-storm-") as tmp:
        servers.isolate_cloud_env(os.environ, tmp)  # the children inherit it
        server = servers.start_moto(Path(tmp))
        try:
            for kind in ("baseline", "storm"):
                _progress(f"storm: {kind}, {args.processes} processes")
                runs.append(measure(kind, server, Path(tmp), args))
        finally:
            server.stop()
    print(render(runs))
    for run in runs:
        for error in run["summary"]["errors"]:
            print(f"{run['run']}: {error}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"config": config, "runs": runs}, indent=1))
    return 0 if all(r["summary"]["completed"] for r in runs) else 1
