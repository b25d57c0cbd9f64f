"""``jaxckpt verify``: re-read every chunk and check it against its CRC32C."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from jaxckpt.cli._common import command, integer, open_root, source_and_step
from jaxckpt.cli._output import Progress, err, human_bytes, human_duration, json_out
from jaxckpt.errors import StepNotFoundError


def register(sub: Any) -> None:
    p = command(sub, "verify", cmd_verify, "re-read every chunk and check it against its CRC32C")
    p.add_argument("root", metavar="ROOT[:STEP]")
    p.add_argument("step", nargs="?", type=integer(0), help="default: the newest committed step")
    p.add_argument("--all", action="store_true", help="verify every committed step")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_verify(args: argparse.Namespace) -> int:
    if args.all and args.step is not None:
        args.parser.error("give a STEP or --all, not both")
    root, step = source_and_step(args.parser, args.root, args.step)
    protocol = open_root(root)  # before importing TensorStore/jax: a bad root fails fast
    refs = protocol.visible_refs() if args.all else {}
    listed = dict(zip(refs, protocol.map(protocol.read_ref, refs.values()), strict=True))
    committed = {s: m for s, m in sorted(listed.items()) if m is not None}
    if args.all:
        steps = list(committed)
    elif step is not None:
        steps = [protocol.require_marker(step).step]
    else:
        steps = [protocol.marker_or_latest(None).step]

    import tensorstore as ts

    from jaxckpt.storage import tensorstore_backed
    from jaxckpt.tools import verify_step

    context = ts.Context(tensorstore_backed(protocol.storage).context_spec())
    reports = []
    vanished: list[int] = []
    for step in steps:
        marker = committed.get(step) or protocol.require_marker(step)
        bar = Progress.on_stderr(f"step {step}", marker.nbytes, quiet=args.json or args.no_progress)
        gone: StepNotFoundError | None = None
        try:
            report = verify_step(protocol, context, step, on_progress=bar.update)
        except StepNotFoundError as e:
            report, gone = None, e
        elapsed = bar.finish()
        if args.all and (report is None or not report.ok) and not protocol.still_committed(marker):
            # Deleted since the listing (retention of a live root): nothing left to check.
            vanished.append(step)
            if not args.json:
                print(f"step {step}: deleted meanwhile, skipped")
            continue
        if gone is not None:
            raise gone
        assert report is not None
        reports.append(report)
        if args.json:
            continue
        status = "OK" if report.ok else f"{len(report.problems)} PROBLEMS"
        print(
            f"step {step}: {status} ({report.chunks_checked} chunks, "
            f"{human_bytes(report.bytes_checked)} in {human_duration(elapsed)})"
        )
        for p in report.problems:
            where = f"{p.dotted} chunk {p.chunk}" if p.chunk else p.dotted
            print(f"jaxckpt: step {step}: {where}: {p.message}", file=sys.stderr)
    # A listed marker that did not read is damaged, unless it was deleted since.
    damaged = [
        s
        for s, ref in refs.items()
        if s not in committed and protocol.storage.read(ref.key) is not None
    ]
    for s in damaged:
        err(f"step {s}: the commit marker is damaged; the step cannot be restored")
    bad = [r.step for r in reports if not r.ok] + damaged
    if args.json:
        json_out(
            {
                "root": protocol.storage.uri,
                "ok": not bad,
                "damaged": damaged,
                "deleted_meanwhile": vanished,
                "steps": [
                    {
                        "step": r.step,
                        "ok": r.ok,
                        "chunks_checked": r.chunks_checked,
                        "bytes_checked": r.bytes_checked,
                        "problems": [
                            {"path": p.dotted, "chunk": p.chunk, "message": p.message}
                            for p in r.problems
                        ],
                    }
                    for r in reports
                ],
            }
        )
    elif not reports and not damaged:
        meanwhile = f" ({len(vanished)} deleted meanwhile)" if vanished else ""
        print(f"{protocol.storage.uri}: no committed steps to verify{meanwhile}")
    elif bad:
        err(f"{len(bad)} of {len(reports)} steps failed verification: {bad}")
    else:
        meanwhile = f"; {len(vanished)} deleted meanwhile" if vanished else ""
        print(f"all {len(reports)} verified steps are intact{meanwhile}")
    return 1 if bad else 0
