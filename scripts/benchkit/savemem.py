"""Save memory: a save's peak host memory beyond the state, on a multi-GiB state.

Each measurement runs in a fresh child process (its resident memory starts
clean) that builds a state of ``--gib`` GiB as ``jax.Array`` leaves of
``--leaf-mib`` MiB on the CPU device, then saves it once with
``jaxckpt.CheckpointManager`` (``save`` + ``wait``, until committed) while
:class:`benchkit.measure.PeakRss` watches the process's resident memory
(kernel high-water mark and a 5 ms sampler). On the CPU a leaf's host
snapshot is a view of its buffer (no copy; on a GPU it is the device-to-host
copy every save needs), so *extra* is what the save holds beyond the host
snapshot: packs being joined and uploaded, TensorStore's write buffers, the
records. Its bound in the packed layout is ``(objects_in_flight + 1) ×
max_object_bytes`` (the uploads in flight, each a copy inside TensorStore,
and the one being joined), plus the clients' own state. Every
store is measured for both layouts side by side in one run; the S3 root is
a fresh moto on loopback per row (it holds the objects in its own process,
not the child's).

Usage: ``python scripts/bench.py savemem [--gib 6] [--stores local,s3] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchkit import servers
from benchkit.common import REPO, write_json_rows
from benchkit.stores import endpoints_env

MiB, GiB = 1 << 20, 1 << 30
LAYOUTS = ("packed", "plain")
TARGET = 0.3
"""The issue's bound: a save's extra host memory at most this times the state."""


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import jaxckpt
    from benchkit.measure import PeakRss

    leaves = max(1, round(spec["gib"] * GiB / (spec["leaf_mib"] * MiB)))
    n = int(spec["leaf_mib"] * MiB) // 4
    key = jax.random.key(0)
    state = {
        f"l{i:03d}": jax.random.normal(jax.random.fold_in(key, i), (n,)) for i in range(leaves)
    }
    state["step"] = jnp.asarray(7)
    jax.block_until_ready(state)
    nbytes = sum(v.nbytes for v in state.values())
    with jaxckpt.CheckpointManager(spec["root"], layout=spec["layout"], gc_on_open=False) as mgr:
        options = mgr.options
        with PeakRss() as rss:
            t0 = time.perf_counter()
            mgr.save(1, state)
            mgr.wait()
            seconds = time.perf_counter() - t0
    bound = (options.objects_in_flight + 1) * options.max_object_bytes
    return {
        "state_bytes": nbytes,
        "leaves": len(state),
        "save_s": seconds,
        "extra_bytes": rss.extra,
        "extra_ratio": rss.extra / nbytes,
        "packed_bound_bytes": bound,
    }


def _run_child(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    argv = [
        sys.executable,
        str(REPO / "scripts" / "bench.py"),
        "savemem",
        "--child",
        json.dumps(spec),
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"savemem child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(lines[-1]))


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| store | layout | state | save (s) | peak extra | extra / state | packed bound |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['store']} | {r['layout']} | {r['state_bytes'] / GiB:.2f} GiB "
            f"| {r['save_s']:.2f} | {r['extra_bytes'] / MiB:,.0f} MiB | {r['extra_ratio']:.2f}× "
            f"| {r['packed_bound_bytes'] / MiB:,.0f} MiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py savemem", description=__doc__.split("\n", 1)[0])
    p.add_argument("--gib", type=float, default=6.0, help="the state's size")
    p.add_argument("--leaf-mib", type=float, default=64.0, help="each leaf's size")
    p.add_argument("--stores", default="local,s3")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(_child(json.loads(args.child))), flush=True)
        return 0
    stores = args.stores.split(",")
    if set(stores) - {"local", "s3"}:
        p.error("--stores: local and/or s3")
    scratch = Path(tempfile.mkdtemp(prefix="bench-savemem-"))
    servers.isolate_cloud_env(os.environ, str(scratch))
    env = dict(os.environ)
    rows: list[dict[str, Any]] = []
    try:
        for store in stores:
            for layout in args.layouts.split(","):
                # A fresh moto per row: it keeps every object in its memory.
                server = servers.start_moto(scratch) if store == "s3" else None
                try:
                    name = f"{layout}-{uuid.uuid4().hex[:6]}"
                    if server is not None:
                        env.update(endpoints_env(server.endpoint, server.endpoint))
                        root = f"s3://{server.bucket}/{name}"
                    else:
                        root = str(scratch / name)
                    spec = {"root": root, "layout": layout, "gib": args.gib,
                            "leaf_mib": args.leaf_mib}  # fmt: skip
                    rows.append({"store": store, "layout": layout, **_run_child(spec, env)})
                    print(json.dumps(rows[-1]), flush=True)
                finally:
                    if server is not None:
                        server.stop()
                    else:
                        shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(markdown(rows))
    over = [r for r in rows if r["layout"] == "packed" and r["extra_ratio"] > TARGET]
    print(f"target: packed extra ≤ {TARGET}× the state: {'met' if not over else 'MISSED'}")
    write_json_rows(args.json, rows)
    return 0
