"""``jaxckpt prune``, ``gc`` and ``cp``: deleting, collecting and copying steps."""

from __future__ import annotations

import argparse
import time
from typing import Any

from jaxckpt.cli._common import (
    add_retention_flags,
    command,
    integer,
    open_root,
    retention,
    seconds,
    split_source,
)
from jaxckpt.cli._output import ago, err, human_bytes, human_duration, print_table
from jaxckpt.commit import TIDY_S, CommitProtocol
from jaxckpt.errors import CheckpointError
from jaxckpt.lifecycle import retention_decision
from jaxckpt.records import CommitMarker, health_records


def register(sub: Any) -> None:
    p = command(sub, "prune", cmd_prune, "delete committed steps a retention rule does not keep")
    p.add_argument("root")
    add_retention_flags(p)
    p.add_argument("--dry-run", action="store_true", help="only say what would be deleted")

    p = command(
        sub, "gc", cmd_gc, "remove fenced, partial and orphaned attempts older than a grace period"
    )
    p.add_argument("root")
    p.add_argument("--grace", type=seconds, default=3600.0, metavar="SECONDS", help="default 3600")
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p.add_argument(
        "--force", action="store_true", help="also remove damaged commit markers and their data"
    )

    p = command(sub, "cp", cmd_cp, "copy committed steps to another root, committing each there")
    p.add_argument("src", metavar="SRC_ROOT[:STEP]")
    p.add_argument("dst", metavar="DST_ROOT")
    p.add_argument("--compress", choices=["zstd"], help="re-encode the arrays with zstd")
    p.add_argument("--level", type=integer(1, 22), default=3, help="zstd level 1-22 (default 3)")


def cmd_prune(args: argparse.Namespace) -> int:
    rule = retention(args)
    if rule is None:
        err("prune needs a retention rule: --keep-last, --keep-milestones or --keep-every")
        return 2
    protocol = open_root(args.root)
    committed = protocol.committed()
    decision = retention_decision(committed, rule, bad=health_records.bad_steps(protocol.storage))
    verb = "would delete" if args.dry_run else "delete"
    rows = [["ACTION", "STEP", "SIZE", "WHY"]]
    for s in committed:
        size = human_bytes(committed[s].nbytes)
        if s in decision.keep:
            rows.append(["keep", str(s), size, ", ".join(decision.keep[s])])
        else:
            rows.append([verb, str(s), size, "not kept by the rule"])
    print_table(rows, right=(1, 2))
    deleted = list(decision.delete)
    if not args.dry_run:
        deleted = [s for s in decision.delete if _delete(protocol, committed[s])]
    reclaimed = sum(committed[s].nbytes for s in deleted)
    n = len(deleted)
    summary = f"{n} step{'s' if n != 1 else ''}, reclaiming {human_bytes(reclaimed)}"
    gone = len(decision.delete) - n
    summary += f" ({gone} deleted meanwhile by another process)" if gone else ""
    print(f"would delete {summary} (dry run)" if args.dry_run else f"deleted {summary}")
    return 0


def _delete(protocol: CommitProtocol, marker: CommitMarker) -> bool:
    """Deletes a listed step; False if another process (retention) deleted it since."""
    try:
        if protocol.storage.read(marker.key) is not None:
            protocol.delete(marker.step, marker=marker)
            return True
    except CheckpointError:
        if protocol.still_committed(marker):
            raise
    print(f"step {marker.step}: deleted meanwhile (by another process), skipped")
    return False


def cmd_gc(args: argparse.Namespace) -> int:
    from jaxckpt.commit import collect, is_live, scan
    from jaxckpt.records import TEMP_GRACE_S

    protocol = open_root(args.root)
    now = time.time()
    # A grace shorter than a temp file's (--grace 0: no writer is alive) covers them too.
    found = scan(protocol, full=True, temp_grace_s=min(args.grace, TEMP_GRACE_S))
    remove = "would remove" if args.dry_run else "remove"
    old = []
    for p in found.attempts:
        age = p.age(now)
        age_text = f"started {ago(now - age)}" if age is not None else "age unknown"
        if p.step in found.damaged and not args.force:
            action = "keep (damaged step)"
        elif is_live(p, found.epochs.newest, args.grace, now):
            action = "keep (within grace period)"
        else:
            old.append(p)
            action = remove
        what = f"{p.kind} {p.operation or ''}".strip()
        print(f"{action:<26} step {p.step} ({what}, {age_text}): {p.location.attempt or 'v1'}")
    for m in found.hidden:
        print(f"{remove:<26} step {m.step} (committed by fenced epoch {m.epoch} after a takeover)")
    for s, ref in found.damaged.items():
        action = remove if args.force else "keep"
        hint = "" if args.force else " (use --force to remove)"
        print(f"{action:<26} step {s}: damaged commit marker {ref.key}{hint}")
    if args.dry_run:
        print(f"would remove {len(old) + len(found.hidden)} attempts")
        return 0
    removed = collect(protocol, found, grace_s=args.grace, force=args.force)
    print(f"removed {len(removed)} attempts (grace {human_duration(args.grace)})")
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    from jaxckpt.tools import copy_step

    src_uri, only = split_source(args.src)
    src = open_root(src_uri)
    dst = open_root(args.dst, create=True)
    if src.storage.uri == dst.storage.uri:
        err(f"source and destination are the same root: {src.storage.uri}")
        return 2
    markers = [src.require_marker(only)] if only is not None else list(src.committed().values())
    existing = dst.committed()
    vanished = []
    for marker in markers:
        step = marker.step
        if step in existing:
            print(f"step {step}: already committed under {dst.storage.uri}, skipped")
            continue
        start = time.monotonic()
        try:
            nbytes = copy_step(src, dst, marker, compress=args.compress, level=args.level)
        except CheckpointError:
            if src.still_committed(marker):
                raise
            # Deleted from the source since the listing (retention of a live root):
            # copy_step removed its partial copy; the other steps are still copied.
            print(f"step {step}: deleted from {src.storage.uri} during the copy, skipped")
            vanished.append(step)
            continue
        seconds = time.monotonic() - start
        ratio = f", {nbytes / marker.nbytes:.0%} of the source" if args.compress else ""
        print(
            f"step {step}: copied {human_bytes(nbytes)} in {human_duration(seconds)} "
            f"({human_bytes(nbytes / max(seconds, 1e-9))}/s{ratio})"
        )
    dst.tidying.settle(TIDY_S)  # the copies' pending records go before this process does
    gone = f" ({len(vanished)} deleted from the source meanwhile)" if vanished else ""
    print(f"{dst.storage.uri}: {len(dst.committed())} committed steps{gone}")
    return 0
