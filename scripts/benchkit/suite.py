"""``bench.py all``: every benchmark in one run, each part in a process of its own.

The parts run one after the other (never at once: they would share the cores),
each through ``bench.py <part>`` in a fresh interpreter, so that one part's
environment (cloud variables, ``XLA_FLAGS`` device count, loopback servers)
cannot leak into the next. Every result lands under ``--out`` with the name
the part writes on its own: ``bench.md``/``bench.png``/``bench.json`` (core),
``bench_tiers.json``, ``bench_packed.json``, ``bench_cloud.json``, ``replread.json``,
``savemem.json``, ``bench_readclient.json``, ``bench_peers.json``, ``listing.json``,
``ledger.json``, ``bench_declined.json``; ``bench_all.json`` records each part's command,
exit status and wall time. A failing part does not stop the others; the exit status is 1
if any failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchkit.common import REPO, _progress

SCRIPT = REPO / "scripts" / "bench.py"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Part:
    """One sub-benchmark: how to point its output under ``--out``, and its smoke-test sizes."""

    name: str
    out_flag: str  # the part's own option for where it writes
    result: str  # file name under --out ("" for core, which takes the directory)
    tiny: tuple[str, ...]

    def argv(self, out: Path, tiny: bool) -> list[str]:
        target = out / self.result if self.result else out
        return [self.name, self.out_flag, str(target), *(self.tiny if tiny else ())]


PARTS = {
    p.name: p
    for p in (
        Part(name="core", out_flag="--out", result="", tiny=("--tiny", "--repeats", "1")),
        Part(
            name="tiers",
            out_flag="--out",
            result="bench_tiers.json",
            tiny=("--mb", "1", "--leaves", "2", "--saves", "1", "--every", "2"),
        ),
        Part(
            name="packed",
            out_flag="--json",
            result="bench_packed.json",
            tiny=("--tiny", "--rounds", "1"),
        ),
        Part(name="replread", out_flag="--json", result="replread.json", tiny=("--scale", "1")),
        Part(
            name="cloud",
            out_flag="--json",
            result="bench_cloud.json",
            tiny=(
                "--scale",
                "0.02",
                "--big-mib",
                "0.25",
                "--width",
                "16",
                "--profiles",
                "bare,20ms",
            ),
        ),
        Part(
            name="savemem",
            out_flag="--json",
            result="savemem.json",
            tiny=("--gib", "0.05", "--leaf-mib", "4"),
        ),
        Part(
            name="readclient",
            out_flag="--json",
            result="bench_readclient.json",
            tiny=("--reads", "8x64KiB,40x4KiB", "--writes", "1x1MiB,4x64KiB", "--rounds", "1"),
        ),
        Part(
            name="peers",
            out_flag="--json",
            result="bench_peers.json",
            tiny=("--mb", "2", "--saves", "1", "--repeats", "1"),
        ),
        Part(
            name="listing",
            out_flag="--json",
            result="listing.json",
            tiny=("--steps", "2,6", "--repeats", "1"),
        ),
        Part(
            name="ledger",
            out_flag="--json",
            result="ledger.json",
            tiny=("--calls", "200", "--steps", "10", "--step-ms", "1"),
        ),
        Part(
            name="declined",
            out_flag="--json",
            result="bench_declined.json",
            tiny=("--steps", "6", "--rounds", "1", "--size", "64"),
        ),
    )
}
SUBCOMMANDS = tuple(n for n in PARTS if n != "core")  # modules benchkit.<name> with main(argv)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py all", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "results")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset, in order")
    p.add_argument("--tiny", action="store_true", help="smoke-test sizes for every part")
    p.add_argument("--part-timeout-s", type=float, default=6 * 3600.0)
    args = p.parse_args(argv)
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        p.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for name in names:
        cmd = [sys.executable, str(SCRIPT), *PARTS[name].argv(args.out, args.tiny)]
        _progress(f"== {' '.join(cmd[1:])}")
        started = time.perf_counter()
        try:
            rc = subprocess.run(cmd, cwd=REPO, timeout=args.part_timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
        runs.append(
            {"part": name, "argv": cmd[2:], "rc": rc, "elapsed_s": time.perf_counter() - started}
        )
        sys.stdout.flush()
    (args.out / "bench_all.json").write_text(
        json.dumps({"tiny": args.tiny, "runs": runs}, indent=1)
    )
    failed = [r["part"] for r in runs if r["rc"] != 0]
    _progress(f"bench.py all: {len(runs) - len(failed)} of {len(runs)} parts ok; failed: {failed}")
    return 1 if failed else 0
