"""``jaxckpt inspect``: a step's tree with shapes, dtypes, shardings and bytes."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from jaxckpt.cli._common import command, dotted, integer, itemsize, open_root, source_and_step
from jaxckpt.cli._output import human_bytes, json_out, local_time, print_table
from jaxckpt.commit import CommitProtocol
from jaxckpt.formats import step_format
from jaxckpt.records import TREE_FILE, CommitMarker, parse_tree, versions_text
from jaxckpt.records import process_state_summaries as summaries

_SHOWN_STATES = 4
"""Processes whose ``process_state`` the text output lists (``--json``: all)."""


def register(sub: Any) -> None:
    p = command(sub, "inspect", cmd_inspect, "show a step's tree: shapes, dtypes, shardings, bytes")
    p.add_argument("root", metavar="ROOT[:STEP]")
    p.add_argument("step", nargs="?", type=integer(0), help="default: the newest committed step")
    p.add_argument("--json", action="store_true", help="print JSON")


def _stored_bytes(
    protocol: CommitProtocol, marker: CommitMarker
) -> tuple[dict[str, int], str, int, dict[int, Any]]:
    """Stored bytes per array, the step's layout, its number of data objects and its
    ``process_state`` records by process."""
    sizes: dict[str, int] = {}
    parts = protocol.read_manifest(marker)
    for part in parts:
        for name, chunks in part.arrays.items():
            sizes[name] = sizes.get(name, 0) + sum(c.size for c in chunks)
    layout = step_format(part.layout for part in parts).name
    states = {p.process: p.process_state for p in parts if p.process_state is not None}
    return sizes, layout, sum(part.objects for part in parts), states


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


def cmd_inspect(args: argparse.Namespace) -> int:
    root, step = source_and_step(args.parser, args.root, args.step)
    protocol = open_root(root)
    marker = protocol.marker_or_latest(step)
    tree = parse_tree(
        protocol.read_step_file(marker, TREE_FILE),
        protocol.where(marker.location.tree_key),
        step=marker.step,
    )
    stored, layout, objects, records = _stored_bytes(protocol, marker)
    states = summaries(records, marker.step)
    leaves: list[dict[str, Any]] = []
    for leaf in tree.leaves:
        is_value = leaf.kind == "value"
        shape = None if is_value else list(leaf.shape)
        leaves.append(
            {
                "path": dotted(leaf.path, leaf.name),
                "keystr": leaf.path_text,
                "kind": leaf.kind,
                "shape": shape,
                "dtype": leaf.dtype,
                "sharding": leaf.sharding,
                "chunk_shape": None if is_value else list(leaf.chunk_shape),
                "key_impl": leaf.key_impl,
                "nbytes": 0 if is_value else math.prod(shape or []) * itemsize(leaf.dtype or ""),
                "stored_bytes": stored.get(leaf.name or "", 0),
                "value": leaf.value,
            }
        )
    if args.json:
        json_out(
            {
                "root": protocol.storage.uri,
                "step": marker.step,
                "commit_time": marker.time,
                "nbytes": marker.nbytes,
                "keep": marker.keep,
                "metrics": dict(marker.metrics),
                "metadata": tree.metadata,
                "versions": dict(tree.versions) or None,
                "attempt": marker.attempt,
                "epoch": marker.epoch,
                "layout": layout,
                "data_objects": objects,
                "process_states": [summary.as_json() for summary in states],
                "leaves": leaves,
            }
        )
        return 0
    arrays = [x for x in leaves if x["kind"] != "value"]
    print(
        f"step {marker.step} of {protocol.storage.uri}: committed {local_time(marker.time)}, "
        f"{len(arrays)} arrays ({human_bytes(sum(x['nbytes'] for x in arrays))}, "
        f"{human_bytes(marker.nbytes)} stored), {len(leaves) - len(arrays)} values"
        + (", pinned" if marker.keep else "")
    )
    print(f"written by: {versions_text(dict(tree.versions) or None)}")
    print(f"layout: {layout} ({objects:,} data objects)")
    if marker.attempt is not None:
        print(f"attempt: {marker.attempt} (writer epoch {marker.epoch})")
    if marker.metrics:
        print("metrics: " + ", ".join(f"{k}={v:g}" for k, v in marker.metrics.items()))
    if tree.metadata is not None:
        print(f"metadata: {json.dumps(tree.metadata)}")
    for summary in states[:_SHOWN_STATES]:
        print(f"process_state of process {summary.process}: {summary.describe()}")
    if len(states) > _SHOWN_STATES:
        print(f"... and {len(states) - _SHOWN_STATES} more processes' (--json lists every one)")
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
    print_table(rows, right=(5,))
    return 0
