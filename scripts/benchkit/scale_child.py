"""One JAX process of ``bench.py scale``: save a sharded state, then restore it, in phases.

Usage (started by :mod:`benchkit.scale`, one per process, each with its own
counting proxy as ``AWS_ENDPOINT_URL_S3``)::

    python scale_child.py --coordinator 127.0.0.1:PORT --num-processes N --process-id I
        --root s3://BUCKET/PREFIX [--leaves 8] [--leaf-kib 64]

The process joins a ``jax.distributed`` group (gloo, one CPU device), wraps the
coordination-service client in a counting delegate (after ``jax.devices()``:
the CPU backend takes the real client when it is created; jaxckpt and Orbax
read ``global_state.client`` at call time), and builds the same bytes on every
process: ``--leaves`` float32 leaves sharded over all N devices (``--leaf-kib``
per process each), plus a small replicated leaf and a value. Then, with a
barrier of its own before each phase (through the real client, not counted):

* ``open``: ``CheckpointManager(root)`` (a writable open);
* ``save``: ``save(1, state)`` and ``wait()`` until committed;
* ``close``: ``close()``;
* ``reopen``: a fresh ``CheckpointManager(root)``, as after a restart;
* ``restore``: ``restore(target=...)`` onto the same shardings, checked value by value;
* ``close2``: ``close()``.

It prints one line ``SCALE <json>``: the ``time.monotonic()`` stamp at the
start of each phase and at the end (so the proxy's requests can be put into
phases by time; the clock is the machine's), and the coordination calls of
each phase by method.
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


def leaf_value(j: int, shape: tuple[int, ...]) -> np.ndarray:
    """Leaf ``j``'s whole global value (exact in float32)."""
    return (np.arange(int(np.prod(shape)), dtype=np.float32) + 1000.0 * j).reshape(shape)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--leaves", type=int, default=8)
    p.add_argument("--leaf-kib", type=int, default=64)
    p.add_argument("--init-timeout", type=int, default=300)
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
    values = {name: leaf_value(j, shape) for j, (name, shape) in enumerate(shapes.items())}
    values["rep"] = leaf_value(10_000, (16, 16))
    state: dict[str, Any] = {
        name: jax.make_array_from_callback(
            v.shape, replicated if name == "rep" else sharded, lambda idx, v=v: v[idx]
        )
        for name, v in values.items()
    }
    state["step"] = 1
    target: dict[str, Any] = {
        name: jax.ShapeDtypeStruct(v.shape, np.float32, sharding=state[name].sharding)
        for name, v in values.items()
    }
    target["step"] = 0

    stamps: dict[str, float] = {}
    calls: dict[str, dict[str, int]] = {}
    seen: Counter[str] = Counter()

    def phase(name: str) -> None:
        real.wait_at_barrier(f"scale/{name}", BARRIER_MS)
        if stamps:
            last = list(stamps)[-1]
            calls[last] = dict(counting.calls - seen)
            seen.update(counting.calls - seen)
        stamps[name] = time.monotonic()

    phase("open")
    manager = jaxckpt.CheckpointManager(args.root)
    phase("save")
    manager.save(1, state)
    manager.wait()
    phase("close")
    manager.close()
    phase("reopen")
    manager = jaxckpt.CheckpointManager(args.root)
    phase("restore")
    restored = manager.restore(target=target)
    phase("close2")
    manager.close()
    phase("end")
    _check(restored, values)
    report = {"process": args.process_id, "stamps": stamps, "calls": calls}
    print("SCALE " + json.dumps(report, sort_keys=True), flush=True)
    return 0


def _check(restored: dict[str, Any], values: dict[str, np.ndarray]) -> None:
    if restored["step"] != 1:
        raise AssertionError(f"restored step value {restored['step']!r}, expected 1")
    for name, value in values.items():
        for shard in restored[name].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index], name)


if __name__ == "__main__":
    sys.exit(main())
