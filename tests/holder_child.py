"""One JAX process (1 CPU device, gloo) of the stopped-holder test in ``test_peer_holder.py``.

Usage (the arguments ``test_multihost.spawn`` passes; others are ignored)::

    python tests/holder_child.py --coordinator 127.0.0.1:PORT --num-processes P
        --process-id I --root ROOT --save-timeout S --local-root PREFIX
        --peer-timeout S [--steps 1,2,3,4]

A trainer with a peer-replicated local tier (``local_replicas=2``, external
promotion): for each step it saves ``x`` (``8P x 4`` float32, sharded over the
processes) and the value ``step``, waits for the commit, prints
``COMMITTED <step>`` or ``FAILED <step> <error class> <seconds>`` (the error
on stderr), then takes a "training step": a collective over every process.
Then ``DONE``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from jaxgroup import join_group


def _say(text: str) -> None:
    print(text, flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--save-timeout", type=float, required=True)
    p.add_argument("--local-root", required=True)
    p.add_argument("--peer-timeout", type=float, required=True)
    p.add_argument("--steps", default="1,2,3,4")
    args, _ = p.parse_known_args()
    join_group(args.coordinator, args.num_processes, args.process_id)

    import jax
    from jax.experimental import multihost_utils

    import jaxckpt

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    manager = jaxckpt.CheckpointManager(
        args.root,
        save_timeout_s=args.save_timeout,
        local_root=f"{args.local_root}{args.process_id}",
        local_replicas=2,
        peer_timeout_s=args.peer_timeout,
        promotion="external",
    )
    _say("READY")
    for step in map(int, args.steps.split(",")):
        full = np.arange(8 * args.num_processes * 4, dtype=np.float32).reshape(-1, 4) * step
        x = jax.make_array_from_callback(full.shape, sharding, lambda idx, f=full: f[idx])
        start = time.monotonic()
        try:
            manager.save(step, {"x": x, "step": step})
            manager.wait()
            _say(f"COMMITTED {step}")
        except jaxckpt.CheckpointError as e:
            _say(f"FAILED {step} {type(e).__name__} {time.monotonic() - start:.1f}")
            print(f"error: step {step}: {e}", file=sys.stderr, flush=True)
        multihost_utils.sync_global_devices(f"training step {step}")
    manager.close()
    _say("DONE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
