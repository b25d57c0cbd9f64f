"""``jaxckpt promote``: promote requested local steps to the durable root (once or as a sidecar)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from jaxckpt._pools import lower_thread_priority
from jaxckpt.cli._common import add_retention_flags, command, open_root, retention, seconds
from jaxckpt.cli._output import err, human_bytes, human_duration

log = logging.getLogger("jaxckpt")


def hours(text: str) -> float:
    """An argparse ``type``: a finite number of hours >= 0."""
    try:
        return seconds(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a number of hours >= 0, got {text!r}") from None


def niceness(text: str) -> int:
    """An argparse ``type``: a nice value, 0-19."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value not in range(20):
        raise argparse.ArgumentTypeError(f"must be an integer 0-19, got {text!r}")
    return value


def register(sub: Any) -> None:
    p = command(
        sub,
        "promote",
        cmd_promote,
        "copy the steps a tiered job asked to promote from its local tier to the durable root",
    )
    p.add_argument("local_root", metavar="LOCAL_ROOT")
    p.add_argument("root", metavar="ROOT", help="the durable root")
    p.add_argument("--watch", action="store_true", help="keep promoting until SIGTERM (sidecar)")
    p.add_argument(
        "--interval",
        type=seconds,
        default=5.0,
        metavar="SECONDS",
        help="--watch: the period of passes over the durable root (retries, archiving); a new "
        "request in the local tier starts one at once (it is looked for every 0.1 s)",
    )
    p.add_argument(
        "--nice",
        type=niceness,
        default=10,
        metavar="N",
        help="the promoter's nice value, 0-19 (Linux; default 10): it shares the node with "
        "the trainer, whose steps take the CPU first; 0 keeps the priority it was started with",
    )
    p.add_argument(
        "--stop-grace",
        type=seconds,
        default=10.0,
        metavar="SECONDS",
        help="--watch: after SIGTERM, a promotion pass under way may finish until this long "
        "after it began; then the sidecar exits and the step is promoted again by the next "
        "promoter (a store that does not answer kept one past a pod's grace period; one "
        "already retried this long is not waited for)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="--watch: serve Prometheus metrics on this port (pip install 'jaxckpt[promote]')",
    )
    p.add_argument(
        "--metrics-addr", default="0.0.0.0", metavar="ADDR", help="default 0.0.0.0 (all)"
    )
    p.add_argument(
        "--parts-timeout",
        type=seconds,
        default=300.0,
        metavar="SECONDS",
        help="multi-host job, the primary host's promoter: how long to wait for the other "
        "hosts' parts of a step per pass (default 300)",
    )
    add_retention_flags(p)  # applied to the durable root after each promoted step
    p.add_argument(
        "--archive",
        metavar="ARCHIVE_ROOT",
        help="also re-encode durable steps with zstd into this root (as `cp --compress zstd`)",
    )
    p.add_argument(
        "--archive-after-hours",
        type=hours,
        default=24.0,
        metavar="H",
        help="--archive: only steps committed more than H hours ago (default 24)",
    )
    p.add_argument(
        "--archive-milestones",
        nargs="?",
        const="1,2,5",
        metavar="S,S,...",
        help="--archive: only milestone steps (series default 1,2,5) and pinned ones",
    )
    p.add_argument("--archive-level", type=int, default=3, help="zstd level (default 3)")


def cmd_promote(args: argparse.Namespace) -> int:
    from jaxckpt import policy
    from jaxckpt.cli._metrics import PromoterMetrics
    from jaxckpt.cli._sidecar import wait_for_local_tier
    from jaxckpt.lifecycle import Promoter, archive_once
    from jaxckpt.records import PROMOTE, PROMOTED, TIER_RECORD, PromotionResult, refusal
    from jaxckpt.storage import open_storage

    if args.metrics_port is not None and not args.watch:
        err("--metrics-port needs --watch")
        return 2
    lower_thread_priority(args.nice, "the promoter")  # before it starts any thread
    if args.watch and not wait_for_local_tier(args.local_root, args.interval):
        return 0  # stopped before the job created its local root
    local = open_root(args.local_root)
    if local.storage.read(TIER_RECORD) is None and not local.storage.list(PROMOTE):
        err(
            f"{local.storage.uri} is not a local tier: it records no durable root "
            f"({TIER_RECORD}) and holds no promotion requests; `jaxckpt promote` copies from a "
            "tiered job's local_root (use `jaxckpt cp` to copy a plain root)"
        )
        return 2
    durable_storage = open_storage(args.root)
    refused = refusal(local.storage, durable_storage.uri)  # before the durable root is written
    if refused is not None:
        err(refused)
        return 2
    durable = open_root(args.root, create=True)
    if local.storage.uri == durable.storage.uri:
        err(f"the local tier and the durable root are the same root: {durable.storage.uri}")
        return 2
    metrics = PromoterMetrics(local, durable) if args.metrics_port is not None else None

    def report(result: PromotionResult) -> None:
        if result.outcome in (PROMOTED, "archived"):
            rate = human_bytes(result.nbytes / max(result.seconds, 1e-9))
            print(
                f"step {result.step}: {result.outcome} {human_bytes(result.nbytes)} in "
                f"{human_duration(result.seconds)} ({rate}/s)",
                flush=True,
            )
        else:
            detail = f": {result.error}" if result.error else ""
            print(f"step {result.step}: {result.outcome}{detail}", flush=True)
        if metrics is not None:
            metrics.result(result)

    archive = open_root(args.archive, create=True) if args.archive else None
    select = None
    if args.archive_milestones is not None:
        series = [int(x) for x in args.archive_milestones.split(",") if x.strip()]
        select = policy.KeepMilestones(series=series)

    def archive_pass() -> list[PromotionResult]:
        if archive is None:
            return []
        results = archive_once(
            durable,
            archive,
            older_than_s=args.archive_after_hours * 3600,
            select=select,
            level=args.archive_level,
        )
        for result in results:
            report(result)
        return results

    promoter = Promoter(
        local,
        durable,
        retention=retention(args),
        on_result=report,
        parts_timeout_s=args.parts_timeout,
    )
    if not args.watch:
        results = promoter.promote_all()
        done = sum(r.outcome == PROMOTED for r in results)
        print(f"{durable.storage.uri}: promoted {done} step{'s' if done != 1 else ''}")
        results += archive_pass()
        return 0 if all(r.outcome != "failed" for r in results) else 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if metrics is not None:
        metrics.serve(args.metrics_port, args.metrics_addr)
    print(
        f"watching {local.storage.uri} -> {durable.storage.uri} every {args.interval:g}s",
        flush=True,
    )
    started = time.monotonic()

    def after_pass(_: list[PromotionResult]) -> None:
        archive_pass()
        if metrics is not None:
            metrics.refresh()

    watching = threading.Thread(
        target=promoter.watch,
        args=(stop,),
        kwargs={"interval_s": args.interval, "on_pass": after_pass},
        name="jaxckpt-watch",
        daemon=True,
    )
    watching.start()
    while watching.is_alive() and not stop.wait(1.0):  # signals reach this (main) thread
        pass
    began = promoter.busy_since  # a pass retried in an outage for the grace: not waited for
    grace = args.stop_grace - (0.0 if began is None else time.monotonic() - began)
    watching.join(max(0.0, grace))
    print(f"stopped after {human_duration(time.monotonic() - started)}", flush=True)
    if watching.is_alive():  # its retries, and the pools' threads, would hold the exit up
        print(
            f"a promotion under way did not finish within --stop-grace={args.stop_grace:g}s: "
            "abandoned (nothing of it is visible; the next promoter promotes the step)",
            flush=True,
        )
        sys.stderr.flush()
        os._exit(0)
    return 0
