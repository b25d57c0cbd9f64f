"""``jaxckpt verify``: re-read every chunk and check it against its CRC32C."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from jaxckpt.cli._common import command, open_root
from jaxckpt.cli._output import Progress, err, human_bytes, human_duration, json_out


def register(sub: Any) -> None:
    p = command(sub, "verify", cmd_verify, "re-read every chunk and check it against its CRC32C")
    p.add_argument("root")
    p.add_argument("step", nargs="?", type=int, help="default: the newest committed step")
    p.add_argument("--all", action="store_true", help="verify every committed step")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_verify(args: argparse.Namespace) -> int:
    if args.all and args.step is not None:
        args.parser.error("give a STEP or --all, not both")
    protocol = open_root(args.root)  # before importing TensorStore/jax: a bad root fails fast
    committed = protocol.committed()
    if args.all:
        steps = list(committed)
    elif args.step is not None:
        steps = [protocol.require_marker(args.step).step]
    else:
        steps = [protocol.marker_or_latest(None).step]

    import tensorstore as ts

    from jaxckpt._verify import verify_step
    from jaxckpt.storage import tensorstore_backed

    context = ts.Context(tensorstore_backed(protocol.storage).context_spec())
    reports = []
    for step in steps:
        marker = committed.get(step) or protocol.require_marker(step)
        bar = Progress.on_stderr(f"step {step}", marker.nbytes, quiet=args.json or args.no_progress)
        report = verify_step(protocol, context, step, on_progress=bar.update)
        elapsed = bar.finish()
        reports.append(report)
        if args.json:
            continue
        status = "OK" if report.ok else f"{len(report.problems)} PROBLEMS"
        print(
            f"step {step}: {status} ({report.chunks_checked} chunks, "
            f"{human_bytes(report.bytes_checked)} in {human_duration(elapsed)})"
        )
        for problem in report.problems:
            print(f"jaxckpt: step {step}: {problem}", file=sys.stderr)
    damaged = sorted(set(protocol.visible_refs()) - set(committed)) if args.all else []
    for s in damaged:
        err(f"step {s}: the commit marker is damaged; the step cannot be restored")
    bad = [r.step for r in reports if not r.ok] + damaged
    if args.json:
        json_out(
            {
                "root": protocol.storage.uri,
                "ok": not bad,
                "damaged": damaged,
                "steps": [
                    {
                        "step": r.step,
                        "ok": r.ok,
                        "chunks_checked": r.chunks_checked,
                        "bytes_checked": r.bytes_checked,
                        "problems": [
                            {"path": p.path, "chunk": p.chunk, "message": p.message}
                            for p in r.problems
                        ],
                    }
                    for r in reports
                ],
            }
        )
    elif not reports:
        print(f"{protocol.storage.uri}: no committed steps to verify")
    elif bad:
        err(f"{len(bad)} of {len(reports)} steps failed verification: {bad}")
    else:
        print(f"all {len(reports)} verified steps are intact")
    return 1 if bad else 0
