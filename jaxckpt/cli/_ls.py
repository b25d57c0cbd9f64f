"""``jaxckpt ls``: committed and partial steps, sizes, commit times, keep reasons."""

from __future__ import annotations

import argparse
from typing import Any

from jaxckpt._commit import retention_decision
from jaxckpt.cli._common import add_retention_flags, command, open_root, retention
from jaxckpt.cli._output import ago, human_bytes, json_out, local_time, print_table

DEFAULT_LIMIT = 50


def register(sub: Any) -> None:
    p = command(sub, "ls", cmd_ls, "list committed and partial steps with sizes and commit times")
    p.add_argument("root")
    add_retention_flags(p)
    p.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help=f"show the N newest steps (default {DEFAULT_LIMIT}; 0 shows all; "
        "--json lists all unless given)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_ls(args: argparse.Namespace) -> int:
    protocol = open_root(args.root)
    committed = protocol.committed()
    partial = protocol.partial_steps()
    rule = retention(args)
    decision = retention_decision(committed, rule)
    limit = args.limit if args.limit is not None else (0 if args.json else DEFAULT_LIMIT)
    shown = sorted(committed)[-limit:] if limit > 0 else sorted(committed)
    if args.json:
        json_out(
            {
                "root": protocol.storage.uri,
                "committed": [
                    {
                        "step": s,
                        "nbytes": committed[s].nbytes,
                        "commit_time": committed[s].time,
                        "keep": committed[s].keep,
                        "metrics": dict(committed[s].metrics),
                        "kept_by": list(decision.keep.get(s, ())),
                    }
                    for s in shown
                ],
                "not_shown": len(committed) - len(shown),
                "partial": [
                    {
                        "step": p.step,
                        "operation": p.operation,
                        "started": p.started,
                        "reason": p.reason,
                    }
                    for p in partial
                ],
            }
        )
        return 0
    total = sum(m.nbytes for m in committed.values())
    print(
        f"{protocol.storage.uri}: {len(committed)} committed steps ({human_bytes(total)})"
        + (f", {len(partial)} partial" if partial else "")
    )
    if not committed and not partial:
        return 0
    rows = [["STEP", "STATE", "SIZE", "COMMITTED", "KEPT BY"]]
    for s in shown:
        m = committed[s]
        reasons = decision.keep.get(s, ())
        if rule is None:
            kept = ", ".join(r for r in reasons if r != "no retention policy")
        else:
            kept = ", ".join(reasons) or "- (prune would delete)"
        when = f"{local_time(m.time)} ({ago(m.time)})"
        rows.append([str(s), "committed", human_bytes(m.nbytes), when, kept])
    for p in partial:
        when = f"started {ago(p.started)}" if p.started is not None else "-"
        rows.append([str(p.step), f"partial ({p.operation})", "-", when, p.reason])
    rows[1:] = sorted(rows[1:], key=lambda r: int(r[0]))
    print_table(rows, right=(0, 2))
    hidden = len(committed) - len(shown)
    if hidden:
        print(f"({hidden} older committed steps not shown; --limit 0 shows all)")
    if partial:
        print("(partial steps are saves under way or interrupted; `jaxckpt gc` removes old ones)")
    return 0
