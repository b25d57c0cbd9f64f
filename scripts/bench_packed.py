"""Plain vs packed layout (and Orbax's OCDBT default): objects, requests, save and restore speed.

Two states, the issue's cluster-scale shapes at benchmark size:

* ``many``: 1,000 leaves of 64 KiB (float32) on one device, 62.5 MiB;
* ``sharded``: 200 leaves of 32 KiB sharded over 8 devices, 6.25 MiB.

Each is saved and restored ``--rounds`` times (fresh step each round; the
median is reported) with ``layout="plain"`` and ``layout="packed"`` on a local
directory and on loopback S3 (moto_server) and GCS (the emulator), both started
here through ``tests/servers.py``; Orbax's ``StandardCheckpointer`` (OCDBT, its
default) on the local directory only (Orbax 0.12 refuses ``s3://`` roots, see
NOTES). *objects* are the keys a save added under the root; *requests* are the
HTTP requests the server logged during the save or the restore (object stores
only). The machine is shared: compare ratios within one run.

Usage: ``python scripts/bench_packed.py [--rounds 3] [--json results/bench_packed.json]``
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import importlib.util
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._storage import open_storage

REPO = Path(__file__).resolve().parents[1]
_REQUEST = re.compile(rb'"(?:\x1b\[[0-9;]*m)*(GET|PUT|POST|DELETE|HEAD|PATCH) ')


def many_leaves() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    device = jax.devices()[0]
    return {
        f"l{i:04d}": jax.device_put(rng.standard_normal(16384, dtype=np.float32), device)
        for i in range(1000)
    }


def sharded_leaves() -> dict[str, Any]:
    rng = np.random.default_rng(1)
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    sharding = NamedSharding(mesh, P("fsdp"))
    return {
        f"l{i:03d}": jax.device_put(rng.standard_normal(8192, dtype=np.float32), sharding)
        for i in range(200)
    }


def nbytes(state: dict[str, Any]) -> int:
    return sum(x.nbytes for x in state.values())


def _servers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_bench_servers", REPO / "tests" / "servers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@contextmanager
def object_stores(log_dir: Path) -> Iterator[dict[str, tuple[str, Path]]]:
    """Starts moto and the GCS emulator; yields ``{kind: (bucket URI, server log)}``."""
    servers = _servers()
    servers.isolate_cloud_env(os.environ, str(log_dir))
    s3 = servers.start_moto(log_dir)
    try:
        gcs = servers.start_gcs_emulator(log_dir)
    except BaseException:
        s3.stop()
        raise
    os.environ.update(
        AWS_ENDPOINT_URL_S3=s3.endpoint,
        STORAGE_EMULATOR_HOST=gcs.endpoint,
        TENSORSTORE_GCS_HTTP_URL=gcs.endpoint,
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    try:
        yield {
            "s3": (f"s3://{s3.bucket}", s3.log_path),
            "gcs": (f"gs://{gcs.bucket}", gcs.log_path),
        }
    finally:
        gcs.stop()
        s3.stop()


class RequestCounter:
    """Counts HTTP request lines a server logged since the last call."""

    def __init__(self, log: Path | None) -> None:
        self._log = log
        self._seen = self._count()

    def _count(self) -> int:
        return 0 if self._log is None else len(_REQUEST.findall(self._log.read_bytes()))

    def delta(self) -> int | None:
        if self._log is None:
            return None
        time.sleep(0.2)  # let the server flush its log
        now = self._count()
        seen, self._seen = self._seen, now
        return now - seen


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_jaxckpt(
    root: str, log: Path | None, layout: str, state: dict[str, Any], rounds: int
) -> dict[str, Any]:
    storage = open_storage(root)
    rows: list[dict[str, Any]] = []
    with jaxckpt.CheckpointManager(root, layout=layout, gc_on_open=False) as mgr:
        counter = RequestCounter(log)
        for step in range(1, rounds + 1):
            before = set(storage.list(""))
            counter.delta()

            def save(step: int = step) -> None:
                mgr.save(step, state)
                mgr.wait()

            save_s, _ = _timed(save)
            save_requests = counter.delta()
            objects = len(set(storage.list("")) - before)
            restore_s, out = _timed(lambda step=step: mgr.restore(step, target=state))
            jax.block_until_ready(out)
            restore_requests = counter.delta()
            assert all(
                np.array_equal(np.asarray(out[k]), np.asarray(state[k])) for k in list(state)[:5]
            )
            rows.append(
                {
                    "objects": objects,
                    "save_requests": save_requests,
                    "restore_requests": restore_requests,
                    "save_s": save_s,
                    "restore_s": restore_s,
                }
            )
    return _summary(rows, nbytes(state))


def run_orbax(root: str, state: dict[str, Any], rounds: int) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    rows = []
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    with ocp.StandardCheckpointer() as ckptr:
        for step in range(1, rounds + 1):
            path = Path(root, str(step))

            def save(path: Path = path) -> None:
                ckptr.save(path, state)
                ckptr.wait_until_finished()

            save_s, _ = _timed(save)
            objects = sum(1 for p in path.rglob("*") if p.is_file())
            restore_s, out = _timed(lambda path=path: ckptr.restore(path, target))
            jax.block_until_ready(out)
            rows.append(
                {
                    "objects": objects,
                    "save_requests": None,
                    "restore_requests": None,
                    "save_s": save_s,
                    "restore_s": restore_s,
                }
            )
    return _summary(rows, nbytes(state))


def _summary(rows: list[dict[str, Any]], size: int) -> dict[str, Any]:
    save_s = statistics.median(r["save_s"] for r in rows)
    restore_s = statistics.median(r["restore_s"] for r in rows)
    return {
        "objects": rows[-1]["objects"],
        "save_requests": rows[-1]["save_requests"],
        "restore_requests": rows[-1]["restore_requests"],
        "save_s": save_s,
        "restore_s": restore_s,
        "save_mbps": size / save_s / 1e6,
        "restore_mbps": size / restore_s / 1e6,
    }


def markdown(results: list[dict[str, Any]]) -> str:
    head = (
        "| state | backend | layout | objects | save requests | restore requests "
        "| save (MB/s) | restore (MB/s) |\n|---|---|---|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in results:
        req = [
            ("-" if r[k] is None else f"{r[k]:,}") for k in ("save_requests", "restore_requests")
        ]
        lines.append(
            f"| {r['state']} | {r['backend']} | {r['layout']} | {r['objects']:,} | {req[0]} "
            f"| {req[1]} | {r['save_mbps']:.1f} | {r['restore_mbps']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--no-object-stores", action="store_true", help="local directory only")
    p.add_argument("--states", default="many,sharded")
    args = p.parse_args(argv)
    assert jax.device_count() >= 8, jax.devices()
    builders = {"many": many_leaves, "sharded": sharded_leaves}
    scratch = Path(tempfile.mkdtemp(prefix="bench-packed-"))
    results: list[dict[str, Any]] = []
    try:
        stores: dict[str, tuple[str, Path | None]] = {"local": (str(scratch / "local"), None)}
        with contextlib_nullable(not args.no_object_stores, scratch) as extra:
            stores.update(extra)
            for name in args.states.split(","):
                state = builders[name]()
                for backend, (base, log) in stores.items():
                    for layout in ("plain", "packed"):
                        root = f"{base.rstrip('/')}/{name}-{layout}-{uuid.uuid4().hex[:6]}"
                        row = run_jaxckpt(root, log, layout, state, args.rounds)
                        results.append({"state": name, "backend": backend, "layout": layout, **row})
                        print(json.dumps(results[-1]), flush=True)
                    if backend == "local":
                        row = run_orbax(str(scratch / f"orbax-{name}"), state, args.rounds)
                        results.append(
                            {"state": name, "backend": backend, "layout": "orbax-ocdbt", **row}
                        )
                        print(json.dumps(results[-1]), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(markdown(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


@contextmanager
def contextlib_nullable(enabled: bool, scratch: Path) -> Iterator[dict[str, tuple[str, Path]]]:
    if not enabled:
        yield {}
        return
    log_dir = scratch / "servers"
    log_dir.mkdir()
    with object_stores(log_dir) as stores:
        yield dict(stores)


if __name__ == "__main__":
    sys.exit(main())
