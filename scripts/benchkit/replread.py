"""Bytes a multi-host restore reads from storage, with and without the replicated-leaf exchange.

Saves one step from 2 processes x 2 CPU devices with ``tests/multihost_child.py``
(small sharded leaves plus two replicated ones, ``big`` and ``wide``, whose rows
``--scale`` multiplies), then restores it onto 2 x 2 and onto 4 x 1, each once
with the exchange (``jaxckpt.restoring._readonce``) and once with every process reading
all it needs (``--exchange-min-bytes`` huge: the behaviour before), side by side
in one run, on a local directory and on a loopback S3 server (moto). Bytes are
counted in each child's storage read path (array data only: chunk objects and
ranges); the restore time is ``restore()`` in the children (the slowest
process), noisy on a shared machine.

    python scripts/bench.py replread [--scale 16] [--json results/replread.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchkit import servers
from benchkit.common import REPO

CHILD = REPO / "tests" / "multihost_child.py"
OFF = str(1 << 62)  # an exchange threshold no leaf reaches
TIMEOUT_S = 600


def _free_port() -> int:
    return int(servers.free_port())


def run_group(root: str, mode: str, processes: int, devices: int, *args: str) -> list[str]:
    """Runs one group of children to the end; their stdout, by process."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCKPT_")}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(CHILD),
                f"--coordinator=127.0.0.1:{port}",
                f"--num-processes={processes}",
                f"--process-id={i}",
                f"--devices={devices}",
                f"--root={root}",
                f"--mode={mode}",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        for i in range(processes)
    ]
    try:
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        if p.returncode != 0:
            raise SystemExit(f"{mode} process {i} failed (rc={p.returncode}):\n{out}")
    return outs


def _said(out: str, prefix: str) -> str:
    (line,) = [x for x in out.splitlines() if x.startswith(prefix)]
    return line[len(prefix) :].strip()


def measure(root: str, scale: str) -> tuple[int, list[dict[str, Any]]]:
    """Saves one step to ``root`` and restores it four ways; the step's bytes and the rows."""
    run_group(root, "save", 2, 2, "--mesh=2x2", "--steps=1", scale)
    from jaxckpt.commit import CommitProtocol
    from jaxckpt.storage import open_storage

    stored = CommitProtocol(open_storage(root)).require_marker(1).nbytes
    rows: list[dict[str, Any]] = []
    for processes, devices in ((2, 2), (4, 1)):
        for exchange in (False, True):
            extra = [] if exchange else [f"--exchange-min-bytes={OFF}"]
            outs = run_group(
                root, "restore", processes, devices, "--mesh=2x2", "--spec=data", scale, *extra
            )
            read = [int(_said(o, "BYTES READ")) for o in outs]
            rows.append(
                {
                    "topology": f"{processes}x{devices}",
                    "exchange": exchange,
                    "bytes_per_process": read,
                    "total_over_stored": round(sum(read) / stored, 3),
                    "restore_s": round(max(float(_said(o, "RESTORE SECONDS")) for o in outs), 3),
                }
            )
    return stored, rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py replread", description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    scale = f"--scale={args.scale}"
    report: dict[str, Any] = {"scale": args.scale}
    with tempfile.TemporaryDirectory() as tmp:
        report["local"] = measure(f"{tmp}/root", scale)
        servers.isolate_cloud_env(os.environ, tmp)  # the children inherit it
        server = servers.start_moto(Path(tmp))
        os.environ["AWS_ENDPOINT_URL_S3"] = server.endpoint
        try:
            report["s3"] = measure(f"s3://{server.bucket}/replread", scale)
        finally:
            server.stop()
    print("| store | topology | exchange | MiB read per process | total / stored | restore s |")
    print("|---|---|---|---|---|---|")
    for store in ("local", "s3"):
        stored, rows = report[store]
        for r in rows:
            per = ", ".join(f"{b / 2**20:.1f}" for b in r["bytes_per_process"])
            print(
                f"| {store} | {r['topology']} | {'yes' if r['exchange'] else 'no (before)'} "
                f"| {per} | {r['total_over_stored']:.3f}x | {r['restore_s']:.2f} |"
            )
    print(f"step bytes stored: {stored} ({stored / 2**20:.1f} MiB)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0
