"""Metadata cost at scale: every per-step operation on roots with 10, 1,000 and 10,000 steps.

Measures, side by side in one run on a loopback S3 server (moto) and a local
directory, opening a manager, ``latest_step()``, ``steps()``, ``restore()`` of the
newest step, ``restore(step)`` of it by number, one save until it is committed,
and ``jaxckpt ls``, each on roots holding each number of committed steps, and
prints a Markdown table of medians and the largest/smallest ratio (the target:
roughly constant in the number of steps, except ``steps()`` and ``ls``, which
return every step).

    python scripts/bench.py listing [--steps 10,1000,10000] [--repeats 5] [--json OUT]
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

from benchkit import servers
from benchkit.stores import loopback_endpoint


@contextlib.contextmanager
def s3_bucket(log_dir: Path, endpoint: str | None = None) -> Iterator[str]:
    """A bucket on ``endpoint`` (a running loopback server) or on a moto_server started here."""
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
    """A root with ``steps`` committed steps: the first and the last saved, the others' markers
    copied from the first (their data is never read here)."""
    import numpy as np

    import jaxckpt
    from jaxckpt.commit import CommitProtocol
    from jaxckpt.records import latest_hint_key
    from jaxckpt.storage import open_storage

    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": np.arange(1024.0)})
    storage = open_storage(root)
    marker = CommitProtocol(storage).require_marker(1)
    copies = [type(marker)(**{**marker.__dict__, "step": s}) for s in range(2, steps + 1)]
    copies = copies[:-1]  # the last step is saved for real below
    CommitProtocol(storage).map(lambda m: storage.write(m.key, m.to_bytes()), copies)
    if copies:
        storage.write(latest_hint_key(marker.epoch), str(copies[-1].step).encode())  # as a commit
    if steps > 1:
        with jaxckpt.CheckpointManager(root) as mgr:
            mgr.save(steps, {"w": np.arange(1024.0)})


def median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(root: str, repeats: int) -> dict[str, float]:
    import numpy as np

    import jaxckpt
    from jaxckpt import cli

    reader = jaxckpt.CheckpointManager(root, read_only=True)
    newest = reader.latest_step()
    assert newest is not None, root

    def ls() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            cli.main(["ls", root])

    def open_writable() -> None:
        jaxckpt.CheckpointManager(root).close()

    results = {
        "latest_step()": median_s(reader.latest_step, repeats),
        "steps()": median_s(reader.steps, repeats),
        "restore() newest": median_s(reader.restore, repeats),
        "restore(step)": median_s(lambda: reader.restore(newest), repeats),
        "open (writable)": median_s(open_writable, repeats),
        "jaxckpt ls": median_s(ls, repeats),
    }
    with jaxckpt.CheckpointManager(root) as writer:
        state = {"w": np.arange(1024.0)}
        next_step = iter(range(newest + 1, newest + 1 + repeats))

        def save() -> None:
            writer.save(next(next_step), state, force=True)
            writer.wait()

        results["save until committed"] = median_s(save, repeats)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py listing", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--steps",
        type=lambda v: [int(n) for n in v.split(",")],
        default=[10, 1000, 10000],
        help="comma-separated numbers of committed steps (default 10,1000,10000)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--s3-endpoint", help="use this running loopback S3 server, start none")
    args = p.parse_args(argv)
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, s3_bucket(Path(tmp), args.s3_endpoint) as bucket:
        for backend, base in (("local", tmp), ("s3", bucket)):
            results[backend] = {}
            for n in args.steps:
                root = f"{base}/listing-{uuid.uuid4().hex}"
                fill(root, n)
                results[backend][str(n)] = measure(root, args.repeats)
    few, many = str(min(args.steps)), str(max(args.steps))
    columns = " | ".join(f"{n} steps (ms)" for n in args.steps)
    rows = [f"| backend | operation | {columns} | ratio |"]
    rows.append("|---|---|" + "---:|" * (len(args.steps) + 1))
    for backend, by_n in results.items():
        for op in by_n[few]:
            cells = " | ".join(f"{by_n[str(n)][op] * 1e3:.1f}" for n in args.steps)
            ratio = by_n[many][op] / by_n[few][op]
            rows.append(f"| {backend} | {op} | {cells} | {ratio:.2f}x |")
    print("\n".join(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
