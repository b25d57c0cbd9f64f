"""Object-store clients side by side: jaxckpt direct reads vs obstore; TensorStore vs obstore PUTs.

The restore reads chunks (plain) and spans of packs (packed) as ranged GETs
over jaxckpt's own HTTP client (``jaxckpt.storage._http``, through
``ObjectStorage.read_range`` and ``storage._ranged``), ``READ_WORKERS`` at once
from the ``read`` pool. The question here is whether a well-kept library, obstore
(Rust ``object_store`` behind Python bindings), does better on the same
requests. Against moto, bare and behind :class:`benchkit.shaper.Shaper`, this
reads the same ranges with the same concurrency through

* ``jaxckpt``: ``ObjectStorage.read_range`` on ``--concurrency`` threads of the
  ``read`` pool, as ``_chunkread`` does (the run fails unless every range
  went over the direct reader, none through TensorStore);
* ``obstore``: ``obstore.get_range_async`` per range, ``concurrency`` at once
  (an ``asyncio.Semaphore``), on an ``S3Store`` pointed at the loopback
  endpoint (``allow_http``, path-style, moto's dummy credentials);
* ``obstore-ranges``: ``obstore.get_ranges`` per object with coalescing off
  (``coalesce=0``: the same requests), the library's own concurrency (up to
  10 requests per call), one call per object after another.

Workloads (``--reads``): ``big`` 64 × 1 MiB and ``small`` 1,000 × 16 KiB,
spread over ``--objects`` objects (4), 4 KiB apart (so that no client merges
two into one request). Each client is opened, and reads one range, before
it is timed (credentials, the first connection). Then the write side
(``--writes``; ``''`` skips it) at the same profiles: ``one`` 64 MiB object
and ``many`` 16 × 4 MiB objects, through TensorStore's s3 kvstore (one PUT
per value, every value in flight) and obstore's ``put_async`` (one PUT per
object, and for the big one also a multipart upload of ``--part-mib`` parts,
12 in flight).

Profiles as ``bench.py cloud``'s: ``bare`` (the proxy alone) and ``20ms`` (10
ms each way, 25 MB/s per connection, 200 MB/s in all, no handshake charged:
moto closes every connection after its response, which a kept-alive
connection to a real store would not pay for).

Each contender's rounds are interleaved (``jaxckpt, obstore, obstore-ranges,
jaxckpt, ...``) so that the shared machine's drifts hit all alike; medians
are reported, with the requests and connections the proxy saw in the last
round. Every read is checked against the bytes written, every write by a
HEAD of its size. The clients run in one child process, the proxy in this
one (in-process, its Python threads would hold the GIL against jaxckpt's
Python client and not against obstore's Rust one), moto in its own. MB/s is
10^6 bytes per second; *CPU s* is the child's CPU time during the transfer.
On bare loopback moto serves a few hundred small requests per second, which
bounds every client alike.

Usage: ``python scripts/bench.py readclient [--profiles bare,20ms] [--json out.json]``
(obstore is in the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchkit import servers
from benchkit.cloud import parse_profiles
from benchkit.common import write_json_rows
from benchkit.shaper import Shaper

KiB, MiB = 1 << 10, 1 << 20
READERS = ("jaxckpt", "obstore", "obstore-ranges")
WRITERS = ("tensorstore", "obstore", "obstore-multipart")


@dataclass(frozen=True)
class Workload:
    """``count`` transfers of ``size`` bytes (reads: ranges tiling ``objects`` objects)."""

    name: str
    count: int
    size: int

    @property
    def nbytes(self) -> int:
        return self.count * self.size


def parse_workloads(spec: str, names: Sequence[str]) -> list[Workload]:
    """``COUNTxSIZE`` items (SIZE in KiB or MiB: ``64x1MiB``), comma-separated, named in order.

    >>> parse_workloads("64x1MiB,1000x16KiB", ["big", "small"])[1]
    Workload(name='small', count=1000, size=16384)
    """
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if len(items) > len(names):
        raise SystemExit(f"{spec!r}: at most {len(names)} workloads ({', '.join(names)})")
    out = []
    for name, item in zip(names, items, strict=False):
        count, _, size = item.partition("x")
        unit = {"KiB": KiB, "MiB": MiB}.get(size[-3:])
        if not count.isdigit() or unit is None:
            raise SystemExit(f"workload {item!r}: expected COUNTxSIZE, e.g. 64x1MiB or 1000x16KiB")
        out.append(Workload(name, int(count), round(float(size[:-3]) * unit)))
    return out


# ---- reads ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ranges:
    """The ranged reads of one workload: ``(object key, offset, size)`` tiling the objects."""

    prefix: str
    reads: tuple[tuple[str, int, int], ...]
    digests: tuple[str, ...]
    """SHA-256 of the expected bytes of each read."""


GAP_BYTES = 4 << 10
"""Bytes between two ranges of one object, so that no client merges them into one request."""


def upload_ranges(client: Any, bucket: str, w: Workload, objects: int) -> Ranges:
    """Writes ``objects`` objects of random bytes holding ``w``'s ranges (straight to moto).

    The ranges are :data:`GAP_BYTES` apart: every client sends one GET per range.
    """
    import numpy as np

    rng = np.random.default_rng(w.count)
    prefix = f"readclient/{w.name}-{uuid.uuid4().hex[:6]}"
    per_object = -(-w.count // objects)
    reads: list[tuple[str, int, int]] = []
    digests: list[str] = []
    for i in range(objects):
        n = min(per_object, w.count - len(reads))
        if n <= 0:
            break
        stride = w.size + GAP_BYTES
        data = rng.integers(0, 256, n * stride, dtype=np.uint8).tobytes()
        key = f"obj{i}.bin"
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=data)
        for j in range(n):
            reads.append((key, j * stride, w.size))
            digests.append(hashlib.sha256(data[j * stride : j * stride + w.size]).hexdigest())
    return Ranges(prefix, tuple(reads), tuple(digests))


def _check(ranges: Ranges, got: Sequence[Any], reader: str) -> None:
    """Raises unless ``got`` holds exactly the bytes of every range."""
    if len(got) != len(ranges.reads):
        raise AssertionError(f"{reader} returned {len(got)} of {len(ranges.reads)} ranges")
    for (key, offset, _), data, expected in zip(ranges.reads, got, ranges.digests, strict=True):
        if hashlib.sha256(memoryview(data).cast("B")).hexdigest() != expected:
            raise AssertionError(f"{reader} read wrong bytes of {key} at {offset}")


Reader = Callable[[Ranges, int], list[Any]]
"""Reads every range of a workload, ``concurrency`` at once, with a client opened beforehand."""


def jaxckpt_reader(endpoint: str, bucket: str, prefix: str) -> Reader:
    """``read_range`` of every range on the ``read`` pool, as the restore's ``_chunkread``."""
    from jaxckpt import _pools as pools
    from jaxckpt.storage import ObjectStoreOptions, open_storage

    storage: Any = open_storage(f"s3://{bucket}/{prefix}", ObjectStoreOptions(endpoint=endpoint))
    direct = storage._ranged.direct  # opening sends no request
    if direct is None or not direct.enabled:
        raise RuntimeError("jaxckpt's direct reader is off (botocore missing or a proxy set)")

    def read(ranges: Ranges, concurrency: int) -> list[Any]:
        before, failed = direct.reads, direct.failed
        with pools.borrow("read", concurrency) as pool:
            futures = [pool.submit(storage.read_range, k, off, n) for k, off, n in ranges.reads]
            out = [f.result() for f in futures]
        if direct.reads - before != len(ranges.reads) or direct.failed != failed:
            raise RuntimeError("some direct reads failed (and were read through TensorStore)")
        return out

    return read


def obstore_store(endpoint: str, bucket: str, prefix: str) -> Any:
    """An ``S3Store`` of ``bucket/prefix`` at the loopback ``endpoint``, path-style, signed."""
    from obstore.store import S3Store

    return S3Store(
        bucket,
        prefix=prefix,
        endpoint=endpoint,
        region="us-east-1",
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )


def obstore_reader(endpoint: str, bucket: str, prefix: str) -> Reader:
    """``get_range_async`` per range, ``concurrency`` at once."""
    import obstore

    store = obstore_store(endpoint, bucket, prefix)

    def read(ranges: Ranges, concurrency: int) -> list[Any]:
        async def run() -> list[Any]:
            gate = asyncio.Semaphore(concurrency)

            async def one(key: str, offset: int, size: int) -> Any:
                async with gate:
                    return await obstore.get_range_async(store, key, start=offset, length=size)

            return list(await asyncio.gather(*(one(*r) for r in ranges.reads)))

        return asyncio.run(run())

    return read


def obstore_ranges_reader(endpoint: str, bucket: str, prefix: str) -> Reader:
    """``get_ranges`` per object, coalescing off (its own concurrency: up to 10)."""
    import obstore

    store = obstore_store(endpoint, bucket, prefix)

    def read(ranges: Ranges, concurrency: int) -> list[Any]:
        by_key: dict[str, list[tuple[int, int]]] = {}
        for key, offset, size in ranges.reads:
            by_key.setdefault(key, []).append((offset, size))
        out: list[Any] = []
        for key, spans in by_key.items():  # the reads are in key order already
            starts, lengths = [s for s, _ in spans], [n for _, n in spans]
            out += obstore.get_ranges(store, key, starts=starts, lengths=lengths, coalesce=0)
        return out

    return read


READ_CLIENTS: dict[str, Callable[[str, str, str], Reader]] = {
    "jaxckpt": jaxckpt_reader,
    "obstore": obstore_reader,
    "obstore-ranges": obstore_ranges_reader,
}


# ---- writes ---------------------------------------------------------------------------------


def write_tensorstore(endpoint: str, bucket: str, prefix: str, blobs: list[bytes], _: int) -> None:
    """TensorStore's s3 kvstore: one PUT per value, every value in flight (32 at most)."""
    import tensorstore as ts

    spec = {"driver": "s3", "bucket": bucket, "path": prefix + "/", "endpoint": endpoint,
            "aws_region": "us-east-1"}  # fmt: skip
    kv = ts.KvStore.open(spec, context=ts.Context({"s3_request_concurrency": {"limit": 32}}))
    store = kv.result()
    for future in [store.write(f"w{i}.bin", blob) for i, blob in enumerate(blobs)]:
        future.result()


def _obstore_put(multipart: bool) -> Callable[[str, str, str, list[bytes], int], None]:
    def write(endpoint: str, bucket: str, prefix: str, blobs: list[bytes], part: int) -> None:
        import obstore

        store = obstore_store(endpoint, bucket, prefix)

        async def run() -> None:
            await asyncio.gather(*(
                obstore.put_async(store, f"w{i}.bin", blob, use_multipart=multipart,
                                  chunk_size=part, max_concurrency=12)
                for i, blob in enumerate(blobs)
            ))  # fmt: skip

        asyncio.run(run())

    return write


WRITE_CLIENTS: dict[str, Callable[[str, str, str, list[bytes], int], None]] = {
    "tensorstore": write_tensorstore,
    "obstore": _obstore_put(False),
    "obstore-multipart": _obstore_put(True),
}


# ---- the run --------------------------------------------------------------------------------


def _through(shaper: Shaper, client: str) -> dict[str, int]:
    """The proxy's counts since the last reset; raises if ``client`` went around the proxy."""
    counts = shaper.counts(reset=True)
    if not counts["requests"]:
        raise RuntimeError(f"{client} sent no request through the proxy at {shaper.endpoint}")
    return counts


def _row(
    profile: str, op: str, w: Workload, client: str, timed: list[tuple[float, float]],
    counts: dict[str, int],
) -> dict[str, Any]:  # fmt: skip
    seconds, cpu = [t for t, _ in timed], [c for _, c in timed]
    median = statistics.median(seconds)
    return {
        "profile": profile, "op": op, "workload": w.name, "count": w.count, "size": w.size,
        "bytes": w.nbytes, "client": client, "seconds": median, "mb_per_s": w.nbytes / median / 1e6,
        "cpu_s": statistics.median(cpu), "rounds": len(seconds), "requests": counts["requests"],
        "connections": counts["connections"],
    }  # fmt: skip


# The clients run in one child process: the shaper's threads here would otherwise take
# the GIL from jaxckpt's Python client and not from obstore's Rust one.
_OPEN: dict[str, Reader] = {}


def _child_open(reader: str, endpoint: str, bucket: str, warm: Ranges) -> None:
    """Opens ``reader`` in the child and reads ``warm`` (credentials, first connection)."""
    _OPEN[reader] = READ_CLIENTS[reader](endpoint, bucket, warm.prefix)
    _check(warm, _OPEN[reader](warm, 1), reader)


def _child_read(reader: str, ranges: Ranges, concurrency: int) -> tuple[float, float]:
    """``(seconds, CPU seconds)`` of one timed read of every range, checked afterwards."""
    t0, c0 = time.perf_counter(), time.process_time()
    got = _OPEN[reader](ranges, concurrency)
    timed = time.perf_counter() - t0, time.process_time() - c0
    _check(ranges, got, reader)
    return timed


def _child_write(
    writer: str, endpoint: str, bucket: str, prefix: str, w: Workload, part_bytes: int
) -> tuple[float, float]:
    """``(seconds, CPU seconds)`` of one timed write of ``w`` (its bytes made beforehand)."""
    import numpy as np

    rng = np.random.default_rng(w.count)
    blobs = [rng.integers(0, 256, w.size, dtype=np.uint8).tobytes() for _ in range(w.count)]
    t0, c0 = time.perf_counter(), time.process_time()
    WRITE_CLIENTS[writer](endpoint, bucket, prefix, blobs, part_bytes)
    return time.perf_counter() - t0, time.process_time() - c0


def run_reads(
    child: Executor, shaper: Shaper, bucket: str, ranges: dict[str, Ranges],
    workloads: list[Workload], readers: Sequence[str], concurrency: int, rounds: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every reader's rounds of every workload, interleaved, in ``child``."""
    rows = []
    for w in workloads:
        timed: dict[str, list[tuple[float, float]]] = {r: [] for r in readers}
        counts: dict[str, dict[str, int]] = {}
        r = ranges[w.name]
        warm = dataclasses.replace(r, reads=r.reads[:1], digests=r.digests[:1])
        for reader in readers:
            child.submit(_child_open, reader, shaper.endpoint, bucket, warm).result()
        for _ in range(rounds):
            for reader in readers:
                shaper.counts(reset=True)
                timed[reader].append(child.submit(_child_read, reader, r, concurrency).result())
                counts[reader] = _through(shaper, reader)
        for reader in readers:
            rows.append(_row(shaper.profile.name, "read", w, reader, timed[reader],
                             counts[reader]))  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def run_writes(
    child: Executor, shaper: Shaper, client: Any, bucket: str, workloads: list[Workload],
    writers: Sequence[str], part_bytes: int, rounds: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every writer's rounds of every workload in ``child``; ``client`` (boto3, unshaped)
    checks the sizes written."""
    rows = []
    for w in workloads:
        timed: dict[str, list[tuple[float, float]]] = {c: [] for c in writers}
        counts: dict[str, dict[str, int]] = {}
        for _ in range(rounds):
            for writer in writers:
                if writer == "obstore-multipart" and w.count > 1:
                    continue  # multipart is for the one big object
                prefix = f"writeclient/{w.name}-{writer}-{uuid.uuid4().hex[:6]}"
                shaper.counts(reset=True)
                job = child.submit(
                    _child_write, writer, shaper.endpoint, bucket, prefix, w, part_bytes
                )
                timed[writer].append(job.result())
                counts[writer] = _through(shaper, writer)
                for i in range(w.count):
                    head = client.head_object(Bucket=bucket, Key=f"{prefix}/w{i}.bin")
                    if head["ContentLength"] != w.size:
                        raise AssertionError(f"{writer} wrote {head['ContentLength']} bytes")
        for writer in writers:
            if timed[writer]:
                rows.append(_row(shaper.profile.name, "write", w, writer, timed[writer],
                                 counts[writer]))  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| profile | op | workload | client | seconds | MB/s | vs first | CPU s | requests "
        "| connections |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    first: dict[tuple[str, str, str], float] = {}
    for r in rows:
        base = first.setdefault((r["profile"], r["op"], r["workload"]), r["seconds"])
        size = f"{r['size'] / MiB:g} MiB" if r["size"] >= MiB else f"{r['size'] / KiB:g} KiB"
        lines.append(
            f"| {r['profile']} | {r['op']} | {r['count']:,} × {size} | {r['client']} "
            f"| {r['seconds']:.3f} | {r['mb_per_s']:.1f} | {base / r['seconds']:.2f}× "
            f"| {r['cpu_s']:.2f} | {r['requests']:,} | {r['connections']:,} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py readclient", description=__doc__.split("\n", 1)[0])
    p.add_argument("--profiles", default="bare,20ms", help="as bench.py cloud's")
    p.add_argument("--latency-ms", type=float, default=10.0, help="one-way latency of 20ms")
    p.add_argument("--conn-mbps", type=float, default=25.0, help="MB/s per connection")
    p.add_argument("--total-mbps", type=float, default=200.0, help="MB/s all connections")
    p.add_argument("--reads", default="64x1MiB,1000x16KiB", help="big,small: COUNTxSIZE")
    p.add_argument("--objects", type=int, default=4, help="objects the ranges of a workload tile")
    p.add_argument("--concurrency", type=int, default=8, help="reads in flight (READ_WORKERS)")
    p.add_argument("--writes", default="1x64MiB,16x4MiB", help="one,many: COUNTxSIZE; '' for none")
    p.add_argument("--part-mib", type=float, default=8.0,
                   help="obstore multipart part (S3: 5 MiB or more)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    profiles = parse_profiles(args.profiles, args.latency_ms, args.conn_mbps, args.total_mbps)
    reads = parse_workloads(args.reads, ["big", "small"])
    writes = parse_workloads(args.writes, ["one", "many"])
    if args.concurrency < 1 or args.objects < 1 or args.rounds < 1:
        p.error("--concurrency, --objects and --rounds must be at least 1")
    scratch = Path(tempfile.mkdtemp(prefix="bench-readclient-"))
    servers.isolate_cloud_env(os.environ, str(scratch))
    os.environ.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    rows: list[dict[str, Any]] = []
    server = servers.start_moto(scratch)
    try:
        # Uploads and checks go to moto unshaped. No AWS_ENDPOINT_URL_S3 in the environment:
        # obstore would take it over the endpoint it is given.
        client = servers.s3_client(server.endpoint)
        ranges = {w.name: upload_ranges(client, server.bucket, w, args.objects) for w in reads}
        spawn = multiprocessing.get_context("spawn")  # after the environment is set
        with ProcessPoolExecutor(1, mp_context=spawn) as child:
            for profile in profiles:
                with Shaper(server.endpoint, profile) as shaper:
                    rows += run_reads(child, shaper, server.bucket, ranges, reads, READERS,
                                      args.concurrency, args.rounds)  # fmt: skip
                    rows += run_writes(child, shaper, client, server.bucket, writes, WRITERS,
                                       round(args.part_mib * MiB), args.rounds)  # fmt: skip
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    print(markdown(rows))
    write_json_rows(args.json, rows)
    return 0
