"""``jaxckpt ls``: committed and partial steps, sizes, commit times, keep reasons, health,
published weights."""

from __future__ import annotations

import argparse
import time
from typing import Any

from jaxckpt.cli._common import add_retention_flags, command, integer, open_root, retention
from jaxckpt.cli._output import ago, err, human_bytes, json_out, local_time, print_table
from jaxckpt.commit import CommitProtocol, scan
from jaxckpt.errors import NotACheckpointRootError
from jaxckpt.lifecycle import retention_decision
from jaxckpt.records import (
    PUBLISH,
    REPLICAS,
    CommitMarker,
    health_records,
    is_held_manifest_name,
    parse_publish_key,
    replica_holdings,
)

DEFAULT_LIMIT = 50


def register(sub: Any) -> None:
    p = command(sub, "ls", cmd_ls, "list committed and partial steps with sizes and commit times")
    p.add_argument("root")
    add_retention_flags(p)
    p.add_argument(
        "--limit",
        type=integer(0),
        metavar="N",
        help=f"show the N newest steps (default {DEFAULT_LIMIT}; 0 shows all; "
        "--json lists all unless given)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--local-root",
        metavar="LOCAL_ROOT",
        action="append",
        help="a tiered job's local tier: show which tiers hold each step; with replicas "
        "(local_replicas), how many copies of each process's part it holds (repeat it for "
        "every node's local root to see the job's coverage)",
    )


def cmd_ls(args: argparse.Namespace) -> int:
    protocol = open_root(args.root)
    found = scan(protocol, full=True)
    broken = found.incomplete  # a marker covering parts that are not stored: damaged
    committed = {s: m for s, m in sorted(found.committed.items()) if s not in broken}
    damaged = {s: "invalid commit marker" for s in found.damaged}
    damaged |= broken
    where = {s: r.key for s, r in found.damaged.items()}
    where |= {s: found.committed[s].key for s in broken}
    tiers: dict[int, list[str]] | None = None
    copies: dict[int, dict[int, int]] = {}  # step -> process -> copies of its part
    replicated = False  # some local root holds replicas (local_replicas > 1)
    if args.local_root is not None:  # steps of either tier; the local copy is nearest
        local: dict[int, CommitMarker] = {}
        for root in args.local_root:
            try:
                own = open_root(root)
                held = own.committed()
            except NotACheckpointRootError as e:  # a cache not created yet, or removed
                err(f"{e}: listing the durable root only" if len(args.local_root) == 1 else str(e))
                continue
            replicated |= _count_copies(own, held, copies)
            local = {**held, **local}
        tiers = {s: [] for s in sorted({*committed, *local})}
        for s in local:
            tiers[s].append("local")
        for s in committed:
            tiers[s].append("durable")
        committed = dict(sorted({**committed, **{s: local[s] for s in local}}.items()))
    partial = [a for a in found.attempts if a.kind != "damaged"]
    rule = retention(args)
    listed = health_records.list_marks(protocol.storage)
    bad = {s for s, k in listed.items() if not k.good}
    decision = retention_decision(committed, rule, bad=bad)
    limit = args.limit if args.limit is not None else (0 if args.json else DEFAULT_LIMIT)
    shown = sorted(committed)[-limit:] if limit > 0 else sorted(committed)
    marks = {s: health_records.read_mark(protocol.storage, listed[s]) for s in shown if s in listed}
    published = _published(protocol.storage.list(PUBLISH))  # weights published (publish=)
    if args.json:
        json_out(
            {
                "root": protocol.storage.uri,
                "retention": None if rule is None else repr(rule),
                "committed": [
                    {
                        "step": s,
                        "nbytes": committed[s].nbytes,
                        "commit_time": committed[s].time,
                        "keep": committed[s].keep,
                        "metrics": dict(committed[s].metrics),
                        **health_records.as_json(marks.get(s)),
                        "published": published.get(s),
                        "kept_by": _kept_by(decision.keep.get(s, ()), rule),
                        **({"tiers": tiers[s]} if tiers is not None else {}),
                        **({"copies": _copies_json(copies, s)} if replicated else {}),
                    }
                    for s in shown
                ],
                "not_shown": len(committed) - len(shown),
                "partial": [
                    {
                        "step": p.step,
                        "attempt": p.location.attempt,
                        "kind": p.kind,
                        "operation": p.operation,
                        "started": p.started,
                    }
                    for p in partial
                ],
                "damaged": [
                    {"step": s, "marker": protocol.where(where[s]), "reason": why}
                    for s, why in sorted(damaged.items())
                ],
                "fenced": [
                    {"step": m.step, "epoch": m.epoch, "attempt": m.attempt} for m in found.hidden
                ],
            }
        )
        return 0
    total = sum(m.nbytes for m in committed.values())
    print(
        f"{protocol.storage.uri}: {len(committed)} committed steps ({human_bytes(total)})"
        + (f", {len(partial)} partial or orphaned" if partial else "")
        + (f", {len(damaged)} DAMAGED" if damaged else "")
        + (f", {len(found.hidden)} fenced" if found.hidden else "")
    )
    if not committed and not partial and not damaged and not found.hidden:
        return 0
    rows = [["STEP", "STATE", "SIZE", "COMMITTED", "KEPT BY", "HEALTH"]]
    if tiers is not None:
        rows[0].insert(2, "TIERS")
    if replicated:
        rows[0].insert(3, "COPIES (PROCESS:N)")
    for s in shown:
        m = committed[s]
        reasons = _kept_by(decision.keep.get(s, ()), rule)
        kept = ", ".join(reasons) or ("" if rule is None else "- (prune would delete)")
        when = f"{local_time(m.time)} ({ago(m.time)})"
        health, why = health_records.describe(marks.get(s))
        shown_health = f"{health}: {why}" if why else health
        rows.append([str(s), "committed", human_bytes(m.nbytes), when, kept, shown_health])
        if tiers is not None:
            rows[-1].insert(2, "+".join(tiers[s]))
        if replicated:
            rows[-1].insert(3, " ".join(f"{p}:{n}" for p, n in _copies_json(copies, s).items()))
    now = time.time()
    for p in partial:
        age = p.age(now)
        when = f"started {ago(now - age)}" if age is not None else "-"
        state = f"partial ({p.operation})" if p.kind == "partial" else "orphaned"
        rows.append([str(p.step), state, "-", when, f"attempt {p.location.attempt or '(v1)'}", "-"])
    for s, why in damaged.items():
        what = f"invalid commit marker {where[s]}" if s in found.damaged else why
        rows.append([str(s), "DAMAGED", "-", "-", f"{what}; data kept", "-"])
    for m in found.hidden:
        rows.append([str(m.step), "fenced", "-", "-", f"committed by fenced epoch {m.epoch}", "-"])
    rows[1:] = sorted(rows[1:], key=lambda r: int(r[0]))
    if tiers is not None:  # partial, damaged and fenced attempts are the durable root's
        pad = ["durable", "-"] if replicated else ["durable"]
        rows[1:] = [r if len(r) == len(rows[0]) else [*r[:2], *pad, *r[2:]] for r in rows[1:]]
    if published:  # a last column: published weights, or due (under way or interrupted)
        rows[0].append("PUBLISHED")
        for r in rows[1:]:
            r.append(published.get(int(r[0]), "-") if r[1] == "committed" else "-")
    print_table(rows, right=(0, 3 + replicated) if tiers is not None else (0, 2))
    hidden = len(committed) - len(shown)
    if hidden:
        print(f"({hidden} older committed steps not shown; --limit 0 shows all)")
    if partial:
        print("(partial steps are saves under way or interrupted; `jaxckpt gc` removes old ones)")
    if damaged:
        print("(a DAMAGED step's marker fails its checksum or covers parts that are missing: it")
        print(" is corruption, not garbage; its data is kept; `jaxckpt gc --force` removes an")
        print(" invalid marker's data)")
    return 0


def _kept_by(reasons: tuple[str, ...], rule: object) -> list[str]:
    """Why a step is kept. Without ``--keep-*`` flags ``ls`` applies no rule, and the
    job's own rule is not recorded on storage: only ``newest`` and ``pinned`` are facts."""
    return [r for r in reasons if rule is not None or r != "no retention policy"]


def _published(keys: list[str]) -> dict[int, str]:
    """Step -> ``"published"`` (its done record) or ``"due"`` (chosen, not published yet)."""
    states: dict[int, str] = {}
    for key in keys:
        parsed = parse_publish_key(key)
        if parsed is not None and states.get(parsed[0]) != "published":
            states[parsed[0]] = "due" if parsed[1] else "published"
    return states


def _count_copies(
    local: CommitProtocol, held: dict[int, CommitMarker], copies: dict[int, dict[int, int]]
) -> bool:
    """Adds the parts one local root holds, its own and its replicas, to ``copies``;
    True if it holds replicas."""
    for step, marker in held.items():
        counts = copies.setdefault(step, dict.fromkeys(range(marker.num_processes), 0))
        for name in marker.manifest_names():
            if not is_held_manifest_name(name):
                process = int(name.split("/")[1].split(".")[0])
                counts[process] = counts.get(process, 0) + 1
    replicas = replica_holdings(local.storage.list(REPLICAS))
    for step, process, _ in replicas:
        counts = copies.setdefault(step, {})
        counts[process] = counts.get(process, 0) + 1
    return bool(replicas)


def _copies_json(copies: dict[int, dict[int, int]], step: int) -> dict[str, int]:
    return {str(p): n for p, n in sorted(copies.get(step, {}).items())}
