"""One process of the game day's training job (``bench.py gameday``), started by its supervisor.

    python scripts/benchkit/gameday_child.py --contender=jaxckpt --num-processes=2 \\
        --process-id=0 --coordinator=127.0.0.1:PORT --durable=s3://b/run --local=/x/node \\
        --steps=60 --every=5 --promote-every=20

A small Flax Linen MLP with Adam, data-parallel over the processes (one CPU device
each), fed by a ``grain.DataLoader`` sharded by JAX process. Contenders:

* ``jaxckpt``: a local tier per process (``<local><i>``), ``local_replicas`` peers,
  ``local_retention=KeepLast(2)``, a save every ``--every`` steps and on preemption,
  promotion of every ``--promote-every``-th step to the durable root by the
  supervisor's promoter sidecars (``promotion="external"``); the data iterator's state
  is each process's ``process_state``.
* ``orbax``: Orbax's ``CheckpointManager`` on the durable root only, its default options
  but ``save_interval_steps=--promote-every``; the iterator through grain's own Orbax
  handler; a SIGTERM saves at JAX's preemption sync point (Orbax's own mechanism; one
  process alone: a handler that saves the next step).
* ``reference``: no checkpoints, never interrupted: the data order and the final
  parameters every other run is compared with.

It prints one event per line on stdout, ``EV <unix time> <what> ...``: ``START``,
``JOINED`` (imports, the distributed group), ``BUILT`` (the model), ``OPENED`` (the
checkpoint manager), ``COMPILED`` (the train step, ahead of time: a restore follows it,
so what a manager does in the background after its open overlaps the compilation),
``RESTORED <step> <tier>`` or ``FRESH``, ``STEP <step> <crc32 of
this process's batch>``, ``PREEMPTED <step>`` (saved and exiting) and ``DONE <step>
<sha256 of the state>``. The supervisor derives goodput, lost steps and wrong data from
these alone, and keeps each process's timeline of events (``logs/<run>-<i>.events``).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import sys
import time
import zlib
from typing import Any

import numpy as np

FEATURES, HIDDEN, CLASSES, RECORDS = 32, 256, 8, 512


def say(*words: object) -> None:
    print("EV", f"{time.time():.3f}", *words, flush=True)


class Records:
    """A synthetic random-access source (grain's protocol), the same for every run."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(RECORDS, FEATURES)).astype(np.float32)
        self.y = rng.integers(0, CLASSES, size=RECORDS).astype(np.int32)

    def __len__(self) -> int:
        return RECORDS

    def __repr__(self) -> str:
        return "Records()"

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"x": self.x[i], "y": self.y[i]}


def wait_for_coordinator(address: str, timeout_s: float = 120.0) -> None:
    """Waits until process 0's coordination service listens: a client that connects
    first is retried by JAX after a backoff of about a second (whether process 0 finished
    its imports first is a race that added 0 or 1.1 s to a start, either contender)."""
    import socket

    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.01)


def make_loader(seed: int, batch: int) -> Any:
    import grain
    import jax

    sampler = grain.samplers.IndexSampler(
        num_records=RECORDS,
        shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
        shuffle=True,
        num_epochs=None,
        seed=seed,
    )
    return grain.DataLoader(
        data_source=Records(seed),
        sampler=sampler,
        operations=[grain.transforms.Batch(batch // jax.process_count(), drop_remainder=True)],
        worker_count=0,
    )


def build(seed: int) -> tuple[Any, Any]:
    """The initial train state (params and Adam's state) and the step function."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.relu(nn.Dense(HIDDEN)(x))
            x = nn.relu(nn.Dense(HIDDEN)(x))
            return nn.Dense(CLASSES)(x)

    model, tx = MLP(), optax.adam(1e-3)

    def init() -> dict[str, Any]:
        params = model.init(jax.random.key(seed), jnp.zeros((1, FEATURES)))["params"]
        return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> dict[str, Any]:
        def loss_fn(params: Any) -> jax.Array:
            logits = model.apply({"params": params}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        grads = jax.grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt, "step": state["step"] + 1}

    return init, step


def digest(state: Any) -> str:
    import jax

    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(state):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


class _Heard(logging.Handler):
    """The tier a restore read from, as its log line says (``restored step N from the
    <tier> copy``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.tier = "unknown"

    def emit(self, record: logging.LogRecord) -> None:
        words = record.getMessage().split()
        if words[:2] == ["restored", "step"] and "copy" in words:
            self.tier = words[words.index("copy") - 1]


class Jaxckpt:
    def __init__(self, args: argparse.Namespace) -> None:
        import jax

        import jaxckpt
        from jaxckpt import policy

        tiered: dict[str, Any] = {}
        if jax.process_count() > 1 and args.replicas > 1:
            tiered.update(local_replicas=min(args.replicas, jax.process_count()), peer_timeout_s=20)
        self.mgr = jaxckpt.CheckpointManager(
            args.durable,
            local_root=f"{args.local}{jax.process_index()}",
            promotion="external",
            promote_policy=policy.EveryNSteps(args.promote_every),
            local_retention=policy.KeepLast(2),
            save_policy=policy.EveryNSteps(args.every) | policy.OnPreemption(),
            save_timeout_s=120,
            tolerate_failed_saves=3,  # a full local disk: room is made, the next save commits
            # In the local tier (a node's loss takes it too): each process's step (compile).
            compilation_cache=True,
            **tiered,
        )

    def compile(self, lowered: Any) -> Any:
        return self.mgr.compile(lowered)

    def restore(self, target: Any, data: Any) -> Any:
        if self.mgr.latest_step() is None:
            return None
        heard = _Heard()
        logging.getLogger("jaxckpt").addHandler(heard)
        try:
            state = self.mgr.restore(target=target)
        finally:
            logging.getLogger("jaxckpt").removeHandler(heard)
        data.set_state(self.mgr.restored_process_state)
        say("RESTORED", self.mgr.restored_step, heard.tier)
        return state

    def save(self, step: int, state: Any, data: Any, final: bool) -> bool:
        """Saves as the policy says; True when preempted (saved, committed: exit)."""
        self.mgr.save(step, state, process_state=data.get_state, force=final)
        if self.mgr.preempted(step):
            self.mgr.wait()
            return True
        return False

    def close(self) -> None:
        self.mgr.close()


class Orbax:
    def __init__(self, args: argparse.Namespace) -> None:
        import jax
        import orbax.checkpoint as ocp

        self.ocp = ocp
        options = ocp.CheckpointManagerOptions(save_interval_steps=args.promote_every)
        self.mgr = ocp.CheckpointManager(args.durable, options=options)
        self.term = False
        if jax.process_count() == 1:  # several: JAX's preemption sync point, as Orbax uses
            signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, *_: object) -> None:
        self.term = True

    def compile(self, lowered: Any) -> Any:
        return lowered.compile()

    def restore(self, target: Any, data: Any) -> Any:
        import grain

        step = self.mgr.latest_step()
        if step is None:
            return None
        args = self.ocp.args.Composite(
            state=self.ocp.args.StandardRestore(target),
            data=grain.checkpoint.CheckpointRestore(data),
        )
        restored = self.mgr.restore(step, args=args)
        say("RESTORED", step, "durable")
        return restored["state"]

    def save(self, step: int, state: Any, data: Any, final: bool) -> bool:
        import grain

        args = self.ocp.args.Composite(
            state=self.ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data)
        )
        self.mgr.save(step, args=args, force=final or self.term)  # saves at a sync point too
        if self.term or self.mgr.reached_preemption(step):
            self.mgr.wait_until_finished()
            return True
        return False

    def close(self) -> None:
        self.mgr.wait_until_finished()
        self.mgr.close()


class Reference:
    def __init__(self, args: argparse.Namespace) -> None:
        pass

    def compile(self, lowered: Any) -> Any:
        return lowered.compile()

    def restore(self, target: Any, data: Any) -> Any:
        return None

    def save(self, step: int, state: Any, data: Any, final: bool) -> bool:
        return False

    def close(self) -> None:
        pass


CONTENDERS = {"jaxckpt": Jaxckpt, "orbax": Orbax, "reference": Reference}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contender", choices=sorted(CONTENDERS), required=True)
    p.add_argument("--coordinator", default="")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--durable", default="")
    p.add_argument("--local", default="")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--promote-every", type=int, default=20)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="acts like a bigger model")
    args = p.parse_args(argv)
    say("START", os.getpid())
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("jaxckpt").setLevel(logging.INFO)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax

    jax.config.update("jax_platforms", "cpu")
    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if args.process_id > 0:
            wait_for_coordinator(args.coordinator)
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            coordinator_bind_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=120,
        )
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    say("JOINED")  # imports and the distributed group

    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    init, step_fn = build(args.seed)
    abstract = jax.eval_shape(init)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), abstract
    )
    data = iter(make_loader(args.seed, args.batch))
    say("BUILT")
    contender = CONTENDERS[args.contender](args)
    say("OPENED")
    # The step is compiled before the restore (it needs only the target's shapes), so
    # that what a checkpoint manager does in the background after its open overlaps it.
    batch_shapes = {"x": ((args.batch, FEATURES), np.float32), "y": ((args.batch,), np.int32)}
    batch_spec = {k: jax.ShapeDtypeStruct(*v, sharding=split) for k, v in batch_shapes.items()}
    jitted = jax.jit(step_fn, donate_argnums=0, out_shardings=replicated)
    train = contender.compile(jitted.lower(target, batch_spec))
    say("COMPILED")
    state = contender.restore(target, data)
    if state is None:
        state = jax.jit(init, out_shardings=replicated)()
        say("FRESH")
    step = int(state["step"])
    while step < args.steps:
        batch = next(data)
        crc = zlib.crc32(batch["y"].tobytes(), zlib.crc32(batch["x"].tobytes()))
        glob = {k: jax.make_array_from_process_local_data(split, v) for k, v in batch.items()}
        state = train(state, glob)
        state["step"].block_until_ready()  # a step is reached once computed
        step += 1
        if args.step_sleep:
            time.sleep(args.step_sleep)
        say("STEP", step, crc)
        if contender.save(step, state, data, final=step == args.steps):
            say("PREEMPTED", step)
            contender.close()
            return 0
    contender.close()
    say("DONE", step, digest(state))
    return 0


if __name__ == "__main__":
    sys.exit(main())
