"""One JAX process of the per-process state test (``tests/test_process_state.py``).

Usage::

    python tests/procstate_child.py --coordinator 127.0.0.1:PORT --num-processes P
        --process-id I --root ROOT --mode {save,restore} [--local-root PREFIX]

Each process has one CPU device; the state is one array sharded over all of them.
``save`` saves steps 1 and 2, each process with its own ``process_state`` (bytes that
are not UTF-8, distinct per process and step, see :func:`state_of`), and waits for each
commit (with ``--local-root``, a local tier ``PREFIX<i>`` per process and every step
promoted: it waits until the last one is durable). ``restore`` restores the newest step
onto the mesh in a fresh group and prints ``RESTORED s``, ``OWN <hex>`` (this process's
``restored_process_state``) and ``ALL <hex>,<hex>`` (``process_states(s)``).
``--replicas``: each local part is also held by the other process's node
(``local_replicas=2``, nodes from ``JAXCKPT_NODE_ID``) and no step is promoted.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from jaxgroup import join_group


def state_of(process: int, step: int) -> bytes:
    """The ``process_state`` process ``process`` saves with ``step``."""
    return b"\xff\x00grain-state/" + f"p{process}/s{step}".encode()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--mode", choices=("save", "restore"), required=True)
    parser.add_argument("--local-root")
    parser.add_argument("--replicas", action="store_true")
    args = parser.parse_args()
    join_group(args.coordinator, args.num_processes, args.process_id)

    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt

    me = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    shape = (2 * args.num_processes, 3)
    local = None if args.local_root is None else f"{args.local_root}{me}"
    tiered: dict[str, object] = {}
    if args.replicas:  # each part also on the other node; nothing promoted
        tiered = {"local_replicas": 2, "promote_policy": jaxckpt.policy.EveryNSteps(1000)}
    mgr = jaxckpt.CheckpointManager(args.root, local_root=local, save_timeout_s=60, **tiered)
    with mgr:
        if args.mode == "save":
            for step in (1, 2):
                w = jax.make_array_from_callback(
                    shape, sharding, lambda idx, s=step: np.full(shape, s, np.float32)[idx]
                )
                mgr.save(step, {"w": w, "step": step}, process_state=state_of(me, step))
                mgr.wait()
            if local is not None and not args.replicas:
                mgr.wait_durable(2, timeout_s=60)
            print("SAVED", flush=True)
            return 0
        target = {"w": jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding), "step": 0}
        restored = mgr.restore(target=target)
        step = mgr.restored_step
        assert restored["step"] == step
        print(f"RESTORED {step}", flush=True)
        print(f"OWN {mgr.restored_process_state.hex()}", flush=True)
        print(f"ALL {','.join(s.hex() for s in mgr.process_states(step))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
