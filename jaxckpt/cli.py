"""The ``jaxckpt`` command line: list, inspect, verify, prune, collect and copy checkpoints.

Every command works on a local directory, ``gs://bucket/prefix`` or ``s3://bucket/prefix``
root (endpoints come from the environment, see the README). ``ls``, ``inspect``, ``prune``,
``gc`` and ``plan`` read only the commit protocol's JSON records and never import jax, so
they start fast; ``verify`` and ``cp --compress`` use TensorStore through jaxckpt's array I/O.

Errors print one line, ``jaxckpt: error: ...``, on stderr and exit with status 1 (2 for
bad arguments).

>>> main(["plan", "--params", "30B", "--step-seconds", "2.5", "--write-gbps", "1.2",
...       "--every-steps", "1000", "--mtbf-hours", "24", "--gpus", "64",
...       "--gpu-hour-usd", "4"])  # doctest: +ELLIPSIS
checkpoint size ...60.0 GB
save time ...50.0 s
blocking overhead ...2.00 % of training time
...
0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from jaxckpt import policy
from jaxckpt._commit import (
    TREE_FILE,
    CommitProtocol,
    retention_decision,
)
from jaxckpt._copy import copy_step
from jaxckpt._records import CommitMarker, load_json_record, path_text
from jaxckpt._storage import LocalStorage, open_storage
from jaxckpt._telemetry import human_bytes
from jaxckpt._versions import versions_text
from jaxckpt.errors import CheckpointError, NotACheckpointRootError

__all__ = ["main"]

# ------------------------------------------------------------------------------ helpers


def human_duration(seconds: float) -> str:
    """``90`` -> ``'1.5 min'``.

    >>> human_duration(0.25), human_duration(42), human_duration(3600), human_duration(2e5)
    ('250 ms', '42.0 s', '1.0 h', '2.3 d')
    """
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 90:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _local_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _ago(t: float) -> str:
    return f"{human_duration(max(0.0, time.time() - t))} ago"


def _err(message: str) -> None:
    print(f"jaxckpt: error: {message}", file=sys.stderr)


def _open_root(uri: str, *, create: bool = False) -> CommitProtocol:
    """The protocol of an existing root (or, with ``create``, a new one).

    Raises:
      NotACheckpointRootError: the directory does not exist or has no root record.
    """
    storage = open_storage(uri)
    if not create and isinstance(storage, LocalStorage) and not os.path.isdir(storage.uri):
        raise NotACheckpointRootError(f"{storage.uri} does not exist")
    protocol = CommitProtocol(storage)
    protocol.ensure_root(create=create)
    return protocol


def _print_table(rows: Sequence[Sequence[str]], out: TextIO, right: Sequence[int] = ()) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip(), file=out)


def _itemsize(dtype: str) -> int:
    """Bytes per element of a zarr v3 / numpy dtype name, without importing numpy.

    >>> _itemsize("bfloat16"), _itemsize("bool"), _itemsize("complex64"), _itemsize("float8_e4m3fn")
    (2, 1, 8, 1)
    """
    if dtype == "bool":
        return 1
    bits = re.search(r"\d+", dtype)
    return max(1, int(bits.group()) // 8) if bits else 1


def _describe_sharding(sharding: dict[str, Any] | None) -> str:
    if not sharding:
        return "-"
    kind = sharding.get("type", "?")
    if kind == "NamedSharding":
        mesh = ",".join(f"{k}={v}" for k, v in sharding.get("mesh", {}).items())
        spec = ", ".join(
            "None" if p is None else repr(tuple(p)) if isinstance(p, list) else repr(p)
            for p in sharding.get("spec", [])
        )
        return f"Named({mesh}; P({spec}))"
    if kind == "host":
        return "host"
    devices = sharding.get("devices")
    return f"{kind}({devices} devices)" if devices is not None else str(kind)


def _retention(args: argparse.Namespace) -> policy.RetentionPolicy | None:
    series = None
    if args.keep_milestones is not None:
        series = [int(s) for s in args.keep_milestones.split(",") if s.strip()]
    return policy.retention_from(
        keep_last=args.keep_last, keep_milestones=series, keep_every=args.keep_every
    )


def _json_out(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, allow_nan=True))


# ---------------------------------------------------------------------------------- ls


def cmd_ls(args: argparse.Namespace) -> int:
    from jaxckpt._gc import scan

    protocol = _open_root(args.root)
    found = scan(protocol, full=True)
    committed = dict(sorted(found.committed.items()))
    partial = [a for a in found.attempts if a.kind != "damaged"]
    retention = _retention(args)
    decision = retention_decision(committed, retention)
    if args.json:
        _json_out(
            {
                "root": protocol.storage.uri,
                "committed": [
                    {
                        "step": s,
                        "nbytes": m.nbytes,
                        "commit_time": m.time,
                        "keep": m.keep,
                        "metrics": dict(m.metrics),
                        "kept_by": list(decision.keep.get(s, ())),
                    }
                    for s, m in committed.items()
                ],
                "partial": [
                    {
                        "step": p.step,
                        "attempt": p.location.attempt,
                        "kind": p.kind,
                        "operation": p.operation,
                        "started": p.started,
                    }
                    for p in partial
                ],
                "damaged": [
                    {"step": s, "marker": protocol.where(r.key)} for s, r in found.damaged.items()
                ],
                "fenced": [
                    {"step": m.step, "epoch": m.epoch, "attempt": m.attempt} for m in found.hidden
                ],
            }
        )
        return 0
    total = sum(m.nbytes for m in committed.values())
    print(
        f"{protocol.storage.uri}: {len(committed)} committed steps ({human_bytes(total)})"
        + (f", {len(partial)} partial or orphaned" if partial else "")
        + (f", {len(found.damaged)} DAMAGED" if found.damaged else "")
        + (f", {len(found.hidden)} fenced" if found.hidden else "")
    )
    if not committed and not partial and not found.damaged and not found.hidden:
        return 0
    rows = [["STEP", "STATE", "SIZE", "COMMITTED", "KEPT BY"]]
    for s, m in committed.items():
        reasons = decision.keep.get(s, ())
        if retention is None:
            reasons = tuple(r for r in reasons if r != "no retention policy")
            kept = ", ".join(reasons)
        else:
            kept = ", ".join(reasons) or "- (prune would delete)"
        when = f"{_local_time(m.time)} ({_ago(m.time)})"
        rows.append([str(s), "committed", human_bytes(m.nbytes), when, kept])
    for p in partial:
        age = p.age(time.time())
        when = f"started {_ago(time.time() - age)}" if age is not None else "-"
        state = f"partial ({p.operation})" if p.kind == "partial" else "orphaned"
        rows.append([str(p.step), state, "-", when, f"attempt {p.location.attempt or '(v1)'}"])
    for s, ref in found.damaged.items():
        rows.append([str(s), "DAMAGED", "-", "-", f"invalid commit marker {ref.key}; data kept"])
    for m in found.hidden:
        rows.append([str(m.step), "fenced", "-", "-", f"committed by fenced epoch {m.epoch}"])
    rows[1:] = sorted(rows[1:], key=lambda r: int(r[0]))
    _print_table(rows, sys.stdout, right=(0, 2))
    if retention is None:
        print(
            "(pass --keep-last/--keep-milestones/--keep-every to see what a retention rule keeps)"
        )
    if partial:
        print("(partial steps are saves under way or interrupted; `jaxckpt gc` removes old ones)")
    return 0


# ----------------------------------------------------------------------------- inspect


def _stored_bytes(protocol: CommitProtocol, marker: CommitMarker) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for part in protocol.read_manifest(marker):
        for name, chunks in part.arrays.items():
            sizes[name] = sizes.get(name, 0) + sum(c.size for c in chunks)
    return sizes


def _step_or_latest(protocol: CommitProtocol, step: int | None) -> CommitMarker:
    if step is not None:
        return protocol.require_marker(step)
    committed = protocol.committed()
    if not committed:
        raise NotACheckpointRootError(f"no committed steps under {protocol.storage.uri}")
    return committed[max(committed)]


def cmd_inspect(args: argparse.Namespace) -> int:
    protocol = _open_root(args.root)
    marker = _step_or_latest(protocol, args.step)
    tree = load_json_record(protocol.read_step_file(marker, TREE_FILE), TREE_FILE)
    stored = _stored_bytes(protocol, marker)
    leaves: list[dict[str, Any]] = []
    for leaf in tree["leaves"]:
        is_value = leaf["kind"] == "value"
        shape = None if is_value else list(leaf["shape"])
        leaves.append(
            {
                "path": path_text(leaf["path"]),
                "kind": leaf["kind"],
                "shape": shape,
                "dtype": leaf.get("dtype"),
                "sharding": leaf.get("sharding"),
                "chunk_shape": leaf.get("chunk_shape"),
                "key_impl": leaf.get("key_impl"),
                "nbytes": 0 if is_value else math.prod(shape or []) * _itemsize(leaf["dtype"]),
                "stored_bytes": stored.get(leaf.get("name") or "", 0),
                "value": leaf.get("value"),
            }
        )
    if args.json:
        _json_out(
            {
                "root": protocol.storage.uri,
                "step": marker.step,
                "commit_time": marker.time,
                "nbytes": marker.nbytes,
                "keep": marker.keep,
                "metrics": dict(marker.metrics),
                "metadata": tree.get("metadata"),
                "versions": tree.get("versions"),
                "leaves": leaves,
            }
        )
        return 0
    arrays = [x for x in leaves if x["kind"] != "value"]
    print(
        f"step {marker.step} of {protocol.storage.uri}: committed {_local_time(marker.time)}, "
        f"{len(arrays)} arrays ({human_bytes(sum(x['nbytes'] for x in arrays))}, "
        f"{human_bytes(marker.nbytes)} stored), {len(leaves) - len(arrays)} values"
        + (", pinned" if marker.keep else "")
    )
    print(f"written by: {versions_text(tree.get('versions'))}")
    if marker.metrics:
        print("metrics: " + ", ".join(f"{k}={v:g}" for k, v in marker.metrics.items()))
    if tree.get("metadata") is not None:
        print(f"metadata: {json.dumps(tree['metadata'])}")
    rows = [["PATH", "KIND", "SHAPE", "DTYPE", "SHARDING", "BYTES"]]
    for x in leaves:
        if x["kind"] == "value":
            text = repr(x["value"])
            rows.append([x["path"], "value", "", "", text[:60], ""])
            continue
        kind = f"key<{x['key_impl']}>" if x["kind"] == "key" else x["kind"]
        dims = x["shape"]
        shape_text = "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"
        sharding = _describe_sharding(x["sharding"])
        rows.append([x["path"], kind, shape_text, x["dtype"], sharding, human_bytes(x["nbytes"])])
    _print_table(rows, sys.stdout, right=(5,))
    return 0


# ------------------------------------------------------------------------------ verify


class Progress:
    """A one-line progress bar with human sizes, redrawn at most every ``interval`` s."""

    def __init__(
        self, label: str, total: int, *, stream: TextIO, enabled: bool, interval: float = 0.1
    ) -> None:
        self.label, self.total, self.done = label, total, 0
        self._stream, self._enabled, self._interval = stream, enabled, interval
        self._start = self._last = time.monotonic()

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self._enabled and now - self._last >= self._interval:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        bar = "#" * round(30 * frac)
        rate = self.done / max(now - self._start, 1e-9)
        self._stream.write(
            f"\r{self.label} [{bar:<30}] {100 * frac:5.1f}% "
            f"{human_bytes(self.done)} / {human_bytes(self.total)} ({human_bytes(rate)}/s)"
        )
        self._stream.flush()

    def finish(self) -> float:
        """Draws the final state and ends the line; returns the elapsed seconds."""
        now = time.monotonic()
        if self._enabled:
            self._draw(now)
            self._stream.write("\n")
            self._stream.flush()
        return now - self._start


def cmd_verify(args: argparse.Namespace) -> int:
    import tensorstore as ts

    from jaxckpt._verify import verify_step

    protocol = _open_root(args.root)
    committed = protocol.committed()
    if args.all:
        steps = list(committed)
    elif args.step is not None:
        steps = [protocol.require_marker(args.step).step]
    else:
        steps = [_step_or_latest(protocol, None).step]
    context = ts.Context(protocol.storage.context_spec())
    show = not args.json and not args.no_progress and sys.stderr.isatty()
    reports = []
    for step in steps:
        marker = committed.get(step) or protocol.require_marker(step)
        bar = Progress(f"step {step}", marker.nbytes, stream=sys.stderr, enabled=show)
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
        _err(f"step {s}: the commit marker is damaged; the step cannot be restored")
    bad = [r.step for r in reports if not r.ok] + damaged
    if args.json:
        _json_out(
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
        _err(f"{len(bad)} of {len(reports)} steps failed verification: {bad}")
    else:
        print(f"all {len(reports)} verified steps are intact")
    return 1 if bad else 0


# ------------------------------------------------------------------------------- prune


def cmd_prune(args: argparse.Namespace) -> int:
    retention = _retention(args)
    if retention is None:
        _err("prune needs a retention rule: --keep-last, --keep-milestones or --keep-every")
        return 2
    protocol = _open_root(args.root)
    committed = protocol.committed()
    decision = retention_decision(committed, retention)
    verb = "would delete" if args.dry_run else "delete"
    for s in committed:
        if s in decision.keep:
            print(f"keep    {s:>10}  {', '.join(decision.keep[s])}")
        else:
            print(f"{verb:<7} {s:>10}  {human_bytes(committed[s].nbytes)}")
            if not args.dry_run:
                protocol.delete(s)
    reclaimed = sum(committed[s].nbytes for s in decision.delete)
    n = len(decision.delete)
    summary = f"{n} step{'s' if n != 1 else ''}, reclaiming {human_bytes(reclaimed)}"
    print(f"would delete {summary} (dry run)" if args.dry_run else f"deleted {summary}")
    return 0


# ---------------------------------------------------------------------------------- gc


def cmd_gc(args: argparse.Namespace) -> int:
    from jaxckpt._gc import collect, is_live, scan

    protocol = _open_root(args.root)
    now = time.time()
    found = scan(protocol, full=True)
    current = found.epochs.newest
    old = []
    for p in found.attempts:
        age = p.age(now)
        age_text = f"started {_ago(now - age)}" if age is not None else "age unknown"
        if p.step in found.damaged and not args.force:
            action = "keep (damaged step)"
        elif is_live(p, current, args.grace, now):
            action = "keep (within grace period)"
        else:
            old.append(p)
            action = "would remove" if args.dry_run else "remove"
        what = f"{p.kind} {p.operation or ''}".strip()
        print(f"{action:<26} step {p.step} ({what}, {age_text}): {p.location.attempt or 'v1'}")
    for m in found.hidden:
        print(
            f"{'would remove' if args.dry_run else 'remove':<26} step {m.step} "
            f"(committed by fenced epoch {m.epoch} after a takeover)"
        )
    for s, ref in found.damaged.items():
        action = ("would remove" if args.dry_run else "remove") if args.force else "keep"
        print(
            f"{action:<26} step {s}: damaged commit marker {ref.key}"
            + ("" if args.force else " (use --force to remove)")
        )
    if args.dry_run:
        print(f"would remove {len(old) + len(found.hidden)} attempts")
        return 0
    removed = collect(protocol, found, grace_s=args.grace, force=args.force)
    print(f"removed {len(removed)} attempts (grace {human_duration(args.grace)})")
    return 0


# ---------------------------------------------------------------------------------- cp


def _split_source(text: str) -> tuple[str, int | None]:
    """``'gs://b/run:300'`` -> ``('gs://b/run', 300)``.

    >>> _split_source("s3://bucket/run"), _split_source("/tmp/run:12")
    (('s3://bucket/run', None), ('/tmp/run', 12))
    """
    root, sep, tail = text.rpartition(":")
    if sep and tail.isdigit() and root and not root.endswith(":/"):
        return root, int(tail)
    return text, None


def cmd_cp(args: argparse.Namespace) -> int:
    src_uri, only = _split_source(args.src)
    src = _open_root(src_uri)
    dst = _open_root(args.dst, create=True)
    if src.storage.uri == dst.storage.uri:
        _err(f"source and destination are the same root: {src.storage.uri}")
        return 2
    markers = [src.require_marker(only)] if only is not None else list(src.committed().values())
    existing = dst.committed()
    for marker in markers:
        step = marker.step
        if step in existing:
            print(f"step {step}: already committed under {dst.storage.uri}, skipped")
            continue
        start = time.monotonic()
        nbytes = copy_step(src, dst, marker, compress=args.compress, level=args.level)
        seconds = time.monotonic() - start
        ratio = f", {nbytes / marker.nbytes:.0%} of the source" if args.compress else ""
        print(
            f"step {step}: copied {human_bytes(nbytes)} in {human_duration(seconds)} "
            f"({human_bytes(nbytes / max(seconds, 1e-9))}/s{ratio})"
        )
    print(f"{dst.storage.uri}: {len(dst.committed())} committed steps")
    return 0


# -------------------------------------------------------------------------------- plan


_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _count(text: str) -> float:
    """``'30B'`` or ``'30e9'`` -> ``30e9``.

    >>> _count("30B"), _count("7e9"), _count("1.5t")
    (30000000000.0, 7000000000.0, 1500000000000.0)
    """
    scale = _SUFFIXES.get(text[-1:].lower(), 1.0)
    try:
        return float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (e.g. 30e9 or 30B)") from None


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
        _err(str(e))
        return 2
    if args.json:
        _json_out(result.to_dict())
    else:
        print(result.format_text())
    return 0


# ------------------------------------------------------------------------------ parser


def _add_retention_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-last", type=int, metavar="K", help="keep the K newest steps")
    p.add_argument(
        "--keep-milestones",
        nargs="?",
        const="1,2,5",
        metavar="S,S,...",
        help="keep the first step at or after each s*10^j (default series 1,2,5)",
    )
    p.add_argument("--keep-every", type=int, metavar="N", help="keep steps that are multiples of N")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxckpt", description="Inspect and manage jaxckpt checkpoint roots."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> Any:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=fn)
        return p

    p = command("ls", cmd_ls, "list committed and partial steps with sizes and commit times")
    p.add_argument("root")
    _add_retention_flags(p)
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("inspect", cmd_inspect, "show a step's tree: shapes, dtypes, shardings, bytes")
    p.add_argument("root")
    p.add_argument("step", nargs="?", type=int, help="default: the newest committed step")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("verify", cmd_verify, "re-read every chunk and check it against its CRC32C")
    p.add_argument("root")
    p.add_argument("step", nargs="?", type=int, help="default: the newest committed step")
    p.add_argument("--all", action="store_true", help="verify every committed step")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("prune", cmd_prune, "delete committed steps a retention rule does not keep")
    p.add_argument("root")
    _add_retention_flags(p)
    p.add_argument("--dry-run", action="store_true", help="only say what would be deleted")

    p = command("gc", cmd_gc, "remove partial (uncommitted) steps older than a grace period")
    p.add_argument("root")
    p.add_argument("--grace", type=float, default=3600.0, metavar="SECONDS", help="default 3600")
    p.add_argument(
        "--force", action="store_true", help="also remove damaged commit markers and their data"
    )
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")

    p = command("cp", cmd_cp, "copy committed steps to another root, committing each there")
    p.add_argument("src", metavar="SRC_ROOT[:STEP]")
    p.add_argument("dst", metavar="DST_ROOT")
    p.add_argument("--compress", choices=["zstd"], help="re-encode the arrays with zstd")
    p.add_argument("--level", type=int, default=3, help="zstd level (default 3)")

    p = command("plan", cmd_plan, "what a checkpoint interval costs, and Daly's optimal one")
    p.add_argument("--params", type=_count, required=True, help="parameter count (30e9 or 30B)")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``jaxckpt`` command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CheckpointError as e:
        _err(str(e).replace("\n", "; "))
        return 1
    except BrokenPipeError:  # e.g. `jaxckpt ls ROOT | head`: stop quietly, like other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # a storage failure not translated at the boundary
        _err(str(e))
        return 1
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
