"""``jaxckpt mark``: mark a committed step good or bad by hand (reversible)."""

from __future__ import annotations

import argparse
from typing import Any

from jaxckpt.cli._common import command, integer, open_root
from jaxckpt.cli._output import json_out
from jaxckpt.errors import StepNotFoundError
from jaxckpt.records import health_records


def register(sub: Any) -> None:
    p = command(
        sub,
        "mark",
        cmd_mark,
        "mark a committed step good or bad (restore() skips bad steps; the newest mark wins)",
    )
    p.add_argument("root")
    p.add_argument("step", type=integer(0))
    verdict = p.add_mutually_exclusive_group(required=True)
    verdict.add_argument("--bad", action="store_true", help="restore() skips it")
    verdict.add_argument("--good", action="store_true", help="take a bad mark back")
    p.add_argument("--reason", default="", metavar="TEXT", help="why (shown by `jaxckpt ls`)")
    p.add_argument("--json", action="store_true", help="print the mark written as JSON")


def cmd_mark(args: argparse.Namespace) -> int:
    protocol = open_root(args.root)
    if protocol.read_marker(args.step) is None:
        raise StepNotFoundError(f"no committed step {args.step} under {protocol.storage.uri}")
    mark = health_records.mark_now(args.step, bool(args.good), args.reason, "mark")
    key = health_records.write_mark(protocol.storage, mark)
    if args.json:
        json_out({"root": protocol.storage.uri, "key": key, **health_records.as_json(mark)})
    else:
        why = f": {mark.reason}" if mark.reason else ""
        print(f"marked step {mark.step} of {protocol.storage.uri} {mark.health}{why}")
    return 0
