"""``jaxckpt plan``: what a checkpoint interval costs, and Daly's optimal one.

With ``--devices`` and ``--leaves``, also each layout's objects and request cost per
checkpoint (:func:`jaxckpt.planning._costs.object_plan`) and the time floor of one save and one
restore on a far-away store (:mod:`jaxckpt.planning._floors`, which states the model).
With ``--processes``, instead, one save and one restore at cluster scale
(:mod:`jaxckpt.cli._scaleplan`, :mod:`jaxckpt.planning._scale`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

from jaxckpt.cli import _scaleplan
from jaxckpt.cli._common import command, number
from jaxckpt.cli._output import err, json_out

_INTERVAL_OPTIONS = (
    "params",
    "step_seconds",
    "write_gbps",
    "every_steps",
    "mtbf_hours",
    "gpus",
    "gpu_hour_usd",
)
"""Required unless ``--processes`` asks for the scale model only."""
_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def count(text: str) -> float:
    """``'30B'`` or ``'30e9'`` -> ``30e9``.

    >>> count("30B"), count("7e9"), count("1.5t")
    (30000000000.0, 7000000000.0, 1500000000000.0)
    """
    scale = _SUFFIXES.get(text[-1:].lower(), 1.0)
    try:
        value = float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"not a finite number >= 0: {text!r} (e.g. 30e9 or 30B)")
    return value


def register(sub: Any) -> None:
    p = command(sub, "plan", cmd_plan, "what a checkpoint interval costs, and Daly's optimal one")
    p.add_argument("--params", type=count, help="parameter count (30e9 or 30B)")
    p.add_argument("--bytes-per-param", type=number, default=2.0, help="default 2 (bf16)")
    p.add_argument("--step-seconds", type=number, help="seconds per step")
    p.add_argument("--write-gbps", type=number, help="write speed, GB/s")
    p.add_argument("--every-steps", type=int, help="save every N steps")
    p.add_argument("--mtbf-hours", type=number, help="job's mean time to failure")
    p.add_argument("--gpus", type=int, help="GPUs idle during a blocking save")
    p.add_argument("--gpu-hour-usd", type=number, help="price of a GPU-hour")
    p.add_argument("--run-hours", type=number, default=504.0, help="training hours (default 504)")
    p.add_argument(
        "--async-blocking-seconds",
        type=number,
        help="blocking seconds of an async save (default: saves are synchronous)",
    )
    p.add_argument("--devices", type=int, help="devices the state is sharded over (with --leaves)")
    p.add_argument("--leaves", type=int, help="array leaves of the state (with --devices)")
    p.add_argument("--devices-per-process", type=int, default=8, help="default 8 (one per host)")
    p.add_argument(
        "--write-usd-per-1000", type=number, default=0.005, help="PUT/LIST price (default 0.005)"
    )
    p.add_argument(
        "--write-requests-per-s",
        type=number,
        default=1000.0,
        help="the bucket's write request rate (default 1000, a new GCS bucket)",
    )
    p.add_argument(
        "--max-object-bytes",
        type=int,
        help="the largest object a save writes (default CheckpointOptions.max_object_bytes)",
    )
    p.add_argument(
        "--objects-in-flight",
        type=int,
        help="packs uploading and reads in flight (default CheckpointOptions.objects_in_flight)",
    )
    # The time floors of one save and one restore (with --devices/--leaves);
    # see jaxckpt.planning._floors.
    p.add_argument(
        "--conn-mbps", type=number, default=85.0, help="MB/s per connection (default 85, AWS)"
    )
    p.add_argument("--rtt-ms", type=number, default=20.0, help="round trip, ms (default 20)")
    p.add_argument(
        "--host-gbps", type=number, default=1.25, help="host NIC, GB/s (default 1.25: 10 Gb/s)"
    )
    p.add_argument(
        "--connections",
        type=int,
        help="requests in flight per process (default ObjectStoreOptions.request_concurrency, 32)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    _scaleplan.register_options(p)
    p.set_defaults(plan_parser=p)


def cmd_plan(args: argparse.Namespace) -> int:
    from jaxckpt.planning import plan

    if args.processes is not None:
        try:
            return _scaleplan.run(args, _link(args))
        except ValueError as e:
            err(str(e))
            return 2
    missing = [f"--{n.replace('_', '-')}" for n in _INTERVAL_OPTIONS if getattr(args, n) is None]
    if missing:
        args.plan_parser.error(f"the following arguments are required: {', '.join(missing)}")
    try:
        result = plan(
            params=args.params,
            bytes_per_param=args.bytes_per_param,
            step_seconds=args.step_seconds,
            write_gbps=args.write_gbps,
            every_steps=args.every_steps,
            mtbf_hours=args.mtbf_hours,
            gpus=args.gpus,
            gpu_hour_usd=args.gpu_hour_usd,
            run_hours=args.run_hours,
            async_blocking_seconds=args.async_blocking_seconds,
        )
        layouts = _layouts(args, result.checkpoint_gb * 1e9, result.checkpoints)
        timed = _floors(args, result.checkpoint_gb * 1e9) if layouts else None
    except ValueError as e:
        err(str(e))
        return 2
    if args.json:
        out: dict[str, Any] = dict(result.to_dict())
        for key in _LAYOUT_KEYS if layouts else ():
            out[key] = {name: getattr(cost, key) for name, cost in layouts.items()}
        if timed is not None:
            link, floors = timed
            for key in _FLOOR_KEYS:
                out[key] = {name: getattr(f, key) for name, f in floors.items()}
            out["link"] = _link_dict(link)
        json_out(out)
    else:
        print(result.format_text())
        if layouts:
            print(_layout_table(layouts))
        if timed is not None:
            print(_floor_table(*timed))
    return 0


_LAYOUT_KEYS = (
    "objects_per_checkpoint",
    "requests_per_checkpoint",
    "request_cost_usd",
    "request_seconds",
    "run_request_cost_usd",
)


_FLOOR_KEYS = (
    "objects_per_process",
    "save_requests_per_process",
    "restore_requests_per_process",
    "save_in_flight",
    "restore_in_flight",
    "save_floor_s",
    "restore_floor_s",
    "save_bound",
    "restore_bound",
)


def _link_dict(link: Any) -> dict[str, float]:
    return {
        "conn_mbps": link.conn_bytes_per_s / 1e6,
        "rtt_ms": link.rtt_s * 1e3,
        "host_gbps": link.host_bytes_per_s / 1e9,
        "connections": link.connections,
    }


def _floors(args: argparse.Namespace, checkpoint_bytes: float) -> tuple[Any, dict[str, Any]]:
    from jaxckpt.planning import floors, process_share

    share = process_share(
        checkpoint_bytes=checkpoint_bytes,
        leaves=args.leaves,
        devices=args.devices,
        devices_per_process=args.devices_per_process,
        max_object_bytes=args.max_object_bytes,
        objects_in_flight=args.objects_in_flight,
    )
    link = _link(args)
    return link, floors(share, leaves=args.leaves, link=link)


def _link(args: argparse.Namespace) -> Any:
    from jaxckpt.planning import Link

    extra = {} if args.connections is None else {"connections": args.connections}
    return Link(
        conn_bytes_per_s=args.conn_mbps * 1e6,
        rtt_s=args.rtt_ms / 1e3,
        host_bytes_per_s=args.host_gbps * 1e9,
        **extra,
    )


def _layouts(args: argparse.Namespace, checkpoint_bytes: float, checkpoints: int) -> dict[str, Any]:
    if args.devices is None and args.leaves is None:
        return {}
    if args.devices is None or args.leaves is None:
        raise ValueError("--devices and --leaves go together")
    from jaxckpt.planning import object_plan

    return object_plan(
        checkpoint_bytes=checkpoint_bytes,
        leaves=args.leaves,
        devices=args.devices,
        devices_per_process=args.devices_per_process,
        max_object_bytes=args.max_object_bytes,
        objects_in_flight=args.objects_in_flight,
        write_usd_per_1000=args.write_usd_per_1000,
        write_requests_per_s=args.write_requests_per_s,
        checkpoints=max(1, checkpoints),
    )


def _layout_table(layouts: dict[str, Any]) -> str:
    rows = [("layout", "objects", "requests", "request cost", "request time", "run request cost")]
    for name, c in layouts.items():
        rows.append(
            (
                name,
                f"{c.objects_per_checkpoint:,}",
                f"{c.requests_per_checkpoint:,}",
                f"${c.request_cost_usd:,.3f}",
                f"{c.request_seconds:,.1f} s",
                f"${c.run_request_cost_usd:,.0f}",
            )
        )
    return _table("per checkpoint, by layout:", rows)


def _floor_table(link: Any, floors: dict[str, Any]) -> str:
    d = _link_dict(link)
    title = (
        "time floor of one save and one restore per process, by layout\n"
        f"({d['conn_mbps']:g} MB/s per connection, {d['rtt_ms']:g} ms round trip, "
        f"{d['host_gbps']:g} GB/s host, at most {d['connections']} requests in flight):"
    )
    rows = [("layout", "objects", "save", "bound by", "restore", "bound by")]
    for name, f in floors.items():
        rows.append(
            (
                name,
                f"{f.objects_per_process:,}",
                f"{f.save_floor_s:,.2f} s",
                f"{f.save_bound} ({f.save_in_flight} in flight)",
                f"{f.restore_floor_s:,.2f} s",
                f"{f.restore_bound} ({f.restore_in_flight} in flight)",
            )
        )
    return _table(title, rows, left={0, 3, 5})


def _table(
    title: str, rows: Sequence[tuple[str, ...]], left: frozenset[int] | set[int] = frozenset({0})
) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["", title]
    for r in rows:
        lines.append(
            "  ".join(
                v.ljust(w) if i in left else v.rjust(w)
                for i, (v, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )
    return "\n".join(lines)
