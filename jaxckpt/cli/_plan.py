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
    except ValueError as e:
        err(str(e))
        return 2
    if args.json:
        json_out(result.to_dict())
    else:
        print(result.format_text())
    return 0
