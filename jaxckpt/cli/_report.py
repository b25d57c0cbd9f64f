"""``jaxckpt report``: goodput and badput of the runs recorded in a root's run ledger."""

from __future__ import annotations

import argparse
from typing import Any

from jaxckpt.cli._common import command
from jaxckpt.cli._output import err, human_bytes, human_duration, json_out, number, print_table


def register(sub: Any) -> None:
    p = command(
        sub,
        "report",
        cmd_report,
        "goodput of the job: wall time, badput by cause, restarts, saves, storage, Daly",
    )
    p.add_argument("root", help="the durable root (its ledger/)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw the timeline into FILE.png or FILE.html (pip install 'jaxckpt[plot]')",
    )


def _s(x: float | None) -> str:
    return "-" if x is None else human_duration(x)


def cmd_report(args: argparse.Namespace) -> int:
    from jaxckpt.ledger import report

    if args.plot and not args.plot.lower().endswith((".png", ".html", ".htm")):
        args.parser.error(f"--plot takes a .png or .html file, got {args.plot!r}")
    r = report(args.root)
    if args.plot:
        from jaxckpt.ledger import plot

        try:
            plot(r, args.plot)
        except ImportError:
            err("--plot needs matplotlib: pip install 'jaxckpt[plot]'")
            return 1
    if args.json:
        json_out(r.to_json())
        return 0
    if not r.runs:
        print(f"{r.root}: no run ledger (ledger/ is empty)")
        return 0
    b = r.badput_s
    print(f"{r.root}: {r.runs} run(s) over {_s(r.wall_s)}, goodput {r.goodput:.3f}")
    rows = [["BADPUT", "TIME", "SHARE"]]
    for name, value in (
        ("save blocking", b.save_blocking),
        ("restore", b.restore),
        ("lost work", b.lost_work),
        ("startup", b.startup),
    ):
        rows.append([name, _s(value), f"{value / r.wall_s:.1%}" if r.wall_s else "-"])
    print_table(rows, right=(1, 2))
    if r.restarts:
        print()
        rows = [
            [
                "RESTART AT",
                "CRASH",
                "RESTORED",
                "REACHED",
                "LOST STEPS",
                "LOST",
                "TIER",
                "WHY",
                "COMPILE",
            ]
        ]
        for x in r.restarts:
            rows.append(
                [
                    _s(x.at_s),
                    "yes" if x.crash else "no",
                    str(x.restored_step if x.restored_step is not None else "-"),
                    str(x.reached_step if x.reached_step is not None else "-"),
                    str(x.lost_steps),
                    _s(x.lost_s),
                    x.tier or "-",
                    x.why or "-",
                    "-" if x.compile_s is None else f"{x.compile} {_s(x.compile_s)}",
                ]
            )
        print_table(rows, right=(0, 2, 3, 4, 5))
    s, st, d = r.saves, r.storage, r.daly
    print()
    print(
        f"saves: {s['count']} ({human_bytes(s['bytes'])}), blocking {_s(s['blocking_s']['total'])} "
        f"in all (median {_s(s['blocking_s']['median'])}), to commit median "
        f"{_s(s['total_s_median'])}, to durable median {_s(s['durable_s_median'])}; "
        f"every {number(s['interval_steps'])} steps / {_s(s['interval_s'])}; "
        f"{s['promoted']} promoted, {s['failed']} failed"
    )
    bill = st["bill_usd"]
    print(
        f"storage: {human_bytes(st['now_bytes'])} now, {human_bytes(st['written_bytes'])} "
        f"written, {human_bytes(st['freed_bytes'])} freed by retention; "
        f"~{st['requests']['writes']:,} writes and ~{st['requests']['reads']:,} reads "
        f"(est. ${bill['requests']:.4f}, "
        f"storage ${bill['storage_per_month']:.4f}/month)"
    )
    if d["optimal_s"] is None:
        print(
            f"daly: no failure recorded; save cost {_s(d['save_cost_s'])}, interval "
            f"{_s(d['interval_s'])}"
        )
    else:
        print(
            f"daly: {d['failures']} failure(s), MTBF {_s(d['mtbf_s'])}, save cost "
            f"{_s(d['save_cost_s'])}: optimal interval {_s(d['optimal_s'])} "
            f"({number(d['optimal_steps'])} steps) against {_s(d['interval_s'])} "
            f"({number(d['interval_steps'])} steps) run"
        )
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0
