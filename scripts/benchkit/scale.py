"""``bench.py scale``: storage and coordination cost per process as real JAX processes grow.

For each N of ``--processes`` (default 2,4,8,16), N real JAX processes (one
CPU device each, ``jax.distributed`` on 127.0.0.1, gloo;
``benchkit/scale_child.py``) save one sharded step to a loopback S3 server
(moto) and restore it, every process through a counting proxy of its own
(``benchkit/shaper.py``: no shaping, one proxy per process in one helper
process), so each request is told by process, phase (by the child's
monotonic stamps), kind and key. Every process holds the same bytes whatever N.
Reported per N and phase (save: ``save()`` until committed, then ``close()``;
restore: ``restore()`` by a fresh manager, as after a restart, then
``close()``; open: the writable open before the save), for the primary
(process 0) and the busiest other process:

* storage requests per process by kind (GET, PUT, LIST, DELETE, HEAD; a batched
  delete counts as a DELETE, a multipart call as a PUT), and metadata vs data
  by key (data: ``packs/`` and plain chunk objects ``arrays/<leaf>/c/``;
  metadata: everything else: records, manifest parts, markers, listings).
  Attempts that got no answer or a 5xx are counted apart (``failed_requests``),
  so a retry under load does not change the protocol's counts;
* metadata bytes read: response bodies of metadata GETs and of listings;
* coordination-service calls per process (every call of a delegate wrapped
  around ``jax._src.distributed.global_state.client``) and at the coordinator
  (all processes' calls: each is one RPC to the service);
* wall time of the save and of the restore (latest end minus earliest start).

``tests/test_scale_counts.py`` runs this at 2 and 4 processes and asserts issue
35's targets on the counts.

    python scripts/bench.py scale [--processes 2,4,8,16] [--json results/bench_scale.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import urllib.parse
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from benchkit import servers
from benchkit.common import _progress
from benchkit.group import run_group
from benchkit.shaper import Exchange, ShaperProcess

KINDS = ("GET", "PUT", "LIST", "DELETE", "HEAD")
REPORTED = {"open": ("open",), "save": ("save", "close"), "restore": ("restore", "close2")}
"""Reported phases and the child's phases each adds up: a save until its manager is closed
(the pending record's delete runs in the background after the commit; closing the
agreement waits for every process), a restore likewise."""


def classify(exchange: Exchange) -> tuple[str, str, str]:
    """``(kind, "meta" | "data", key)`` of one S3 request (path-style: ``/bucket/key?query``).

    >>> classify(Exchange(started=0, method="GET", target="/b?list-type=2&prefix=r%2Fc%2F"))
    ('LIST', 'meta', 'r/c/')
    >>> classify(Exchange(started=0, method="PUT", target="/b/r/attempts/1/a/packs/0.0.bin"))
    ('PUT', 'data', 'r/attempts/1/a/packs/0.0.bin')
    >>> classify(Exchange(started=0, method="POST", target="/b?delete"))[:2]
    ('DELETE', 'meta')
    """
    parts = urllib.parse.urlsplit(exchange.target)
    _, _, key = parts.path.lstrip("/").partition("/")
    key = urllib.parse.unquote(key)
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    method = exchange.method.upper()
    if method == "GET" and not key:
        kind, key = "LIST", query.get("prefix", [""])[0]
    elif method == "POST":
        kind = "DELETE" if "delete" in query else "PUT"  # DeleteObjects; multipart calls
    else:
        kind = method if method in KINDS else "OTHER"
    data = "/packs/" in f"/{key}" or "/c/" in key.partition("/arrays/")[2]
    return kind, "data" if data else "meta", key


def _phase_of(started: float, stamps: dict[str, float]) -> str:
    """The phase whose window (its stamp to the next one) holds ``started``."""
    found = "before"
    for name, at in sorted(stamps.items(), key=lambda kv: kv[1]):
        if started < at:
            break
        found = name
    return "after" if found == "end" else found


def tally(exchanges: list[Exchange], report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One process's counts by phase: requests by kind and class, bytes, coordination calls."""
    phases: dict[str, dict[str, Any]] = {}

    def entry(phase: str) -> dict[str, Any]:
        return phases.setdefault(
            phase,
            {
                "requests": dict.fromkeys(KINDS, 0),
                "meta_requests": 0,
                "data_requests": 0,
                "meta_reads": 0,
                "meta_writes": 0,
                "manifest_gets": 0,
                "failed_requests": 0,
                "meta_bytes_read": 0,
                "data_bytes_read": 0,
                "coordination": {},
                "coordination_calls": 0,
            },
        )

    for x in exchanges:
        kind, cls, key = classify(x)
        e = entry(_phase_of(x.started, report["stamps"]))
        if x.status == 0 or x.status >= 500:  # no answer or a server error: retried
            e["failed_requests"] += 1
            continue
        e["requests"][kind] = e["requests"].get(kind, 0) + 1
        e[f"{cls}_requests"] += 1
        if cls == "meta":
            e["meta_reads" if kind in ("GET", "HEAD", "LIST") else "meta_writes"] += 1
        if kind in ("GET", "LIST"):
            e[f"{cls}_bytes_read"] += x.received
        if kind == "GET" and "/manifest/" in f"/{key}":
            e["manifest_gets"] += 1
    for phase, calls in report["calls"].items():
        e = entry(phase)
        e["coordination"] = dict(sorted(calls.items()))
        e["coordination_calls"] = sum(calls.values())
    for e in phases.values():
        e["total_requests"] = sum(e["requests"].values())
    return phases


def measure(
    n: int, server: servers.Server, scratch: Path, *, leaves: int = 8, leaf_kib: int = 64
) -> dict[str, Any]:
    """One group of ``n`` processes: save and restore through ``n`` counting proxies."""
    root = f"s3://{server.bucket}/scale-{n}-{uuid.uuid4().hex[:8]}"
    load = os.getloadavg()
    with ShaperProcess(server.endpoint, copies=n, record=True) as proxies:
        reports = run_group(
            n, root, proxies.endpoints, scratch, f"--leaves={leaves}", f"--leaf-kib={leaf_kib}"
        )
        exchanges = [proxies.exchanges(i) for i in range(n)]
    per_process = [tally(x, r) for x, r in zip(exchanges, reports, strict=True)]
    stamps = [r["stamps"] for r in reports]

    def wall(start: str, end: str) -> float:
        return max(s[end] for s in stamps) - min(s[start] for s in stamps)

    return {
        "processes": n,
        "root": root,
        "bytes_per_process": leaves * leaf_kib * 1024,
        "load_before": load,
        "load_after": os.getloadavg(),
        "wall_s": {
            "open": wall("open", "save"),
            "save": wall("save", "close"),
            "restore": wall("restore", "close2"),
        },
        "per_process": per_process,
        "summary": {name: summarize(per_process, parts) for name, parts in REPORTED.items()},
    }


def summarize(per_process: list[dict[str, Any]], phases: tuple[str, ...]) -> dict[str, Any]:
    """Over ``phases``: the primary's figures, the busiest other process's, the coordinator's."""
    rows = [_added([p[x] for x in phases if x in p]) for p in per_process]

    def figures(row: dict[str, Any]) -> dict[str, Any]:
        return {
            "requests": dict(row.get("requests", dict.fromkeys(KINDS, 0))),
            "total_requests": row.get("total_requests", 0),
            "meta_requests": row.get("meta_requests", 0),
            "data_requests": row.get("data_requests", 0),
            "meta_reads": row.get("meta_reads", 0),
            "meta_writes": row.get("meta_writes", 0),
            "manifest_gets": row.get("manifest_gets", 0),
            "failed_requests": row.get("failed_requests", 0),
            "meta_bytes_read": row.get("meta_bytes_read", 0),
            "coordination_calls": row.get("coordination_calls", 0),
        }

    primary, others = figures(rows[0]), [figures(r) for r in rows[1:]]
    busiest = {k: max((o[k] for o in others), default=0) for k in primary if k != "requests"}
    busiest["requests"] = {
        kind: max((o["requests"].get(kind, 0) for o in others), default=0) for kind in KINDS
    }
    coordinator: Counter[str] = Counter()
    for r in rows:
        coordinator.update(r.get("coordination", {}))
    return {
        "primary": primary,
        "others_max": busiest,
        "coordinator_calls": sum(coordinator.values()),
        "coordinator_by_method": dict(sorted(coordinator.items())),
    }


def _added(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The sum of some phases' entries of one process (see :func:`tally`)."""
    out: dict[str, Any] = {"requests": dict.fromkeys(KINDS, 0), "coordination": Counter()}
    for e in entries:
        for key, value in e.items():
            if key == "requests":
                for kind, n in value.items():
                    out["requests"][kind] = out["requests"].get(kind, 0) + n
            elif key == "coordination":
                out["coordination"].update(value)
            else:
                out[key] = out.get(key, 0) + value
    out["coordination"] = dict(out["coordination"])
    return out


def render(runs: list[dict[str, Any]]) -> str:
    """A markdown table: per N and phase, the primary's figures and the busiest other's."""
    lines = [
        "| N | phase | requests/process P0 / others | GET/PUT/LIST/DEL/HEAD P0 · others "
        "| meta KiB read P0 / others | coord calls P0 / others / coordinator | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for phase in REPORTED:
            s = run["summary"][phase]
            p, o = s["primary"], s["others_max"]

            def kinds(f: dict[str, Any]) -> str:
                return "/".join(str(f["requests"].get(k, 0)) for k in KINDS)

            lines.append(
                f"| {run['processes']} | {phase} "
                f"| {p['total_requests']} / {o['total_requests']} "
                f"| {kinds(p)} · {kinds(o)} "
                f"| {p['meta_bytes_read'] / 1024:.1f} / {o['meta_bytes_read'] / 1024:.1f} "
                f"| {p['coordination_calls']} / {o['coordination_calls']} "
                f"/ {s['coordinator_calls']} "
                f"| {run['wall_s'][phase]:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py scale", description=__doc__.splitlines()[0])
    p.add_argument("--processes", default="2,4,8,16", help="comma-separated process counts")
    p.add_argument("--leaves", type=int, default=8, help="sharded leaves")
    p.add_argument("--leaf-kib", type=int, default=64, help="KiB of each leaf per process")
    p.add_argument("--json", type=Path, default=None, help="write every count here")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.processes.split(",") if x.strip()]
    if not counts or min(counts) < 2:
        p.error("--processes: counts of at least 2")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        servers.isolate_cloud_env(os.environ, tmp)  # the children inherit it
        server = servers.start_moto(Path(tmp))
        try:
            for n in counts:
                _progress(f"scale: {n} processes (load {os.getloadavg()[0]:.1f})")
                runs.append(
                    measure(n, server, Path(tmp), leaves=args.leaves, leaf_kib=args.leaf_kib)
                )
        finally:
            server.stop()
    table = render(runs)
    print(table)
    print(
        "load average (1 min) before/after each N: "
        + ", ".join(
            f"{r['processes']}: {r['load_before'][0]:.1f}/{r['load_after'][0]:.1f}" for r in runs
        )
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {"leaves": args.leaves, "leaf_kib": args.leaf_kib, "cpus": os.cpu_count()}
        args.json.write_text(json.dumps({"config": config, "runs": runs}, indent=1))
    return 0
