"""Listing at scale: ``latest_step()``, ``steps()``, opening a manager and ``jaxckpt ls``.

Measures, side by side in one run on a loopback S3 server (moto) and a local
directory, each operation on a root with few and with many committed steps,
and prints a Markdown table of medians and the many/few ratio (the target:
``latest_step()`` at 300 steps within 3x of its time at 3 steps).

    python scripts/bench.py listing [--few 3] [--many 300] [--repeats 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchkit.stores import load_test_servers, loopback_endpoint


@contextlib.contextmanager
def s3_bucket(log_dir: Path, endpoint: str | None = None) -> Iterator[str]:
    """A bucket on ``endpoint`` (a running loopback server) or on a moto_server started here."""
    servers = load_test_servers()
    servers.isolate_cloud_env(os.environ, str(log_dir))
    if endpoint:
        os.environ["AWS_ENDPOINT_URL_S3"] = loopback_endpoint(endpoint)
        yield f"s3://{servers.BUCKET}"
        return
    server = servers.start_moto(log_dir)
    os.environ["AWS_ENDPOINT_URL_S3"] = server.endpoint
    try:
        yield f"s3://{server.bucket}"
    finally:
        server.stop()


def fill(root: str, steps: int) -> None:
    """A root with ``steps`` committed steps: one saved, the others' markers copied from it."""
    import numpy as np

    import jaxckpt
    from jaxckpt._commit import CommitProtocol
    from jaxckpt._layout import latest_hint_key
    from jaxckpt._storage import open_storage

    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": np.arange(1024.0)})
    storage = open_storage(root)
    marker = CommitProtocol(storage).require_marker(1)
    copies = [type(marker)(**{**marker.__dict__, "step": s}) for s in range(2, steps + 1)]
    CommitProtocol(storage).map(lambda m: storage.write(m.key, m.to_bytes()), copies)
    storage.write(latest_hint_key(marker.epoch), str(steps).encode())  # as a committer does


def median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(root: str, repeats: int) -> dict[str, float]:
    import jaxckpt
    from jaxckpt import cli

    reader = jaxckpt.CheckpointManager(root, read_only=True)

    def ls() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            cli.main(["ls", root])

    def open_writable() -> None:
        jaxckpt.CheckpointManager(root).close()

    return {
        "latest_step()": median_s(reader.latest_step, repeats),
        "steps()": median_s(reader.steps, repeats),
        "open (writable)": median_s(open_writable, repeats),
        "jaxckpt ls": median_s(ls, repeats),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py listing", description=__doc__.split("\n\n")[0])
    p.add_argument("--few", type=int, default=3)
    p.add_argument("--many", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--s3-endpoint", help="use this running loopback S3 server, start none")
    args = p.parse_args(argv)
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, s3_bucket(Path(tmp), args.s3_endpoint) as bucket:
        for backend, base in (("local", tmp), ("s3", bucket)):
            results[backend] = {}
            for n in (args.few, args.many):
                root = f"{base}/listing-{uuid.uuid4().hex}"
                fill(root, n)
                results[backend][str(n)] = measure(root, args.repeats)
    header = f"| backend | operation | {args.few} steps (ms) | {args.many} steps (ms) | ratio |"
    rows = [header, "|---|---|---:|---:|---:|"]
    for backend, by_n in results.items():
        for op in by_n[str(args.few)]:
            few, many = by_n[str(args.few)][op], by_n[str(args.many)][op]
            rows.append(
                f"| {backend} | {op} | {few * 1e3:.1f} | {many * 1e3:.1f} | {many / few:.2f}x |"
            )
    print("\n".join(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
