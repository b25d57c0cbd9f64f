"""``bench.py denied``: one host loses access to its data; how fast every host learns it.

The target: "one host that cannot read its data (HTTP 403): every host
raises within 30 s, naming that host". ``--processes`` real JAX processes (one
CPU device each; ``benchkit/scale_child.py --mode denied``) talk to a loopback
S3 server (moto), each through a fault proxy of its own
(``scripts/faultproxy.py``). They save step 1 and close; then a fresh manager
on each process restores it while the proxy of process ``--deny-process``
answers ``403 AccessDenied`` to its data reads (``GET`` of ``/packs/`` and
``/arrays/`` keys); then they save step 2 while that proxy denies its data
writes (``PUT`` of the same keys). Both gates open on every process at once.

Reported per process and call: the seconds from the call to its error, the
error's class, and whether the message names the denied host (``process <k>``)
and the object (a key with ``/packs/`` or ``/arrays/``); a process that did not
raise (it returned, or JAX's heartbeat killed it) is reported as such. The
managers run with ``save_timeout_s`` of ``--save-timeout`` (120 s), so a host
that is never told fails within minutes instead of the default 10.

    python scripts/bench.py denied [--processes 4] [--deny-process 1]
        [--json results/bench_denied.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import faultproxy

from benchkit import servers
from benchkit.common import _progress
from benchkit.group import run_group

WITHIN_S = 30.0
DATA = ("/packs/", "/arrays/")
DENIED = {"restore": "GET", "save2": "PUT"}
"""The calls measured (the child's phases), and the method of the data requests the
denied host loses."""
LABELS = {"restore": "restore", "save2": "save"}


def measure(server: servers.Server, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One group; each process's outcome of the denied restore and the denied save."""
    n, k = args.processes, args.deny_process
    root = f"s3://{server.bucket}/denied-{n}-{uuid.uuid4().hex[:8]}"
    proxies = [faultproxy.FaultProxy(server.endpoint) for _ in range(n)]
    denied_at: dict[str, float] = {}

    def on_gate(gate: str) -> None:
        proxies[k].clear_rules()
        if gate in DENIED:
            proxies[k].deny(*((DENIED[gate], fragment) for fragment in DATA))
            denied_at[gate] = time.monotonic()

    child_args = [
        "--mode=denied",
        f"--leaves={args.leaves}",
        f"--leaf-kib={args.leaf_kib}",
        f"--save-timeout={args.save_timeout}",
    ]
    try:
        reports = run_group(
            n,
            root,
            [p.endpoint for p in proxies],
            scratch,
            *child_args,
            on_gate=on_gate,
            tag=f"denied-{n}",
            strict=False,
        )
    finally:
        denials = proxies[k].snapshot()["deny"]
        for p in proxies:
            p.close()
    rows = [row(report, k) for report in reports]
    return {
        "processes": n,
        "deny_process": k,
        "root": root,
        "denied_requests": denials,
        "per_process": rows,
        "targets": {call: verdict(rows, call) for call in DENIED},
    }


def row(report: dict[str, Any], k: int) -> dict[str, Any]:
    """One process's outcome of each denied call."""
    if "failed" in report:
        died = {"raised": False, "died": report["failed"], "log_tail": report["log_tail"][-800:]}
        return {"process": report["process"], **dict.fromkeys(DENIED, died)}
    out: dict[str, Any] = {"process": report["process"]}
    for call in DENIED:
        o = report["outcomes"][call]
        message = o.get("message", "")
        out[call] = {
            "raised": not o["ok"],
            "seconds": round(o["seconds"], 2),
            "error": o.get("error"),
            "names_host": bool(re.search(rf"\bprocess {k}\b", message)),
            "names_object": any(fragment in message for fragment in DATA),
            "message": message[:400],
        }
    return out


def verdict(rows: list[dict[str, Any]], call: str) -> dict[str, Any]:
    """Whether every process raised within :data:`WITHIN_S`, naming the denied host."""
    entries = [r[call] for r in rows]
    slowest = max((e.get("seconds", float("inf")) for e in entries), default=float("inf"))
    met = all(e["raised"] and e["names_host"] for e in entries) and slowest <= WITHIN_S
    return {"met": met, "slowest_s": slowest, "bound_s": WITHIN_S}


def render(run: dict[str, Any]) -> str:
    """Per process: each call's seconds to raise, the error, and what it names."""
    k = run["deny_process"]
    lines = [
        f"{run['processes']} processes; process {k}'s data requests denied "
        f"({run['denied_requests']} answered 403)",
        "",
        "| process | restore: raised after s | error | names host / object "
        "| save: raised after s | error | names host / object |",
        "|---|---|---|---|---|---|---|",
    ]

    def cells(e: dict[str, Any]) -> str:
        if "died" in e:
            return f"did not raise (exit {e['died']}) | - | - "
        if not e["raised"]:
            return f"did not raise ({e['seconds']:.1f} s) | - | - "
        named = f"{'yes' if e['names_host'] else 'NO'} / {'yes' if e['names_object'] else 'no'}"
        return f"{e['seconds']:.1f} | {e['error']} | {named} "

    for r in run["per_process"]:
        lines.append(f"| {r['process']} | " + "| ".join(cells(r[c]) for c in DENIED) + "|")
    for call, v in run["targets"].items():
        lines.append(
            f"\n{LABELS[call]}: every host raised within {v['bound_s']:g} s naming process {k}: "
            f"{'PASS' if v['met'] else 'MISS'} (slowest {v['slowest_s']:.1f} s)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py denied", description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=4, help="real JAX processes")
    p.add_argument("--deny-process", type=int, default=1, help="the host that loses access")
    p.add_argument("--leaves", type=int, default=8, help="sharded leaves")
    p.add_argument("--leaf-kib", type=int, default=64, help="KiB of each leaf per process")
    p.add_argument("--save-timeout", type=float, default=120.0, help="managers' save_timeout_s")
    p.add_argument("--json", type=Path, default=None, help="write the run here")
    args = p.parse_args(argv)
    if args.processes < 2 or not 0 <= args.deny_process < args.processes:
        p.error("need --processes >= 2 and 0 <= --deny-process < --processes")
    with tempfile.TemporaryDirectory(prefix="bench-denied-") as tmp:
        servers.isolate_cloud_env(os.environ, tmp)  # the children inherit it
        server = servers.start_moto(Path(tmp))
        try:
            _progress(f"denied: {args.processes} processes, process {args.deny_process} denied")
            run = measure(server, Path(tmp), args)
        finally:
            server.stop()
    print(render(run))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"config": config, "run": run}, indent=1))
    return 0 if all(v["met"] for v in run["targets"].values()) else 1
