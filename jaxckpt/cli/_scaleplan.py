"""``jaxckpt plan --processes N[,N...]``: one save and one restore at cluster scale.

The model is :mod:`jaxckpt.planning._scale` (its docstring states it; the counts per
process are :mod:`jaxckpt.planning._profiles`', what it assumes
:mod:`jaxckpt.planning._assumptions`'); this module
reads the options, prints the table and every assumption, or ``--json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from jaxckpt.cli._common import number
from jaxckpt.cli._output import json_out
from jaxckpt.records import SPREAD_SLOTS


def register_options(p: argparse.ArgumentParser) -> None:
    """The scale model's options of ``jaxckpt plan``."""
    g = p.add_argument_group(
        "scale model (--processes): requests, metadata, coordination and store limits"
    )
    g.add_argument(
        "--processes",
        type=_counts,
        help="process counts, e.g. 1024,8192: model one save and one restore at each "
        "(the interval-cost options are then not needed)",
    )
    g.add_argument(
        "--counts",
        default="measured",
        help="per-process counts: 'measured' (the current format's, fit to the `bench.py "
        "scale --json` report shipped with jaxckpt), 'before' (the code before format 4, "
        "for comparison), 'target' (the protocol format 4 was built to), or a `bench.py "
        "scale --json` file to fit (default measured)",
    )
    g.add_argument(
        "--prefixes",
        type=int,
        default=SPREAD_SLOTS,
        help=f"key prefixes a step's objects spread over (default {SPREAD_SLOTS}: format 4's "
        "hashed prefixes; 1: a format 2-3 step)",
    )
    g.add_argument(
        "--state-bytes", type=number, default=1.1e12, help="default 1.1e12 (70B with Adam)"
    )
    g.add_argument("--stores", default="s3,gcs", help="comma-separated: s3, gcs (default both)")
    g.add_argument(
        "--packs",
        choices=("budget", "fixed"),
        default="budget",
        help="packs per process: 'budget' (what a save writes: fewer, larger packs where "
        "the job's packs would outlast the link at the store's write rate) or 'fixed' "
        "(objects_in_flight each, as saves did before; for comparison) (default budget)",
    )


def _counts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not process counts: {text!r} (e.g. 1024,8192)") from None
    if not values:
        raise argparse.ArgumentTypeError("no process counts given")
    return values


def profile_of(text: str) -> Any:
    """A named profile, or one fit to a ``bench.py scale --json`` report."""
    from jaxckpt.planning import fit_profile, named_profiles

    profiles = named_profiles()
    if text in profiles:
        return profiles[text]
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"--counts {text!r}: not {', '.join(profiles)} nor a report file")
    try:
        return fit_profile(json.loads(path.read_text()), name=path.name)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"--counts {text}: not a bench.py scale report ({e})") from e


def run(args: argparse.Namespace, link: Any) -> int:
    """Prints the model for ``args.processes`` (raises ValueError on a bad option)."""
    from jaxckpt.planning import assumptions, scale_plan, to_dict

    profile = profile_of(args.counts)
    leaves = args.leaves or 2200
    rows = scale_plan(
        processes=args.processes,
        profile=profile,
        state_bytes=args.state_bytes,
        leaves=leaves,
        devices_per_process=args.devices_per_process,
        prefixes=args.prefixes,
        stores=[s.strip() for s in args.stores.split(",") if s.strip()],
        link=link,
        write_budget=args.packs == "budget",
    )
    notes = assumptions(
        profile,
        prefixes=args.prefixes,
        link=link,
        state_bytes=args.state_bytes,
        leaves=leaves,
        dpp=args.devices_per_process,
    )
    notes.append(
        "packs per process: under each store's write rate (jaxckpt.records._writebudget)"
        if args.packs == "budget"
        else "packs per process: objects_in_flight each, without the store's write budget"
    )
    if args.json:
        json_out({"assumptions": notes, "rows": [to_dict(r) for r in rows]})
        return 0
    print(_table(rows))
    print("\nassumptions:")
    for line in notes:
        print(f"- {line}")
    return 0


def _table(rows: list[Any]) -> str:
    head = (
        "store",
        "N",
        "phase",
        "requests/proc P0 / other",
        "store requests (W/R)",
        "metadata MB P0 / other",
        "coord calls P0 / all",
        "time s",
        "store limit",
    )
    body = [head]
    for r in rows:
        if r.fails:
            verdict = f"exceeded ({r.limit_s:,.1f} s): fails, retries give up"
        elif r.limit_exceeded:
            verdict = f"exceeded ({r.limit_s:,.1f} s): throttled"
        else:
            verdict = "ok"
        body.append(
            (
                r.store,
                f"{r.processes:,}",
                r.phase,
                f"{r.requests_primary:,.0f} / {r.requests_other:,.0f}",
                f"{r.cluster_writes:,.0f} / {r.cluster_reads:,.0f}",
                f"{r.metadata_mb_primary:,.1f} / {r.metadata_mb_other:,.1f}",
                f"{r.coordination_primary:,.0f} / {r.coordination_cluster:,.0f}",
                f"{r.time_s:,.1f}",
                verdict,
            )
        )
    widths = [max(len(row[i]) for row in body) for i in range(len(head))]
    left = {0, 2, 8}
    return "\n".join(
        "  ".join(
            v.ljust(w) if i in left else v.rjust(w)
            for i, (v, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in body
    )
