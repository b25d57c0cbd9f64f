"""The peer-replicated local tier: 4 JAX processes x 1 CPU device, one node each.

Side by side in one run, on a state of ``--mb`` MiB sharded over the 4 processes
(each process's part is a quarter), with the durable root on loopback S3 (moto),
optionally behind the shaping proxy of ``bench.py cloud`` (``--profile 20ms``):

* save, ``local_replicas=1`` (a single-node local commit) vs ``local_replicas=2``
  (each part also sent to the next node before its local commit): per save,
  how long ``save()`` blocked, and the time to the local commit
  (``SaveStats.total_s``), process 0's, median over ``--saves`` saves;
* restore after losing one node (node 0's local root wiped), a fresh group of
  processes each time: from the peers (``local_replicas=2``: node 0 fetches its
  part from node 1, the others read their own local tiers) vs from the durable
  root (every local root wiped: what a lost node costs without replicas, for
  the newest durable step); the slowest process's ``restore()``, median of
  ``--repeats`` alternated runs from copies of the local roots the save left.

Usage: ``python scripts/bench.py peers [--mb 64] [--saves 3] [--profile bare]
[--repeats 3] [--json results/bench_peers.json]``. Servers and listeners bind 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchkit import servers
from benchkit.cloud import parse_profiles
from benchkit.common import REPO
from benchkit.shaper import Shaper

PROCS = 4
LEAVES = 4


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=64.0, help="state size, all processes together")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--profile", default="bare", help="bare, 20ms or 50ms (see bench.py cloud)")
    p.add_argument("--repeats", type=int, default=3, help="restores of each kind (median)")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        return _child(json.loads(args.child))
    scratch = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    try:
        rows = run(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print_table(rows)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    return 0


def run(args: argparse.Namespace, scratch: Path) -> list[dict[str, Any]]:
    servers.isolate_cloud_env(os.environ, str(scratch))
    (profile,) = parse_profiles(args.profile, latency_ms=10, conn_mbps=25, total_mbps=200)
    server = servers.start_moto(scratch)
    rows: list[dict[str, Any]] = []
    try:
        with Shaper(server.endpoint, profile) as shaper:
            os.environ["AWS_ENDPOINT_URL_S3"] = shaper.endpoint
            spec = {"mb": args.mb, "saves": args.saves}
            for copies in (1, 2):
                root = f"s3://{server.bucket}/{uuid.uuid4().hex}"
                local = scratch / f"local-k{copies}-"
                job = {**spec, "root": root, "local": str(local), "copies": copies}
                saved = _group({**job, "mode": "save"}, scratch)
                blocking = [s["blocking_s"] for s in saved[0]["stats"]]
                commit = [s["total_s"] for s in saved[0]["stats"]]
                rows.append(
                    {
                        "row": f"save, local_replicas={copies}",
                        "blocking_s": statistics.median(blocking),
                        "local_commit_s": statistics.median(commit),
                        "profile": profile.name,
                    }
                )
                if copies == 2:
                    rows += _restores(job, local, scratch, args.repeats)
                    rows[-1]["profile"] = rows[-2]["profile"] = profile.name
    finally:
        server.stop()
    return rows


def _restores(
    job: dict[str, Any], local: Path, scratch: Path, repeats: int
) -> list[dict[str, Any]]:
    """Restores after losing node 0, from the peers and from the durable root, alternated
    ``repeats`` times from copies of the local roots as the save left them."""
    saved = scratch / "saved-locals"
    for i in range(PROCS):
        shutil.copytree(f"{local}{i}", saved / str(i))
    times: dict[str, list[float]] = {"peers": [], "durable": []}
    last: dict[str, list[dict[str, Any]]] = {}
    for _ in range(repeats):
        for source in times:
            for i in range(PROCS):
                shutil.rmtree(f"{local}{i}", ignore_errors=True)
                if source == "peers" and i != 0:  # node 0 lost; the others intact
                    shutil.copytree(saved / str(i), f"{local}{i}")
            last[source] = got = _group({**job, "mode": "restore"}, scratch)
            times[source].append(max(r["restore_s"] for r in got))  # the slowest process
    names = {"peers": "from peers", "durable": "durable root (no local copy)"}
    return [
        {
            "row": f"restore after losing node 0: {names[source]}",
            "restore_s": statistics.median(times[source]),
            "restore_runs_s": times[source],
            "step": last[source][0]["step"],
            "healed": sum(r["healed"] for r in last[source]),
        }
        for source in times
    ]


def _group(job: dict[str, Any], scratch: Path) -> list[dict[str, Any]]:
    """Runs one group of ``PROCS`` processes; returns each one's JSON result."""
    port = servers.free_port()
    procs = []
    for i in range(PROCS):
        spec = {**job, "process": i, "coordinator": f"127.0.0.1:{port}"}
        env = dict(os.environ, JAXCKPT_NODE_ID=f"node{i}", JAX_PLATFORMS="cpu")
        argv = [sys.executable, str(REPO / "scripts" / "bench.py"), "peers", "--child"]
        log = scratch / f"{job['mode']}-{uuid.uuid4().hex[:6]}-{i}.err"
        with open(log, "w") as err:  # the child keeps its own copy of the descriptor
            procs.append(
                subprocess.Popen(
                    [*argv, json.dumps(spec)],
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    env=env,
                )
            )
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"a {job['mode']} process failed (logs under {scratch})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _child(spec: dict[str, Any]) -> int:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import logging

    import jax
    import numpy as np

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=spec["coordinator"],
        coordinator_bind_address=spec["coordinator"],
        num_processes=PROCS,
        process_id=spec["process"],
    )
    import jaxckpt

    healed = []
    handler = logging.Handler()
    handler.emit = lambda r: healed.append(1) if "fetched this" in r.getMessage() else None  # type: ignore[method-assign]
    logging.getLogger("jaxckpt").addHandler(handler)
    logging.getLogger("jaxckpt").setLevel(logging.INFO)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    rows = max(PROCS, int(spec["mb"] * (1 << 20)) // LEAVES // 4 // 1024 // PROCS * PROCS)
    shape = (rows, 1024)
    full = {f"layer{j}": np.full(shape, j + 0.5, np.float32) for j in range(LEAVES)}
    mgr = jaxckpt.CheckpointManager(
        spec["root"],
        local_root=f"{spec['local']}{spec['process']}",
        local_replicas=spec["copies"],
        promote_policy=jaxckpt.policy.EveryNSteps(spec["saves"]),  # the last step is durable
        chunk_bytes=4 << 20,
        save_timeout_s=300,
    )
    result: dict[str, Any] = {}
    if spec["mode"] == "save":
        state = {
            k: jax.make_array_from_callback(shape, sharding, lambda idx, v=v: v[idx])
            for k, v in full.items()
        }
        for step in range(1, spec["saves"] + 1):
            mgr.save(step, state)
            mgr.wait()
        mgr.wait_durable()
        result["stats"] = [
            {"blocking_s": s.blocking_s, "total_s": s.total_s} for s in mgr.save_stats()
        ]
    else:
        target = {k: jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding) for k in full}
        start = time.perf_counter()
        restored = mgr.restore(target=target)
        jax.block_until_ready(restored)
        result["restore_s"] = time.perf_counter() - start
        result["step"] = mgr.restored_step
        result["healed"] = len(healed)
        for k, v in full.items():
            for shard in restored[k].addressable_shards:
                if not np.array_equal(np.asarray(shard.data), v[shard.index]):
                    raise SystemExit(f"{k}: restored values differ")
    mgr.close()
    print(json.dumps(result), flush=True)
    return 0


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| row | blocking s | local commit s | restore s | step | parts fetched |")
    print("|---|---|---|---|---|---|")
    for r in rows:

        def cell(key: str, r: dict[str, Any] = r) -> str:
            value = r.get(key)
            return (
                "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)
            )

        print(
            f"| {r['row']} | {cell('blocking_s')} | {cell('local_commit_s')} | "
            f"{cell('restore_s')} | {cell('step')} | {cell('healed')} |"
        )
