"""Runs N real JAX processes of ``benchkit/scale_child.py`` to the end, optionally in step.

``bench.py scale``, ``storm`` and ``denied`` start one group per measurement:
process ``i`` talks to the store through ``endpoints[i]`` (a proxy of its
parent's), joins a ``jax.distributed`` group on a free loopback port, logs to
``scratch/child-<tag>-<i>.log`` and prints one ``SCALE <json>`` line (its
report). With ``on_gate``, the children run with ``--gate``: once every
process has printed ``GATE <phase>``, ``on_gate(phase)`` runs (start a storm,
deny a host) and every process is released. Every wait has a deadline; a child
still running at the end is killed.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from benchkit import servers
from benchkit.common import REPO

CHILD = Path(__file__).resolve().parent / "scale_child.py"
TIMEOUT_S = 900.0


def run_group(
    n: int,
    root: str,
    endpoints: list[str],
    scratch: Path,
    *child_args: str,
    on_gate: Callable[[str], None] | None = None,
    tag: str = "",
    timeout_s: float = TIMEOUT_S,
    strict: bool = True,
) -> list[dict[str, Any]]:
    """Runs the N children to the end; their ``SCALE`` reports, by process.

    Args:
      strict: raise if a child fails; False: its report is ``{"process": i,
        "failed": <exit status>, "log_tail": ...}`` instead.

    Raises:
      RuntimeError: a child failed or printed no report (``strict``), or the
        group ran past ``timeout_s`` (the message carries the failing child's log).
    """
    port = servers.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCKPT_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    logs = [scratch / f"child-{tag or n}-{i}.log" for i in range(n)]
    gate = ["--gate"] if on_gate is not None else []
    procs = []
    for i in range(n):
        with open(logs[i], "wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(CHILD),
                        f"--coordinator=127.0.0.1:{port}",
                        f"--num-processes={n}",
                        f"--process-id={i}",
                        f"--root={root}",
                        *gate,
                        *child_args,
                    ],
                    stdin=subprocess.PIPE if gate else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env={**env, "AWS_ENDPOINT_URL_S3": endpoints[i]},
                    text=True,
                )
            )
    try:
        outs = _drive(procs, on_gate, time.monotonic() + timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    reports = []
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        lines = [x for x in out if x.startswith("SCALE ")]
        if p.returncode != 0 or len(lines) != 1:
            tail = logs[i].read_text(errors="replace")[-3000:]
            if not strict:
                reports.append({"process": i, "failed": p.returncode, "log_tail": tail})
                continue
            text = "\n".join(out)
            raise RuntimeError(f"N={n}: process {i} failed (rc={p.returncode}):\n{text}\n{tail}")
        reports.append(json.loads(lines[0][len("SCALE ") :]))
    return reports


def _drive(
    procs: list[subprocess.Popen[str]],
    on_gate: Callable[[str], None] | None,
    deadline: float,
) -> list[list[str]]:
    """Every child's stdout lines, read to its end; gates released together."""
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()

    def read(i: int, stream: TextIO) -> None:
        for line in stream:
            lines.put((i, line.rstrip("\n")))
        lines.put((i, None))

    readers = [
        threading.Thread(target=read, args=(i, p.stdout), daemon=True)
        for i, p in enumerate(procs)
        if p.stdout is not None
    ]
    for t in readers:
        t.start()
    outs: list[list[str]] = [[] for _ in procs]
    at_gate: dict[str, set[int]] = {}
    open_streams = len(readers)
    while open_streams:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"the group ran past its deadline; output so far: {outs}")
        try:
            i, line = lines.get(timeout=min(left, 5.0))
        except queue.Empty:
            continue
        if line is None:
            open_streams -= 1
            continue
        outs[i].append(line)
        if on_gate is None or not line.startswith("GATE "):
            continue
        name = line.split(" ", 1)[1]
        at_gate.setdefault(name, set()).add(i)
        if len(at_gate[name]) == len(procs):
            on_gate(name)
            for p in procs:
                if p.stdin is not None and p.poll() is None:
                    p.stdin.write("\n")
                    p.stdin.flush()
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
    return outs
