"""Plain vs packed layout vs TensorStore's OCDBT: objects, requests, save and restore speed.

Two states, the issue's cluster-scale shapes at benchmark size:

* ``many``: 1,000 leaves of 64 KiB (float32) on one device, 62.5 MiB;
* ``sharded``: 200 leaves of 32 KiB sharded over 8 devices, 6.25 MiB.

(``--tiny``: 20 leaves of 1 KiB and 10 leaves of 4 KiB, for the smoke test.)

Each is saved and restored ``--rounds`` times (fresh step each round; the
median is reported) on a local directory and on loopback S3 (moto_server) and
GCS (the emulator), both started here through ``benchkit/servers.py``, by:

* jaxckpt with ``layout="plain"`` and ``layout="packed"``;
* ``ocdbt``: the same zarr3 arrays (same chunks, ``bytes`` + ``crc32c``
  codecs, no compression of the data) written by TensorStore alone through its
  ``ocdbt`` kvstore over the same base kvstore (file, s3 or gcs), every chunk
  of a save in one TensorStore transaction from this one process, and read
  back with a fresh context onto the same shardings (what Orbax does under
  the hood, without Orbax's own files or its per-process databases and merge);
* Orbax's ``StandardCheckpointer`` (OCDBT, its default) on the local directory
  only (Orbax 0.12 refuses ``s3://`` roots, see NOTES).

*objects* are the keys a save added under the root; *requests* are the HTTP
requests the server logged during the save or the restore (object stores
only). *save RSS* and *restore RSS* are the peak growth of this process's
resident memory during a save (host snapshot, pack buffers) or a restore,
over its size before (sampled every 5 ms, after handing freed heap pages back
with ``malloc_trim``); restore RSS includes the restored state itself
(``state_mib``), so the extra memory a restore needs is the difference. The
machine is shared: compare ratios within one run.

Usage: ``python scripts/bench.py packed [--rounds 3] [--json results/bench_packed.json]``
"""

from __future__ import annotations

import os

# 8 CPU devices for the sharded state: set before jax is imported, which is why
# ``bench.py`` imports this module only for ``bench.py packed``.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import ctypes
import gc
import json
import re
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from benchkit import servers
from benchkit.common import write_json_rows
from benchkit.stores import endpoints_env, start_both
from jaxckpt.storage import open_storage

_REQUEST = re.compile(rb'"(?:\x1b\[[0-9;]*m)*(GET|PUT|POST|DELETE|HEAD|PATCH) ')


def many_leaves(tiny: bool = False) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    device = jax.devices()[0]
    count, size = (20, 256) if tiny else (1000, 16384)
    return {
        f"l{i:04d}": jax.device_put(rng.standard_normal(size, dtype=np.float32), device)
        for i in range(count)
    }


def sharded_leaves(tiny: bool = False) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    sharding = NamedSharding(mesh, P("fsdp"))
    count = 10 if tiny else 200
    size = 1024 if tiny else 8192
    return {
        f"l{i:03d}": jax.device_put(rng.standard_normal(size, dtype=np.float32), sharding)
        for i in range(count)
    }


def nbytes(state: dict[str, Any]) -> int:
    return sum(x.nbytes for x in state.values())


@contextmanager
def object_stores(log_dir: Path) -> Iterator[dict[str, tuple[str, Path]]]:
    """Starts moto and the GCS emulator; yields ``{kind: (bucket URI, server log)}``."""
    servers.isolate_cloud_env(os.environ, str(log_dir))
    s3, gcs = start_both(servers, log_dir)
    os.environ.update(endpoints_env(s3.endpoint, gcs.endpoint))
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
        # complete: each server logs a request before it answers it (send_response)
        now = self._count()
        seen, self._seen = self._seen, now
        return now - seen


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _rss() -> int:
    """This process's resident set size in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    """Hands freed heap memory back to the OS, so a restore cannot hide in reused pages."""
    gc.collect()
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _timed_rss(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """``fn``'s wall time, the peak growth of RSS while it ran, and its result."""
    _trim()
    base = peak = _rss()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.005):
            peak = max(peak, _rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        seconds, out = _timed(fn)
        jax.block_until_ready(out)
        peak = max(peak, _rss())
    finally:
        done.set()
        sampler.join(timeout=5)
    return seconds, peak - base, out


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

            save_s, save_rss, _ = _timed_rss(save)
            save_requests = counter.delta()
            objects = len(set(storage.list("")) - before)
            restore_s, restore_rss, out = _timed_rss(
                lambda step=step: mgr.restore(step, target=state)
            )
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
                    "restore_rss": restore_rss,
                    "save_rss": save_rss,
                }
            )
    return _summary(rows, nbytes(state))


def _ocdbt_spec(base: dict[str, Any], name: str, x: jax.Array) -> dict[str, Any]:
    """The zarr3 array jaxckpt would write for ``x`` (chunk = shard), inside an OCDBT database."""
    chunk = x.sharding.shard_shape(x.shape)
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "ocdbt", "base": base, "path": f"{name}/"},
        "metadata": {
            "shape": list(x.shape),
            "data_type": str(x.dtype),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
            "chunk_key_encoding": {"name": "default"},
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "crc32c"},
            ],
        },
    }


def run_ocdbt(root: str, log: Path | None, state: dict[str, Any], rounds: int) -> dict[str, Any]:
    """TensorStore alone: zarr3 over ``ocdbt`` over the root's base kvstore."""
    import tensorstore as ts

    storage = open_storage(root)
    rows = []
    counter = RequestCounter(log)
    for step in range(1, rounds + 1):
        base = storage.kvstore_spec(f"{step}/")
        before = set(storage.list(""))
        counter.delta()

        def save(base: dict[str, Any] = base) -> None:
            context = ts.Context(storage.context_spec())
            txn = ts.Transaction()
            opened = {
                name: ts.open(
                    {**_ocdbt_spec(base, name, x), "create": True},
                    context=context,
                    transaction=txn,
                )
                for name, x in state.items()
            }
            writes = []
            for name, x in state.items():
                array = opened[name].result()
                for shard in x.addressable_shards:
                    if shard.replica_id == 0:
                        writes.append(array[shard.index].write(np.asarray(shard.data)))
            for w in writes:
                w.result()
            txn.commit_async().result()

        save_s, save_rss, _ = _timed_rss(save)
        save_requests = counter.delta()
        objects = len(set(storage.list("")) - before)

        def restore(base: dict[str, Any] = base) -> dict[str, Any]:
            context = ts.Context(storage.context_spec())  # a fresh cache, as a new process
            opened = {
                name: ts.open({**_ocdbt_spec(base, name, x), "open": True}, context=context)
                for name, x in state.items()
            }
            reads = {}
            for name, x in state.items():
                array = opened[name].result()
                index = x.sharding.addressable_devices_indices_map(x.shape)
                reads[name] = [(d, array[i].read()) for d, i in index.items()]
            return {
                name: jax.make_array_from_single_device_arrays(
                    x.shape,
                    x.sharding,
                    [jax.device_put(f.result(), d) for d, f in reads[name]],
                )
                for name, x in state.items()
            }

        restore_s, restore_rss, out = _timed_rss(restore)
        restore_requests = counter.delta()
        assert all(np.array_equal(np.asarray(out[k]), np.asarray(state[k])) for k in state)
        rows.append(
            {
                "objects": objects,
                "save_requests": save_requests,
                "restore_requests": restore_requests,
                "save_s": save_s,
                "restore_s": restore_s,
                "restore_rss": restore_rss,
                "save_rss": save_rss,
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

            save_s, save_rss, _ = _timed_rss(save)
            objects = sum(1 for p in path.rglob("*") if p.is_file())
            restore_s, restore_rss, _ = _timed_rss(lambda path=path: ckptr.restore(path, target))
            rows.append(
                {
                    "objects": objects,
                    "save_requests": None,
                    "restore_requests": None,
                    "save_s": save_s,
                    "restore_s": restore_s,
                    "restore_rss": restore_rss,
                    "save_rss": save_rss,
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
        "restore_rss_mib": max(r["restore_rss"] for r in rows) / 2**20,
        "save_rss_mib": max(r["save_rss"] for r in rows) / 2**20,
        "state_mib": size / 2**20,
    }


def markdown(results: list[dict[str, Any]]) -> str:
    head = (
        "| state | backend | layout | objects | save requests | restore requests "
        "| save (MB/s) | restore (MB/s) | save RSS (MiB) | restore RSS (MiB) |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in results:
        req = [
            ("-" if r[k] is None else f"{r[k]:,}") for k in ("save_requests", "restore_requests")
        ]
        lines.append(
            f"| {r['state']} | {r['backend']} | {r['layout']} | {r['objects']:,} | {req[0]} "
            f"| {req[1]} | {r['save_mbps']:.1f} | {r['restore_mbps']:.1f} "
            f"| {r['save_rss_mib']:.1f} | {r['restore_rss_mib']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py packed", description=__doc__.split("\n", 1)[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--no-object-stores", action="store_true", help="local directory only")
    p.add_argument("--states", default="many,sharded")
    p.add_argument("--layouts", default="plain,packed,ocdbt,orbax-ocdbt")
    p.add_argument("--tiny", action="store_true", help="tiny states (the smoke test)")
    args = p.parse_args(argv)
    assert jax.device_count() >= 8, jax.devices()
    builders = {"many": many_leaves, "sharded": sharded_leaves}
    layouts = args.layouts.split(",")
    unknown = set(layouts) - {"plain", "packed", "ocdbt", "orbax-ocdbt"}
    if unknown:
        p.error(f"unknown layouts {sorted(unknown)}")
    scratch = Path(tempfile.mkdtemp(prefix="bench-packed-"))
    results: list[dict[str, Any]] = []
    try:
        stores: dict[str, tuple[str, Path | None]] = {"local": (str(scratch / "local"), None)}
        with contextlib_nullable(not args.no_object_stores, scratch) as extra:
            stores.update(extra)
            for name in args.states.split(","):
                state = builders[name](args.tiny)
                for backend, (base, log) in stores.items():
                    for layout in layouts:
                        root = f"{base.rstrip('/')}/{name}-{layout}-{uuid.uuid4().hex[:6]}"
                        if layout in ("plain", "packed"):
                            row = run_jaxckpt(root, log, layout, state, args.rounds)
                        elif layout == "ocdbt":
                            row = run_ocdbt(root, log, state, args.rounds)
                        elif backend == "local":  # orbax-ocdbt: Orbax refuses s3:// roots
                            row = run_orbax(root, state, args.rounds)
                        else:
                            continue
                        results.append({"state": name, "backend": backend, "layout": layout, **row})
                        print(json.dumps(results[-1]), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(markdown(results))
    write_json_rows(args.json, results)
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
