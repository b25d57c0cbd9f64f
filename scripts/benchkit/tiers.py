"""Tiers against saving straight to an object store, on loopback S3 (moto) and GCS (emulator).

For each store, one training loop (CPU-bound numpy steps) saves a state every
``--every`` steps, either straight to the object store or to a local tier
with background promotion of every save. Reported per save, all in one run so
the ratios compare like with like:

* blocking: how long ``save()`` held the loop (it waits for the previous save
  when that one is still in flight, which is what a slow store costs);
* loop overhead: (loop time with saves − the same loop without, the faster of two
  runs measured just before) / saves;
* time to durable: from the call to ``save()`` until the step was committed
  on the object store (``SaveStats.total_s`` direct, ``durable_s`` tiered).

Usage: ``python scripts/bench.py tiers [--mb 32] [--leaves 4] [--saves 3]
[--every 20] [--stores s3,gcs] [--out results/bench_tiers.json]``.
Needs ``jaxckpt[test]`` (moto, gcp-storage-emulator). Servers listen on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from benchkit import servers
from benchkit.common import REPO
from benchkit.stores import loopback_endpoint


def make_state(mb: float, leaves: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = int(mb * (1 << 20)) // leaves // 4
    return {f"layer{i}": rng.standard_normal(n, dtype=np.float32) for i in range(leaves)}


def train_step(x: np.ndarray) -> np.ndarray:
    """About 10-20 ms of CPU work on this machine."""
    for _ in range(4):
        x = np.tanh(x @ x.T @ x * 1e-3)
    return x


def run_loop(mgr: Any, args: argparse.Namespace, state: dict[str, np.ndarray]) -> dict[str, Any]:
    x = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    blocking = []
    start = time.perf_counter()
    last_save = args.saves * args.every
    for step in range(1, last_save + args.every + 1):  # a tail, so the last save's work lands
        x = train_step(x)  # inside the loop too
        if mgr is not None and step % args.every == 0 and step <= last_save:
            t = time.perf_counter()
            mgr.save(step, state)
            blocking.append(time.perf_counter() - t)
    loop_s = time.perf_counter() - start
    return {"loop_s": loop_s, "blocking_s": blocking}


def bench(
    kind: str, root: str, args: argparse.Namespace, base_loop_s: float, scratch: Path
) -> dict[str, Any]:
    import jaxckpt

    state = make_state(args.mb, args.leaves, 1)
    kwargs: dict[str, Any] = {"chunk_bytes": 4 << 20}
    if kind == "tiered":
        kwargs["local_root"] = tempfile.mkdtemp(prefix="bench-tier-", dir=scratch)
    mgr = jaxckpt.CheckpointManager(root, **kwargs)
    loop = run_loop(mgr, args, state)
    t = time.perf_counter()
    if kind == "tiered":
        mgr.wait_durable(timeout_s=1800)
    mgr.wait()
    drain_s = time.perf_counter() - t
    stats = mgr.save_stats()
    mgr.close()
    durable = [s.durable_s if kind == "tiered" else s.total_s for s in stats]
    return {
        "kind": kind,
        "blocking_ms": 1000 * statistics.mean(loop["blocking_s"]),
        "save_blocking_ms": 1000 * statistics.mean(s.blocking_s for s in stats),
        "overhead_ms": 1000 * (loop["loop_s"] - base_loop_s) / args.saves,
        "to_local_s": statistics.mean(s.total_s for s in stats) if kind == "tiered" else None,
        "to_durable_s": statistics.mean(d for d in durable if d is not None),
        "drain_after_loop_s": drain_s,
        "saves": len(stats),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py tiers", description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=32)
    p.add_argument("--leaves", type=int, default=4)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--stores", default="s3,gcs")
    p.add_argument("--out", default=str(REPO / "results" / "bench_tiers.json"))
    for store in ("s3", "gcs"):
        p.add_argument(
            f"--{store}-endpoint",
            help=f"use this running loopback {store} server (bucket servers.BUCKET), start none",
        )
    args = p.parse_args(argv)
    unknown = set(args.stores.split(",")) - {"s3", "gcs"}
    if unknown:
        p.error(f"unknown stores {sorted(unknown)}; choose from s3, gcs")
    with tempfile.TemporaryDirectory(prefix="bench-tiers-") as scratch:
        rows = run_stores(args, Path(scratch))
    out = {
        "config": vars(args),
        "rows": rows,
        "note": "2-core VM shared with other jobs; in-memory loopback servers",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print_table(rows)
    return 0


def run_stores(args: argparse.Namespace, scratch: Path) -> list[dict[str, Any]]:
    """Direct and tiered rows for each store; servers (and their logs) in ``scratch``."""
    servers.isolate_cloud_env(os.environ, str(scratch))
    started = []
    rows = []
    try:
        for store in args.stores.split(","):
            endpoint = getattr(args, f"{store}_endpoint")
            if endpoint:  # a server that is already running, with the usual bucket
                endpoint, bucket = loopback_endpoint(endpoint), servers.BUCKET
            else:
                start = servers.start_moto if store == "s3" else servers.start_gcs_emulator
                started.append(start(scratch))
                endpoint, bucket = started[-1].endpoint, started[-1].bucket
            if store == "s3":
                os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
                scheme = "s3"
            else:
                os.environ["STORAGE_EMULATOR_HOST"] = endpoint
                scheme = "gs"
            for kind in ("direct", "tiered"):
                root = f"{scheme}://{bucket}/{uuid.uuid4().hex}"
                # the loop without saves, measured right before (the machine is shared)
                base = min(run_loop(None, args, {})["loop_s"] for _ in range(2))
                row = {
                    "store": store,
                    "base_loop_s": base,
                    **bench(kind, root, args, base, scratch),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for server in started:
            server.stop()
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| store | save to | blocking per save (ms) | loop overhead per save (ms) "
        "| to local commit (s) | to durable (s) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        local = f"{r['to_local_s']:.2f}" if r["to_local_s"] is not None else "-"
        print(
            f"| {r['store']} | {'local tier' if r['kind'] == 'tiered' else 'object store'} "
            f"| {r['blocking_ms']:.1f} | {r['overhead_ms']:.0f} | {local} "
            f"| {r['to_durable_s']:.2f} |"
        )
    sys.stdout.flush()
