"""One JAX process of ``bench.py scale``: save a sharded state, then restore it, in phases.

Usage (started by :mod:`benchkit.scale`, one per process, each with its own
counting proxy as ``AWS_ENDPOINT_URL_S3``)::

    python scale_child.py --coordinator 127.0.0.1:PORT --num-processes N --process-id I
        --root s3://BUCKET/PREFIX [--leaves 8] [--leaf-kib 64]
        [--mode scale|storm|denied] [--gate] [--save-timeout S] [--max-delay S]

The process joins a ``jax.distributed`` group (gloo, one CPU device), wraps the
coordination-service client in a counting delegate (after ``jax.devices()``:
the CPU backend takes the real client when it is created; jaxckpt and Orbax
read ``global_state.client`` at call time), and builds the same bytes on every
process: ``--leaves`` float32 leaves sharded over all N devices (``--leaf-kib``
per process each), plus a small replicated leaf and a value. Then, with a
barrier of its own before each phase (through the real client, not counted):

* ``open``: ``CheckpointManager(root)`` (a writable open; it writes the ledger's first
  object, so each process's first requests, its credential lookup among them, are
  counted here and not in the save);
* ``save``: ``save(1, state)`` and ``wait()`` until committed;
* ``close``: ``close()``;
* ``reopen``: a fresh ``CheckpointManager(root)``, as after a restart;
* ``restore``: ``restore(target=...)`` onto the same shardings, checked value by value;
* ``close2``: ``close()``.

It prints one line ``SCALE <json>``: the ``time.monotonic()`` stamp at the
start of each phase and at the end (so the proxy's requests can be put into
phases by time; the clock is the machine's), the coordination calls of
each phase by method, and the outcome of each save and restore (seconds,
the step committed or restored, whether every restored byte is equal, or the
error's class and message).

The other modes (``benchkit/storm.py``, ``benchkit/denied.py``) change the
phases and report a failing save or restore instead of raising it:

* ``storm``: ``prime`` (save step 1) before ``save``, which saves step 2 (other
  values), so the restore of the newest step must return step 2's bytes;
* ``denied``: after ``restore``, ``save2`` saves step 2 (one process's proxy
  denies its reads during ``restore`` and its writes during ``save2``).

With ``--gate`` the process prints ``GATE <phase>`` after each phase's barrier
and waits for a line on stdin, so its parent can change the proxies (start a
storm, deny a host) at the same point of every process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from typing import Any

import numpy as np

PHASES = ("open", "save", "close", "reopen", "restore", "close2")
MODE_PHASES = {
    "scale": PHASES,
    "storm": ("open", "prime", "save", "close", "reopen", "restore", "close2"),
    "denied": ("open", "save", "close", "reopen", "restore", "save2", "close2"),
}
BARRIER_MS = 600_000


class CountingClient:
    """Delegates to the coordination-service client, counting every call by method name."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def leaf_value(j: int, shape: tuple[int, ...], step: int = 1) -> np.ndarray:
    """Leaf ``j``'s whole global value at ``step`` (exact in float32; negated at even steps)."""
    value = (np.arange(int(np.prod(shape)), dtype=np.float32) + 1000.0 * j).reshape(shape)
    return value if step % 2 else -value - 1.0


class Outcomes:
    """The outcome of each save and restore; with ``tolerant``, a CheckpointError is
    recorded instead of raised."""

    def __init__(self, tolerant: bool) -> None:
        self.tolerant = tolerant
        self.by_phase: dict[str, dict[str, Any]] = {}

    def run(self, phase: str, call: Any) -> Any:
        import jaxckpt

        start = time.monotonic()
        entry: dict[str, Any] = {"ok": True}
        self.by_phase[phase] = entry
        try:
            result = call()
        except jaxckpt.CheckpointError as e:
            if not self.tolerant:
                raise
            entry.update(ok=False, error=type(e).__name__, message=" ".join(str(e).split()))
            result = None
        entry["seconds"] = time.monotonic() - start
        return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--leaves", type=int, default=8)
    p.add_argument("--leaf-kib", type=int, default=64)
    p.add_argument("--init-timeout", type=int, default=300)
    p.add_argument("--mode", choices=tuple(MODE_PHASES), default="scale")
    p.add_argument("--gate", action="store_true", help="wait for stdin at each phase")
    p.add_argument("--save-timeout", type=float, default=None, help="save_timeout_s")
    p.add_argument("--max-delay", type=float, default=None, help="retries' max_delay_s")
    args = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
    ).strip()

    import jax
    from jax._src import distributed

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        coordinator_bind_address=args.coordinator,  # loopback only
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=args.init_timeout,
    )
    devices = jax.devices()  # the CPU backend takes the real client here
    real = distributed.global_state.client
    counting = CountingClient(real)
    distributed.global_state.client = counting

    import jaxckpt

    n = args.num_processes
    mesh = jax.sharding.Mesh(np.array(devices), ("p",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("p"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rows = args.leaf_kib * 1024 // (4 * 64)
    shapes = {f"w{j:03d}": (n * rows, 64) for j in range(args.leaves)}
    shardings = {name: sharded for name in shapes} | {"rep": replicated}

    def values_at(step: int) -> dict[str, np.ndarray]:
        values = {
            name: leaf_value(j, shape, step) for j, (name, shape) in enumerate(shapes.items())
        }
        values["rep"] = leaf_value(10_000, (16, 16), step)
        return values

    def state_at(step: int) -> dict[str, Any]:
        state: dict[str, Any] = {
            name: jax.make_array_from_callback(v.shape, shardings[name], lambda idx, v=v: v[idx])
            for name, v in values_at(step).items()
        }
        state["step"] = step
        return state

    target: dict[str, Any] = {
        name: jax.ShapeDtypeStruct(v.shape, np.float32, sharding=shardings[name])
        for name, v in values_at(1).items()
    }
    target["step"] = 0
    phases = MODE_PHASES[args.mode]
    saved = 2 if "prime" in phases else 1
    state = state_at(saved)

    stamps: dict[str, float] = {}
    calls: dict[str, dict[str, int]] = {}
    seen: Counter[str] = Counter()
    outcomes = Outcomes(tolerant=args.mode != "scale")

    def phase(name: str) -> None:
        assert name in (*phases, "end"), name
        real.wait_at_barrier(f"scale/{name}", BARRIER_MS)
        if args.gate:
            print(f"GATE {name}", flush=True)
            if not sys.stdin.readline():
                raise SystemExit(f"process {args.process_id}: stdin closed at gate {name}")
        if stamps:
            last = list(stamps)[-1]
            calls[last] = dict(counting.calls - seen)
            seen.update(counting.calls - seen)
        stamps[name] = time.monotonic()

    # The ledger writes at each open and close, and every ledger_flush_s in between: the
    # longest interval keeps a periodic flush out of the counted phases of a slow run.
    options: dict[str, Any] = {"ledger_flush_s": 600.0}
    if args.mode == "scale":  # a store that answers: close() waits for the run's last writes
        # (its 5 s default once ran out under CI's load: requests fell after the phases)
        options["close_wait_s"] = 120.0
    if args.save_timeout is not None:
        options["save_timeout_s"] = args.save_timeout
    if args.max_delay is not None:
        options["storage_options"] = {"max_delay_s": args.max_delay}

    def save(manager: Any, step: int, state: dict[str, Any]) -> int:
        manager.save(step, state)
        manager.wait()
        return step

    phase("open")
    manager = jaxckpt.CheckpointManager(args.root, **options)
    if "prime" in phases:
        phase("prime")
        outcomes.run("prime", lambda: save(manager, 1, state_at(1)))
    phase("save")
    outcomes.run("save", lambda: save(manager, saved, state))
    phase("close")
    outcomes.run("close", manager.close)
    phase("reopen")
    manager = outcomes.run("reopen", lambda: jaxckpt.CheckpointManager(args.root, **options))
    if manager is None:
        raise SystemExit(f"process {args.process_id}: {outcomes.by_phase['reopen']}")
    phase("restore")
    restored = outcomes.run("restore", lambda: manager.restore(target=target))
    if "save2" in phases:
        phase("save2")
        outcomes.run("save2", lambda: save(manager, saved + 1, state_at(saved + 1)))
    phase("close2")
    outcomes.run("close2", manager.close)
    phase("end")
    entry = outcomes.by_phase["restore"]
    if restored is not None:
        entry["step"] = restored["step"]
        entry["equal"] = _equal(restored, values_at(saved))
        if not outcomes.tolerant:
            _check(restored, values_at(saved))
    report = {
        "process": args.process_id,
        "stamps": stamps,
        "calls": calls,
        "outcomes": outcomes.by_phase,
    }
    print("SCALE " + json.dumps(report, sort_keys=True), flush=True)
    return 0


def _equal(restored: dict[str, Any], values: dict[str, np.ndarray]) -> bool:
    """Whether every restored shard equals the saved bytes."""
    return all(
        np.array_equal(np.asarray(shard.data), value[shard.index])
        for name, value in values.items()
        for shard in restored[name].addressable_shards
    )


def _check(restored: dict[str, Any], values: dict[str, np.ndarray]) -> None:
    if restored["step"] != 1:
        raise AssertionError(f"restored step value {restored['step']!r}, expected 1")
    for name, value in values.items():
        for shard in restored[name].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index], name)


if __name__ == "__main__":
    sys.exit(main())
