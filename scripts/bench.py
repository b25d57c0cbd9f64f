"""Benchmark jaxckpt against the disk's limit and against Orbax, side by side in one run.

Every measurement runs in a fresh child process (``--child``), one contender at a
time, interleaved ``raw, jaxckpt, orbax, raw, jaxckpt, orbax, ...`` so that slow
drifts of the machine hit all contenders alike. A child builds the same state
(float32 leaves, normally distributed, in XLA-owned buffers), warms its
contender up with a tiny save and restore, then measures:

* save: the time ``save`` blocks, the time until the step is committed, and the
  peak resident memory above the level at the call (``/proc/self/status``
  ``VmHWM`` after resetting it through ``/proc/self/clear_refs``, cross-checked
  by a psutil sampling thread);
* restore: after ``fsync`` + ``POSIX_FADV_DONTNEED`` on every file of the step
  (for all contenders alike; ``--warm-cache`` skips it), the time to get the
  arrays back and the peak extra memory; then the restored values are compared
  with the saved ones.

The contenders: ``raw`` writes each leaf to its own file and fsyncs it, one
after the other (the disk's sequential limit), and reads it back with
``readinto``; ``jaxckpt`` is :class:`jaxckpt.CheckpointManager`; ``orbax`` is
``ocp.CheckpointManager`` with ``ocp.args.StandardSave`` and default options.

The training loop: a jitted, CPU-bound step (matmuls on both cores). A child runs
``saves`` pairs of segments of ``every`` steps each, one plain and one that starts
with a save and ends when it is committed; ``every`` is chosen so that a save has
time to finish in the background. The overhead per save (saving minus plain
segment, pair by pair, so that drifts in the machine's load cancel) is set
beside the blocking time of a save alone.

With ``--object-stores``, ``moto_server`` and ``gcp-storage-emulator`` are started
on 127.0.0.1 (through ``benchkit/servers.py``) for informational rows.

Usage::

    python scripts/bench.py [--cases big,small,huge] [--repeats 3] [--out results/]
    python scripts/bench.py --tiny --repeats 1 --out /tmp/bench   # smoke test

Writes ``bench.md`` (tables with the date and machine), ``bench.png`` and
``bench.json`` to ``--out``.

The other benchmarks are subcommands of this one entry point, each a module
``benchkit/<name>.py`` with its own options (``bench.py <name> --help``)::

    python scripts/bench.py tiers     # local tier vs straight to S3/GCS (bench_tiers.json)
    python scripts/bench.py packed    # plain vs packed vs OCDBT (bench_packed.json)
    python scripts/bench.py cloud     # raw vs plain vs packed behind a shaping proxy
    python scripts/bench.py replread  # multi-host restore bytes (replread.json)
    python scripts/bench.py readclient  # direct reads vs obstore; TensorStore vs obstore PUTs
    python scripts/bench.py listing   # open, latest_step(), restore(), save at 10-10,000 steps
    python scripts/bench.py declined  # what a declined save costs: int step vs state.step
    python scripts/bench.py peers     # replicated vs single-node local commits, restore after
                                      # a lost node from peers vs the durable root
    python scripts/bench.py scale     # 2-16 real JAX processes: requests, metadata bytes and
                                      # coordination calls per process (not part of ``all``)
    python scripts/bench.py storm     # a save and a restore through 60 s of 503 SlowDown vs
                                      # none (not part of ``all``)
    python scripts/bench.py denied    # one host denied (403): every host's seconds to raise
                                      # and whether it names that host (not part of ``all``)
    python scripts/bench.py gameday   # a training job under a seeded failure schedule, every
                                      # tier on, vs Orbax: goodput, lost steps, bit-exactness
                                      # (--quick, --smoke; not part of ``all``)
    python scripts/bench.py all [--out results/] [--tiny] [--parts core,tiers,...]

``all`` runs every part (``core`` is the default benchmark above), one after
the other in fresh processes, and writes all results under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchkit.common import (
    CASES,
    DEFAULT_CASES,
    REPO,
    TINY_CASES,
    Case,
    GiB,
    MiB,
    Settings,
    _progress,
    _size,
    io_contenders,
)
from benchkit.machine import fits_in_memory, machine_info
from benchkit.measure import run_as_child
from benchkit.report import render_markdown, write_outputs
from benchkit.rounds import (
    Scratch,
    calibrate_step,
    child_env,
    loop_plan,
    run_io_rounds,
    run_loop_rounds,
)
from benchkit.stores import object_stores, run_store_rounds
from benchkit.suite import SUBCOMMANDS
from benchkit.suite import main as run_suite
from benchkit.summary import check_targets, summarize_io, summarize_loop

SLOW = ("scale", "storm", "denied", "gameday")
"""Subcommands that ``all`` does not run: groups of real JAX processes, minutes each."""


def run_case(s: Settings, case: Case, step_s: Callable[[], float], stores: Any) -> dict[str, Any]:
    skip = fits_in_memory(case)
    if skip:
        _progress(f"case {case.label}: skipped, {skip}")
        return {"case": dataclasses.asdict(case), "skipped": skip}
    _progress(f"case {case.label}")
    scratch = Scratch(s.root)
    try:
        if s.stores_only:
            summary = {"case": dataclasses.asdict(case), "io": {}}
        else:
            summary = _run_local_rounds(s, case, step_s, scratch)
    finally:
        scratch.flush()
    if stores is not None:
        if case.nbytes <= s.object_store_max_bytes:
            summary["stores"] = run_store_rounds(s, case, *stores)
        else:
            summary["stores_skipped"] = (
                f"state larger than --object-store-max-bytes ({_size(s.object_store_max_bytes)})"
            )
    summary["targets"] = check_targets(case, summary)
    return summary


def _run_local_rounds(
    s: Settings, case: Case, step_s: Callable[[], float], scratch: Scratch
) -> dict[str, Any]:
    env = child_env()
    samples = run_io_rounds(s, case, io_contenders(case), scratch, env)
    summary: dict[str, Any] = {
        "case": dataclasses.asdict(case),
        "samples": {"io": samples},
        "io": {c: summarize_io(x, case.nbytes) for c, x in samples.items()},
    }
    if case.nbytes <= s.loop_max_bytes:
        every, saves = loop_plan(s, summary["io"], step_s())
        loop = run_loop_rounds(s, case, (every, saves, step_s()), scratch, env)
        summary["samples"]["loop"] = loop
        summary["loop"] = summarize_loop(loop, summary["io"], every, saves)
        summary["loop"]["step_ms"] = step_s() * 1e3
    else:
        summary["loop_skipped"] = f"state larger than --loop-max-bytes ({_size(s.loop_max_bytes)})"
    return summary


# ---- report: markdown, chart, json ----------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=f"other benchmarks: bench.py {{{','.join(SUBCOMMANDS)},all}} [--help]",
    )
    p.add_argument("--cases", help=f"comma-separated: {', '.join(CASES)} (default {DEFAULT_CASES})")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "results")
    p.add_argument("--root", type=Path, help="scratch directory (default: a temp dir on /work)")
    p.add_argument("--tiny", action="store_true", help=f"smoke-test sizes ({TINY_CASES})")
    p.add_argument("--warm-cache", action="store_true", help="do not evict files before restore")
    p.add_argument("--object-stores", action="store_true", help="add loopback S3 and GCS rows")
    p.add_argument(
        "--stores-only", action="store_true", help="only the object-store rows (implies the flag)"
    )
    p.add_argument("--object-store-max-bytes", type=int, default=256 * MiB)
    p.add_argument("--loop-saves", type=int, default=3, help="saves per training-loop run")
    p.add_argument("--loop-max-bytes", type=int, default=GiB, help="larger states skip the loop")
    p.add_argument("--chunk-bytes", type=int, help="jaxckpt chunk_bytes")
    p.add_argument("--max-inflight-bytes", type=int, help="jaxckpt max_inflight_bytes")
    p.add_argument("--io-concurrency", type=int, help="jaxckpt local file_io_concurrency")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def jaxckpt_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if args.chunk_bytes:
        options["chunk_bytes"] = args.chunk_bytes
    if args.max_inflight_bytes:
        options["max_inflight_bytes"] = args.max_inflight_bytes
    if args.io_concurrency:
        options["storage_options"] = {"io_concurrency": args.io_concurrency}
    return options


def make_settings(args: argparse.Namespace, root: Path) -> Settings:
    names = (args.cases or (TINY_CASES if args.tiny else DEFAULT_CASES)).split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    return Settings(
        cases=tuple(CASES[n.strip()] for n in names),
        repeats=args.repeats,
        out=args.out,
        root=root,
        cold_cache=not args.warm_cache,
        object_stores=args.object_stores or args.stores_only,
        stores_only=args.stores_only,
        object_store_max_bytes=args.object_store_max_bytes,
        loop_saves=2 if args.tiny else args.loop_saves,
        loop_min_interval_s=0.2 if args.tiny else 2.0,
        loop_max_bytes=args.loop_max_bytes,
        jaxckpt_options=jaxckpt_options(args),
    )


@contextmanager
def scratch_root(requested: Path | None) -> Iterator[Path]:
    """``--root`` or a fresh directory under ``results/tmp`` (on the same disk as /work)."""
    base = requested or REPO / "results" / "tmp"
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-", dir=base))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_all(s: Settings) -> dict[str, Any]:
    env = child_env()
    step_cache: list[float] = []

    def step_s() -> float:
        if not step_cache:
            step_cache.append(calibrate_step(s, env))
        return step_cache[0]

    report: dict[str, Any] = {"machine": machine_info(s.root), "cases": []}
    report["settings"] = {
        "cases": [c.name for c in s.cases],
        "repeats": s.repeats,
        "cold_cache": s.cold_cache,
        "jaxckpt_options": s.jaxckpt_options,
        "object_stores": s.object_stores,
    }
    with _maybe_object_stores(s) as stores:
        for case in s.cases:
            report["cases"].append(run_case(s, case, step_s, stores))
    report["machine"]["load_at_end"] = os.getloadavg()
    return report


@contextmanager
def _maybe_object_stores(s: Settings) -> Iterator[Any]:
    if not s.object_stores:
        yield None
        return
    log_dir = Path(tempfile.mkdtemp(prefix="servers-", dir=s.root))
    with object_stores(log_dir) as stores:
        yield stores


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in (*SUBCOMMANDS, *SLOW):  # imported only here: packed sets XLA_FLAGS
        return int(importlib.import_module(f"benchkit.{argv[0]}").main(argv[1:]))
    if argv and argv[0] == "all":
        return run_suite(argv[1:])
    if argv and argv[0] == "core":
        argv = argv[1:]
    args = parse_args(argv)
    if args.child is not None:
        return run_as_child(args.child)
    with scratch_root(args.root) as root:
        settings = make_settings(args, root)
        started = time.perf_counter()
        report = run_all(settings)
        report["elapsed_s"] = time.perf_counter() - started
    write_outputs(report, settings.out)
    _progress(f"wrote {settings.out / 'bench.md'}, bench.png, bench.json")
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
