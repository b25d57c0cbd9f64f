"""``jaxckpt export`` and ``jaxckpt import``: safetensors and Orbax, both ways."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Literal

from jaxckpt.cli._common import command, open_root, split_source
from jaxckpt.cli._output import Progress, human_bytes, human_duration


def _size(text: str) -> int:
    """``'5GB'`` -> 5e9, ``'500MiB'`` -> 500 * 2**20, ``'1000'`` -> 1000 bytes.

    >>> _size("5GB"), _size("2MiB"), _size("100")
    (5000000000, 2097152, 100)
    """
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    for suffix, scale in units.items():
        if lowered.endswith(suffix):
            lowered, factor = lowered[: -len(suffix)], scale
            break
    else:
        lowered, factor = lowered.rstrip("b"), 1
    try:
        value = int(float(lowered) * factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB or 500MiB)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def register(sub: Any) -> None:
    p = command(
        sub, "export", cmd_export, "write a committed step as safetensors or an Orbax checkpoint"
    )
    p.add_argument("src", metavar="ROOT[:STEP]", help="default step: the newest")
    p.add_argument(
        "out",
        metavar="OUT",
        help="safetensors: a directory (model.safetensors or shards + index) or "
        "FILE.safetensors, local or s3://BUCKET/PREFIX, gs://BUCKET/PREFIX (uploaded in "
        "parts of --max-memory); orbax: a CheckpointManager directory (OUT/<step>/default)",
    )
    p.add_argument("--format", choices=["safetensors", "orbax"], default="safetensors")
    p.add_argument(
        "--layout",
        choices=["manager", "flax"],
        help="orbax: 'manager' (default): OUT/<step>/default, for Orbax's CheckpointManager "
        "and StandardRestore; 'flax': OUT/checkpoint_<step>, for Flax's "
        "flax.training.checkpoints.restore_checkpoint(OUT, target)",
    )
    p.add_argument(
        "--leaf",
        action="append",
        metavar="GLOB",
        help="safetensors: only leaves whose dotted path matches",
    )
    p.add_argument(
        "--max-shard-size", type=_size, help="safetensors: the largest shard (default 5GB)"
    )
    p.add_argument(
        "--max-memory",
        type=_size,
        metavar="SIZE",
        help="safetensors: the most tensor bytes held at once (default: 64 MiB blocks, or a "
        "chunk row if larger); at least three chunks of every leaf",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    p = command(sub, "import", cmd_import, "save safetensors or Orbax checkpoints as new steps")
    p.add_argument(
        "src",
        metavar="SRC",
        help="FILE.safetensors, a shard index, an Orbax CheckpointManager directory (every "
        "step), a Flax checkpoints directory (checkpoint_<N>), or one Orbax step or item",
    )
    p.add_argument(
        "dst", metavar="ROOT[:STEP]", help="default step: the source's, else the newest + 1"
    )
    p.add_argument(
        "--from",
        dest="kind",
        choices=["auto", "safetensors", "orbax"],
        default="auto",
        help="source format (default: from the path)",
    )
    p.add_argument(
        "--step",
        dest="steps",
        type=int,
        action="append",
        metavar="N",
        help="orbax: import Orbax step N only (repeatable; default: every step)",
    )
    p.add_argument(
        "--skip-item",
        action="append",
        default=[],
        metavar="NAME",
        help="orbax: leave out this item of a Composite (recorded in the step's metadata)",
    )
    p.add_argument(
        "--max-bytes",
        type=_size,
        metavar="SIZE",
        help="orbax: the most one step's arrays may claim (default: this host's memory)",
    )


def cmd_export(args: argparse.Namespace) -> int:
    root, step = split_source(args.src)
    protocol = open_root(root)  # fail fast, before jax is imported
    marker = protocol.marker_or_latest(step)
    if args.format == "orbax":
        return _export_orbax(args, root, marker.step)

    from jaxckpt.tools import export_safetensors

    if args.layout:
        args.parser.error("--layout applies to --format orbax only")
    bar = Progress.on_stderr(f"step {marker.step}", marker.nbytes, quiet=args.no_progress)
    result = export_safetensors(
        root,
        args.out,
        step=marker.step,
        leaves=args.leaf,
        max_shard_bytes=args.max_shard_size or _size("5GB"),
        on_progress=bar.update,
        max_memory_bytes=args.max_memory,
    )
    bar.total = result.total_size
    seconds = bar.finish()
    shards = len([f for f in result.files if f.endswith(".safetensors")])
    print(
        f"step {result.step}: exported {result.tensors} tensors "
        f"({human_bytes(result.total_size)}) to {args.out} in {human_duration(seconds)}"
        + (f", {shards} shards" if shards > 1 else "")
    )
    return 0


def _export_orbax(args: argparse.Namespace, root: str, step: int) -> int:
    if args.leaf or args.max_shard_size or args.max_memory:
        args.parser.error(
            "--leaf, --max-shard-size and --max-memory apply to --format safetensors only"
        )
    layout: Literal["manager", "flax"] = args.layout or "manager"
    from jaxckpt.workflows import export_orbax

    start = time.monotonic()
    result = export_orbax(root, args.out, step=step, layout=layout)
    print(
        f"step {result.step}: exported {result.arrays} arrays ({human_bytes(result.nbytes)}) "
        f"to {result.path} (Orbax) in {human_duration(time.monotonic() - start)}"
    )
    return 0


def _kind(src: str, requested: str) -> str:
    if requested != "auto":
        return requested
    if src.endswith((".safetensors", ".json")):
        return "safetensors"
    if os.path.isdir(src) and any(
        f.endswith(".safetensors") or f == "model.safetensors.index.json" for f in os.listdir(src)
    ):
        return "safetensors"
    return "orbax"


def cmd_import(args: argparse.Namespace) -> int:
    from jaxckpt.workflows import ImportSourceError, import_safetensors

    root, step = split_source(args.dst)
    if not os.path.exists(args.src):
        raise ImportSourceError(f"{args.src} does not exist")
    kind = _kind(args.src, args.kind)
    if kind == "safetensors":
        if args.steps or args.skip_item or args.max_bytes:
            args.parser.error("--step, --skip-item and --max-bytes apply to Orbax sources only")
        results = [import_safetensors(args.src, root, step=step)]
    else:
        from jaxckpt.workflows import import_orbax

        if step is not None and args.steps is not None and len(args.steps) != 1:
            args.parser.error(f"ROOT:{step} names the step of one import; choose one --step")
        results = import_orbax(
            args.src,
            root,
            steps=args.steps,
            step=step,
            skip_items=args.skip_item,
            max_bytes=args.max_bytes,
        )
    for result in results:
        print(
            f"{result.root}: committed step {result.step} with {result.arrays} arrays "
            f"({human_bytes(result.nbytes)}) from {kind} {args.src}"
        )
    return 0
