"""``jaxckpt plan``: what a checkpoint interval costs, and Daly's optimal one."""

from __future__ import annotations

import argparse
from typing import Any

from jaxckpt.cli._common import command
from jaxckpt.cli._output import err, json_out

_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def count(text: str) -> float:
    """``'30B'`` or ``'30e9'`` -> ``30e9``.

    >>> count("30B"), count("7e9"), count("1.5t")
    (30000000000.0, 7000000000.0, 1500000000000.0)
    """
    scale = _SUFFIXES.get(text[-1:].lower(), 1.0)
    try:
        return float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (e.g. 30e9 or 30B)") from None


def register(sub: Any) -> None:
    p = command(sub, "plan", cmd_plan, "what a checkpoint interval costs, and Daly's optimal one")
    p.add_argument("--params", type=count, required=True, help="parameter count (30e9 or 30B)")
    p.add_argument("--bytes-per-param", type=float, default=2.0, help="default 2 (bf16)")
    p.add_argument("--step-seconds", type=float, required=True, help="seconds per step")
    p.add_argument("--write-gbps", type=float, required=True, help="write speed, GB/s")
    p.add_argument("--every-steps", type=int, required=True, help="save every N steps")
    p.add_argument("--mtbf-hours", type=float, required=True, help="job's mean time to failure")
    p.add_argument("--gpus", type=int, required=True, help="GPUs idle during a blocking save")
    p.add_argument("--gpu-hour-usd", type=float, required=True, help="price of a GPU-hour")
    p.add_argument("--run-hours", type=float, default=504.0, help="training hours (default 504)")
    p.add_argument(
        "--async-blocking-seconds",
        type=float,
        help="blocking seconds of an async save (default: saves are synchronous)",
    )
    p.add_argument("--devices", type=int, help="devices the state is sharded over (with --leaves)")
    p.add_argument("--leaves", type=int, help="array leaves of the state (with --devices)")
    p.add_argument("--devices-per-process", type=int, default=8, help="default 8 (one per host)")
    p.add_argument(
        "--write-usd-per-1000", type=float, default=0.005, help="PUT/LIST price (default 0.005)"
    )
    p.add_argument(
        "--write-requests-per-s",
        type=float,
        default=1000.0,
        help="the bucket's write request rate (default 1000, a new GCS bucket)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_plan(args: argparse.Namespace) -> int:
    from jaxckpt._plan import plan

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
    except ValueError as e:
        err(str(e))
        return 2
    if args.json:
        out: dict[str, Any] = dict(result.to_dict())
        for key in _LAYOUT_KEYS if layouts else ():
            out[key] = {name: getattr(cost, key) for name, cost in layouts.items()}
        json_out(out)
    else:
        print(result.format_text())
        if layouts:
            print(_layout_table(layouts))
    return 0


_LAYOUT_KEYS = (
    "objects_per_checkpoint",
    "requests_per_checkpoint",
    "request_cost_usd",
    "request_seconds",
    "run_request_cost_usd",
)


def _layouts(args: argparse.Namespace, checkpoint_bytes: float, checkpoints: int) -> dict[str, Any]:
    if args.devices is None and args.leaves is None:
        return {}
    if args.devices is None or args.leaves is None:
        raise ValueError("--devices and --leaves go together")
    from jaxckpt._plan import object_plan

    return object_plan(
        checkpoint_bytes=checkpoint_bytes,
        leaves=args.leaves,
        devices=args.devices,
        devices_per_process=args.devices_per_process,
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
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["", "per checkpoint, by layout:"]
    for r in rows:
        lines.append(
            "  ".join(
                v.ljust(w) if i == 0 else v.rjust(w)
                for i, (v, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return "\n".join(lines)
