"""``jaxckpt diff`` and ``jaxckpt stats``: comparing steps and following a trajectory."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from jaxckpt.cli._common import command, open_root, split_source
from jaxckpt.cli._output import err, json_out, number, print_table


def register(sub: Any) -> None:
    p = command(
        sub, "diff", cmd_diff, "compare two committed steps leaf by leaf (exit 1 if not identical)"
    )
    p.add_argument("a", metavar="ROOT:A", help="first step (ROOT alone: its newest)")
    p.add_argument("b", metavar="ROOT:B", help="second step (ROOT alone: its newest)")
    p.add_argument(
        "c", nargs="?", metavar="B", help="with three arguments, ROOT A B: two steps of one root"
    )
    p.add_argument("--values", action="store_true", help="read changed leaves: max abs difference")
    p.add_argument("--all", action="store_true", help="list identical leaves too")
    p.add_argument(
        "--records-only",
        action="store_true",
        help="compare the manifests' checksums only, reading no data (damage goes unseen)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command(sub, "stats", cmd_stats, "norm, mean, std and max-abs of leaves across steps")
    p.add_argument("root")
    p.add_argument(
        "--leaf", action="append", metavar="GLOB", help="dotted paths to include (repeatable)"
    )
    p.add_argument("--steps", metavar="S,S,...", help="only these steps (default: every committed)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the trajectory (matplotlib)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _step_of(text: str) -> tuple[str, int]:
    root, step = split_source(text)
    protocol = open_root(root)  # fail fast on a wrong root, before jax is imported
    return root, protocol.marker_or_latest(step).step


def cmd_diff(args: argparse.Namespace) -> int:
    if args.c is not None:  # ROOT A B, as verify and inspect take ROOT STEP
        steps = (args.b, args.c)
        if split_source(args.a)[1] is not None or not all(s.isdigit() for s in steps):
            args.parser.error("give ROOT:A ROOT:B, or ROOT A B with two step numbers")
        args.a, args.b = (f"{args.a}:{s}" for s in steps)
    sources = _step_of(args.a), _step_of(args.b)

    from jaxckpt.restoring import open_step
    from jaxckpt.tools import IDENTICAL, diff_steps

    a, b = (open_step(root, step) for root, step in sources)
    result = diff_steps(a, b, values=args.values, check=not args.records_only)
    for d in result.damaged:
        err(f"{d.path}: damaged: {d.detail}")
    if args.json:
        json_out(
            {
                "a": {"root": result.a_root, "step": result.a_step},
                "b": {"root": result.b_root, "step": result.b_step},
                "identical": result.identical,
                "damaged": [d.path for d in result.damaged],
                "counts": result.counts(),
                "leaves": [
                    {
                        "path": d.path,
                        "status": d.status,
                        "a": d.a,
                        "b": d.b,
                        "detail": d.detail,
                        "max_abs_diff": d.max_abs_diff,
                    }
                    for d in result.leaves
                ],
            }
        )
        return 0 if result.identical else 1
    counts = result.counts()
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    print(
        f"{result.a_root}:{result.a_step} vs {result.b_root}:{result.b_step}: "
        f"{len(result.leaves)} leaves, {summary or 'nothing to compare'}"
    )
    shown = [d for d in result.leaves if args.all or d.status != IDENTICAL]
    if shown:
        header = ["STATUS", "PATH", "A", "B"] + (["MAX |A-B|"] if args.values else []) + ["DETAIL"]
        rows = [header]
        for d in shown:
            row = [d.status, d.path, d.a or "-", d.b or "-"]
            if args.values:
                row.append(number(d.max_abs_diff))
            rows.append([*row, d.detail])
        print_table(rows)
    if any(d.status == "unknown" for d in result.leaves) and not args.values:
        print("(unknown: chunk layouts or encodings differ; --values compares the data)")
    return 0 if result.identical else 1


def cmd_stats(args: argparse.Namespace) -> int:
    protocol = open_root(args.root)  # fail fast, before jax is imported
    steps: list[int] | None = None
    if args.steps:
        try:
            steps = [int(s) for s in args.steps.split(",") if s.strip()]
        except ValueError:
            args.parser.error(f"--steps takes step numbers separated by commas, got {args.steps!r}")
        for number_ in steps or ():
            protocol.require_marker(number_)
    elif not protocol.committed():
        err(f"no committed steps under {protocol.storage.uri}")
        return 1

    from jaxckpt.tools import plot, trajectory

    quiet = args.json or not sys.stderr.isatty()

    def progress(step: int) -> None:
        if not quiet:
            print(f"\rreading step {step} ...", end="", file=sys.stderr, flush=True)

    stats = trajectory(args.root, leaves=args.leaf, steps=steps, on_step=progress)
    if not quiet:
        print("\r" + " " * 40 + "\r", end="", file=sys.stderr)
    if not any(s.leaves for s in stats):
        err(f"no array leaf matches {args.leaf} under {protocol.storage.uri}")
        return 1
    if args.plot:
        plot(stats, args.plot, title=f"{protocol.storage.uri}")
    if args.json:
        json_out(
            {
                "root": protocol.storage.uri,
                "steps": [
                    {
                        "step": s.step,
                        "leaves": [vars(x) for x in s.leaves],
                        "combined": vars(s.combined) if s.combined is not None else None,
                    }
                    for s in stats
                ],
                "plot": args.plot,
            }
        )
        return 0
    rows = [["STEP", "LEAF", "NORM", "MEAN", "STD", "MAX |X|"]]
    for s in stats:
        for x in [*s.leaves, *([s.combined] if s.combined is not None else [])]:
            rows.append(
                [
                    str(s.step),
                    x.path,
                    number(x.norm),
                    number(x.mean),
                    number(x.std),
                    number(x.max_abs),
                ]
            )
    print_table(rows, right=(0, 2, 3, 4, 5))
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0
