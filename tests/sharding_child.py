"""Restores into modern sharding targets on 4 host devices; prints one JSON report.

Run by ``test_sharding_targets.py`` in a process of its own, with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (the device count is fixed
when jax starts): ``python sharding_child.py ROOT``.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", "model"))
        self.linear = nnx.Linear(4, 8, kernel_init=init, rngs=rngs)
        self.rngs = rngs


def _error(fn) -> str:
    try:
        fn()
    except jaxckpt.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def main(root: str) -> None:
    report: dict[str, object] = {}
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0))
        state = nnx.state(model)
    kernel = np.asarray(state["linear"]["kernel"].get_value())
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, state)
        # 1. Abstract targets from nnx.eval_shape / jax.eval_shape under jax.set_mesh.
        with jax.set_mesh(mesh):
            abstract = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(1))))
            restored = mgr.restore(1, target=abstract)
            w = restored["linear"]["kernel"].get_value()
            report["nnx_abstract"] = {
                "equal": bool(np.array_equal(np.asarray(w), kernel)),
                "spec": str(w.sharding.spec),
                "mesh": dict(w.sharding.mesh.shape),
                "concrete": not isinstance(w.sharding.mesh, jax.sharding.AbstractMesh),
            }
            plain = jax.eval_shape(lambda: jax.sharding.reshard(jnp.zeros((4, 8)), P("data")))
            mgr.save(2, {"w": np.arange(32.0, dtype=np.float32).reshape(4, 8)})
            got = mgr.restore(2, target={"w": plain})["w"]
            report["jax_abstract"] = {
                "spec": str(got.sharding.spec),
                "shards": len(got.addressable_shards),
                "equal": bool(np.array_equal(np.asarray(got), np.arange(32.0).reshape(4, 8))),
            }
        # No mesh set, or another mesh: one clear error naming the path.
        report["no_mesh"] = _error(lambda: mgr.restore(2, target={"w": plain}))
        with jax.set_mesh(jax.make_mesh((4, 1), ("data", "model"))):
            report["other_mesh"] = _error(lambda: mgr.restore(2, target={"w": plain}))
        # A sharding that cannot hold the saved array names the path and the sharding.
        odd = NamedSharding(jax.make_mesh((4,), ("x",)), P("x"))
        target = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=odd)}
        mgr.save(3, {"w": np.ones((3, 8), np.float32)})
        report["misfit"] = _error(
            lambda: mgr.restore(
                3, target={"w": jax.ShapeDtypeStruct((3, 8), jnp.float32, sharding=odd)}
            )
        )
        report["fits"] = str(mgr.restore(2, target=target)["w"].sharding.spec)
    # 2. A typed key on a 1x1 mesh: its sharding is P(None,) on a rank-0 key.
    one = jax.make_mesh((1, 1), ("data", "model"))
    with jax.set_mesh(one):
        rngs = nnx.Rngs(7)
    key = nnx.state(rngs)["default"]["key"].get_value()
    with jaxckpt.CheckpointManager(root + "-keys") as mgr:
        mgr.save(1, {"key": key})
        with jax.set_mesh(one):
            target = {"key": nnx.state(nnx.Rngs(0))["default"]["key"].get_value()}
        back = mgr.restore(1, target=target)["key"]
        report["key"] = {
            "target_spec": str(target["key"].sharding.spec),
            "equal": bool(np.array_equal(jax.random.key_data(back), jax.random.key_data(key))),
            "spec": str(back.sharding.spec),
        }
        # 3. Uncommitted targets restore uncommitted, so later code may move them.
        mgr.save(2, {"w": np.ones(4, np.float32)})
        for name, t in (
            ("array", jnp.zeros(4)),
            ("struct", jax.ShapeDtypeStruct((4,), jnp.float32)),
        ):
            got = mgr.restore(2, target={"w": t})["w"]
            moved = jax.device_put(got, jax.devices()[3]) + jax.device_put(
                jnp.ones(4), jax.devices()[3]
            )
            report[f"uncommitted_{name}"] = {
                "committed": got.committed,
                "sum": float(moved.sum()),
            }
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
