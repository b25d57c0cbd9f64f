"""Cloud profiles: raw TensorStore vs jaxckpt plain vs packed, behind a shaping proxy.

A loopback store answers at once and serves any connection as fast as the CPU
allows; a far-away one does not. Here moto (S3) sits behind
:class:`benchkit.shaper.Shaper` (in a process of its own, so its threads do not
hold the measured process's GIL), which delays each direction of every TCP
connection, caps each connection's rate and caps all of them together, and
three contenders save and restore the same state side by side in one run:

* ``raw``: TensorStore kvstore writes and reads of the same bytes, one object
  per leaf, every object in flight at once (32 requests, TensorStore's default
  concurrency; :class:`benchkit.contenders.RawKvSaver`): the contender;
* ``plain``: ``jaxckpt.CheckpointManager(layout="plain")``;
* ``packed``: ``jaxckpt.CheckpointManager(layout="packed")``.

States (``--scale`` multiplies the leaf counts of big and small and the
layers of mixed):

* ``big``: 16 leaves of ``--big-mib`` MiB (4);
* ``small``: 1,000 leaves of 16 KiB;
* ``mixed``: a scaled-down transformer (width ``--width``, 64): token and
  output embeddings, per layer q/k/v/o, a gated MLP, two norms and four
  biases, plus a step counter and an RNG key: 1,954 leaves at the default.

Profiles (``--profiles``, each ``name:latency_ms:conn_mbps:total_mbps``, or
the names ``bare``, ``20ms``, ``50ms`` that take ``--latency-ms``,
``--conn-mbps`` and ``--total-mbps``): ``bare`` (the proxy without delay or
caps), ``20ms`` (10 ms each way, 25 MB/s per connection, 200 MB/s total),
``50ms`` (25 ms each way, the same caps). A request costs one round trip
plus its transfer, as on a kept-alive connection: moto closes each
connection after its response, so clients open one per request, which a
real store would not make them pay for (the proxy charges no handshake).

Each of ``--rounds`` rounds saves and restores with every contender once, the
order rotated by one each round (a slow spell of the shared machine falls on
all alike); times are medians over the rounds. Each save runs in this process
on an open manager (or kvstore) and is timed
until the step is committed (jaxckpt is given the state as jax arrays on the
CPU device, as a training loop holds it; raw writes the numpy bytes); each
restore opens a fresh manager (or kvstore), as a restarted job does, and is
timed from ``restore()`` (the newest step) until the arrays are
back (opening is not timed, for any contender), then compared bit-exactly
with what was saved. *objects* are the keys a save added under the root;
*requests* are the HTTP requests the proxy saw during the timed save or
restore call (and a save's background tidying up to the manager's close),
not the opening of the manager, whose listing grows with the root's history.
The JSON rows also hold every round's seconds (``save_rounds_s``,
``restore_rounds_s``), in round order, and each round's ratio to raw's time in that
round (``save_ratio_rounds``, ``restore_ratio_rounds``). Each round ends by deleting
the step it saved (untimed: the manager's ``delete``, raw's keys), so every round finds
the server holding the same objects. Ratios are raw time over the contender's
time, i.e. throughput vs raw, as the issue's targets read (1.0: as fast as
raw; 0.5: twice as long). *save extra memory* is the save's peak resident
memory above the state already in memory (the kernel's high-water mark,
reset before the save; the largest over the rounds). The GCS emulator is left out by default
(``--stores s3,gcs`` adds it): it serves one request at a time, so it
measures its own queue, not the layouts. Each state at each profile gets a
fresh server (both keep every object in memory and scan the whole bucket per
listing, so earlier rows would slow later rows' listings). The machine is
shared: compare ratios within one run.

Usage: ``python scripts/bench.py cloud [--profiles bare,20ms,50ms] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchkit import servers
from benchkit.common import write_json_rows
from benchkit.contenders import RawKvSaver
from benchkit.measure import PeakRss
from benchkit.shaper import Profile, ShaperProcess
from benchkit.stores import endpoints_env

KiB, MiB = 1 << 10, 1 << 20
CONTENDERS = ("raw", "plain", "packed")
STATES = ("big", "small", "mixed")


def build_state(name: str, *, scale: float, big_mib: float, width: int) -> dict[str, np.ndarray]:
    """The named state as float32 host arrays (mixed: plus an int64 step and a uint32 key)."""
    rng = np.random.default_rng(0)

    def arr(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    if name == "big":
        n = max(1, round(16 * scale))
        return {f"l{i:03d}": arr(int(big_mib * MiB) // 4) for i in range(n)}
    if name == "small":
        n = max(1, round(1000 * scale))
        return {f"l{i:04d}": arr(16 * KiB // 4) for i in range(n)}
    if name == "mixed":
        d, layers, vocab = width, max(1, round(150 * scale)), 128 * width
        state: dict[str, np.ndarray] = {"embed": arr(vocab, d), "unembed": arr(d, vocab)}
        for i in range(layers):
            p = f"layer{i:03d}"
            for m in ("q", "k", "v", "o"):
                state[f"{p}/attn/{m}"] = arr(d, d)
            state[f"{p}/mlp/gate"], state[f"{p}/mlp/up"] = arr(d, 4 * d), arr(d, 4 * d)
            state[f"{p}/mlp/down"] = arr(4 * d, d)
            for m in ("attn_norm", "mlp_norm", "attn/o_bias", "mlp/down_bias"):
                state[f"{p}/{m}"] = arr(d)
            state[f"{p}/mlp/up_bias"], state[f"{p}/mlp/gate_bias"] = arr(4 * d), arr(4 * d)
        state["final_norm"] = arr(d)
        state["step"] = np.array(12345, dtype=np.int64)
        state["rng"] = np.array([0, 42], dtype=np.uint32)
        return state
    raise ValueError(f"unknown state {name!r}; choose from {STATES}")


def parse_profiles(
    spec: str, latency_ms: float, conn_mbps: float, total_mbps: float
) -> list[Profile]:
    """``bare``, ``20ms``, ``50ms`` or ``name:latency_ms:conn_mbps:total_mbps``, comma-separated."""
    caps = {"conn_bytes_per_s": conn_mbps * 1e6, "total_bytes_per_s": total_mbps * 1e6}
    named = {
        "bare": Profile(name="bare"),
        "20ms": Profile(name="20ms", latency_s=latency_ms / 1e3, handshake=False, **caps),
        "50ms": Profile(name="50ms", latency_s=2.5 * latency_ms / 1e3, handshake=False, **caps),
    }
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item in named:
            out.append(named[item])
            continue
        name, *numbers = item.split(":")
        if len(numbers) != 3:
            raise SystemExit(f"profile {item!r}: expected NAME:LATENCY_MS:CONN_MBPS:TOTAL_MBPS")
        lat, conn, total = (float(x) for x in numbers)
        out.append(Profile(name=name, latency_s=lat / 1e3, conn_bytes_per_s=conn * 1e6,
                           total_bytes_per_s=total * 1e6, handshake=False))  # fmt: skip
    return out


def _timed(run: Callable[[], Any], started: Callable[[], None]) -> tuple[float, int, Any]:
    """Seconds, peak extra resident memory and result of ``run()``; ``started()`` just
    before it (the proxy's counts are reset there, so they cover the timed call only)."""
    with PeakRss(sample=False) as rss:
        started()
        t0 = time.perf_counter()
        out = run()
        seconds = time.perf_counter() - t0
    return seconds, rss.extra, out


Contender = tuple[Callable[..., tuple[float, int]], Callable[..., Any], Callable[[str, int], None]]


def _jaxckpt_contender(layout: str) -> Contender:
    import jaxckpt

    def save(
        root: str, step: int, state: dict[str, Any], started: Callable[[], None]
    ) -> tuple[float, int]:
        import jax

        # A training state lives on the device: jax arrays, as the core bench saves (on CPU
        # their host snapshot is a view; numpy inputs would be copied first, for safety).
        on_device = jax.block_until_ready(jax.device_put(state))
        with jaxckpt.CheckpointManager(root, layout=layout, gc_on_open=False) as mgr:

            def run() -> None:
                mgr.save(step, on_device)
                mgr.wait()

            seconds, extra, _ = _timed(run, started)
            return seconds, extra

    def restore(
        root: str, step: int, state: dict[str, Any], started: Callable[[], None]
    ) -> tuple[float, Any]:
        with jaxckpt.CheckpointManager(root, layout=layout, gc_on_open=False) as mgr:
            # the newest step, as a restarted job asks
            seconds, _, out = _timed(lambda: mgr.restore(target=state), started)
            assert mgr.restored_step == step, (mgr.restored_step, step)
            return seconds, out

    def drop(root: str, step: int) -> None:
        with jaxckpt.CheckpointManager(root, layout=layout, gc_on_open=False) as mgr:
            mgr.delete(step)

    return save, restore, drop


def _raw_contender() -> Contender:
    def save(
        root: str, step: int, state: dict[str, Any], started: Callable[[], None]
    ) -> tuple[float, int]:
        saver = RawKvSaver(root)
        seconds, extra, _ = _timed(lambda: saver.save(step, state), started)
        return seconds, extra

    def restore(
        root: str, step: int, state: dict[str, Any], started: Callable[[], None]
    ) -> tuple[float, Any]:
        saver = RawKvSaver(root)  # a fresh kvstore and context: nothing cached
        abstract = {k: np.asarray(v) for k, v in state.items()}  # only shape and dtype are read
        seconds, _, out = _timed(lambda: saver.restore(step, abstract), started)
        return seconds, out

    def drop(root: str, step: int) -> None:
        from jaxckpt.storage import open_storage

        storage = open_storage(root)
        for key in storage.list(f"{step}/"):
            storage.delete(key)

    return save, restore, drop


def _same(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


class _Contender:
    """One contender's root, its rounds' times and memory, and its last round's counts."""

    def __init__(self, name: str, base: str) -> None:
        self.name = name
        self.save, self.restore, self.drop = (
            _raw_contender() if name == "raw" else _jaxckpt_contender(name)
        )
        self.root = f"{base}/{name}-{uuid.uuid4().hex[:8]}"
        self.saves: list[float] = []
        self.restores: list[float] = []
        self.extras: list[int] = []
        self.counts: dict[str, int] = {}

    def round(self, step: int, shaper: ShaperProcess, state: dict[str, Any]) -> None:
        """One save of ``step`` and one restore of it, checked bit-exactly."""
        from jaxckpt.storage import open_storage

        before = set(open_storage(self.root).list(""))

        def reset() -> None:
            shaper.counts(reset=True)

        seconds, extra = self.save(self.root, step, state, reset)
        self.saves.append(seconds)
        self.extras.append(extra)
        save_counts = shaper.counts()  # the restore resets them when its call starts
        objects = len(set(open_storage(self.root).list("")) - before)
        seconds, out = self.restore(self.root, step, state, reset)
        out = {k: np.asarray(out[k]) for k in state}
        self.restores.append(seconds)
        restore_counts = shaper.counts()
        wrong = [k for k in state if not _same(out[k], state[k])]
        if wrong:
            raise AssertionError(f"{self.name} restored {len(wrong)} leaves wrong, e.g. {wrong[0]}")
        # Untimed: the step goes again, so every round finds the server holding the same.
        self.drop(self.root, step)
        self.counts = {
            "objects": objects,
            "save_requests": save_counts["requests"],
            "restore_requests": restore_counts["requests"],
            "save_connections": save_counts["connections"],
            "restore_connections": restore_counts["connections"],
        }

    def row(self) -> dict[str, Any]:
        return {
            "save_s": statistics.median(self.saves),
            "restore_s": statistics.median(self.restores),
            "save_rounds_s": list(self.saves),
            "restore_rounds_s": list(self.restores),
            "save_extra_bytes": max(self.extras),
            **self.counts,
        }


def run_interleaved(
    names: list[str], base: str, shaper: ShaperProcess, state: dict[str, Any], rounds: int
) -> list[dict[str, Any]]:
    """``rounds`` save + restore rounds of every contender, interleaved: each round runs
    every contender once, in an order rotated by one each round, so that a slow spell of
    the shared machine falls on all of them alike.
    Returns one row per contender, in ``names`` order: medians, last round's counts."""
    contenders = [_Contender(name, base) for name in names]
    for step in range(1, rounds + 1):
        shift = (step - 1) % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            contender.round(step, shaper, state)
    return [c.row() for c in contenders]


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| store | profile | state | layout | save (s) | save vs raw | restore (s) "
        "| restore vs raw | save extra memory | objects | save requests | restore requests |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        extra = r["save_extra_bytes"]
        lines.append(
            f"| {r['store']} | {r['profile']} | {r['state']} | {r['layout']} "
            f"| {r['save_s']:.3f} | {r['save_ratio']:.2f}× | {r['restore_s']:.3f} "
            f"| {r['restore_ratio']:.2f}× | {extra / MiB:,.0f} MiB "
            f"({extra / r['state_bytes']:.2f}×) | {r['objects']:,} | {r['save_requests']:,} "
            f"| {r['restore_requests']:,} |"
        )
    return "\n".join(lines)


def _start(store: str, log_dir: Path) -> servers.Server:
    return servers.start_moto(log_dir) if store == "s3" else servers.start_gcs_emulator(log_dir)


def _point_at(store: str, endpoint: str) -> None:
    """Sends this process's S3 or GCS requests to ``endpoint`` (the shaper)."""
    env = endpoints_env(endpoint, endpoint)
    keys = ("AWS_ENDPOINT_URL_S3",) if store == "s3" else ("STORAGE_EMULATOR_HOST",
                                                            "TENSORSTORE_GCS_HTTP_URL")  # fmt: skip
    os.environ.update({k: env[k] for k in (*keys, "NO_PROXY", "no_proxy")})
    if store == "s3":
        os.environ["AWS_ENDPOINT_URL"] = endpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py cloud", description=__doc__.split("\n", 1)[0])
    p.add_argument("--profiles", default="bare,20ms,50ms")
    p.add_argument("--latency-ms", type=float, default=10.0,
                   help="one-way latency of 20ms (50ms: 2.5 times it)")  # fmt: skip
    p.add_argument("--conn-mbps", type=float, default=25.0, help="MB/s per connection")
    p.add_argument("--total-mbps", type=float, default=200.0, help="MB/s all connections")
    p.add_argument("--states", default=",".join(STATES))
    p.add_argument("--layouts", default=",".join(CONTENDERS))
    p.add_argument("--stores", default="s3", help="s3 and/or gcs (gcs: one request at a time)")
    p.add_argument("--scale", type=float, default=1.0, help="leaf counts (big, small), layers")
    p.add_argument("--big-mib", type=float, default=4.0)
    p.add_argument("--width", type=int, default=64, help="mixed: the model width")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    profiles = parse_profiles(args.profiles, args.latency_ms, args.conn_mbps, args.total_mbps)
    layouts = [c for c in CONTENDERS if c in args.layouts.split(",")]  # raw first
    if "raw" not in layouts or set(args.layouts.split(",")) - set(CONTENDERS):
        p.error(f"--layouts: a subset of {CONTENDERS} that includes raw")
    stores = args.stores.split(",")
    if set(stores) - {"s3", "gcs"}:
        p.error("--stores: s3 and/or gcs")
    states = {
        name: build_state(name, scale=args.scale, big_mib=args.big_mib, width=args.width)
        for name in args.states.split(",")
    }
    scratch = Path(tempfile.mkdtemp(prefix="bench-cloud-"))
    servers.isolate_cloud_env(os.environ, str(scratch))
    rows: list[dict[str, Any]] = []
    try:
        for store in stores:
            for profile in profiles:
                for name, state in states.items():
                    # A fresh server per row set: moto and the emulator hold every object in
                    # memory and scan the whole bucket on each listing, so an earlier row's
                    # objects would slow later rows' listings (packed lists, raw does not).
                    server = _start(store, scratch)
                    try:
                        scheme = "s3" if store == "s3" else "gs"
                        base = f"{scheme}://{server.bucket}/{uuid.uuid4().hex[:6]}"
                        with ShaperProcess(server.endpoint, profile) as shaper:
                            _point_at(store, shaper.endpoint)
                            found = run_interleaved(layouts, f"{base}/{profile.name}/{name}",
                                                    shaper, state, args.rounds)  # fmt: skip
                    finally:
                        server.stop()
                    raw = found[0]
                    for layout, row in zip(layouts, found, strict=True):
                        rows.append({
                            "store": store, "profile": profile.name, "state": name,
                            "layout": layout, "leaves": len(state),
                            "state_bytes": sum(v.nbytes for v in state.values()),
                            **row,
                            "save_ratio": raw["save_s"] / row["save_s"],
                            "restore_ratio": raw["restore_s"] / row["restore_s"],
                            **{f"{op}_ratio_rounds": [
                                r / c for r, c in zip(raw[f"{op}_rounds_s"],
                                                      row[f"{op}_rounds_s"], strict=True)
                            ] for op in ("save", "restore")},
                        })  # fmt: skip
                        print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(markdown(rows))
    write_json_rows(args.json, rows)
    return 0
