"""A Flax Linen ``TrainState`` loop fed by grain, resuming its model and its data exactly.

    python scripts/train_linen.py --checkpoint_root=/tmp/cnn --steps=40 --data=loader

The loop of Flax's imagenet example, small: a CNN with BatchNorm (``batch_stats`` in a
``TrainState`` subclass), SGD with momentum and a cosine schedule (an optax chain),
data-parallel over the devices, on a synthetic image set read through grain:
``--data=loader`` a ``grain.DataLoader`` (its iterator's state is bytes), ``--data=dataset``
a ``grain.MapDataset`` pipeline (a ``DatasetIterator``, whose state is a dict). Each
save passes the iterator's ``get_state()`` as ``process_state``, so it is committed with
the arrays of the same step; a restart restores both and continues the exact batch
sequence. Each step prints ``BATCH <step> <crc32>`` of the batch it trained on.

Every ``--checkpoint_*`` flag of :mod:`jaxckpt.flags` applies.
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import linen as nn
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
import jaxckpt.flags

_STEPS: flags.FlagHolder[int]
_BATCH: flags.FlagHolder[int]
_DATA: flags.FlagHolder[str]
_SEED: flags.FlagHolder[int]
_CACHE: flags.FlagHolder[str | None]


def define_flags() -> None:
    """This script's flags and jaxckpt's, defined only when it runs as a script: a test
    that imports its functions leaves the process's flags (and their defaults) alone."""
    global _STEPS, _BATCH, _DATA, _SEED, _CACHE
    _STEPS = flags.DEFINE_integer("steps", 40, "Train until this step.")
    _BATCH = flags.DEFINE_integer("batch_size", 8, "Images per step (all processes together).")
    _DATA = flags.DEFINE_enum("data", "loader", ["loader", "dataset"], "The grain iterator kind.")
    _SEED = flags.DEFINE_integer("seed", 0, "Seed of the data, its order and the initialisation.")
    _CACHE = flags.DEFINE_string("compilation_cache", None, "JAX persistent compilation cache dir.")
    jaxckpt.flags.define_flags()
    flags.FLAGS.set_default("checkpoint_every_steps", 5)


IMAGES, SIDE, CLASSES = 96, 8, 4


class Images:
    """A synthetic random-access data source (grain's protocol: ``__len__``, ``__getitem__``)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        rng = np.random.default_rng(seed)
        self.images = rng.normal(size=(IMAGES, SIDE, SIDE, 1)).astype(np.float32)
        self.labels = rng.integers(0, CLASSES, size=IMAGES).astype(np.int32)

    def __len__(self) -> int:
        return IMAGES

    def __repr__(self) -> str:  # a DataLoader checks a restored state against repr(source)
        return f"Images(seed={self.seed})"

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"image": self.images[i], "label": self.labels[i]}


def make_iterator(kind: str, seed: int, batch: int) -> Any:
    """This process's endless, shuffled batches: a DataLoader's or a DatasetIterator."""
    import grain

    source = Images(seed)
    per_process = batch // jax.process_count()
    if kind == "loader":
        sampler = grain.samplers.IndexSampler(
            num_records=len(source),
            shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
            shuffle=True,
            num_epochs=None,
            seed=seed,
        )
        loader = grain.DataLoader(
            data_source=source,
            sampler=sampler,
            operations=[grain.transforms.Batch(per_process, drop_remainder=True)],
            worker_count=0,
        )
        return iter(loader)
    dataset = (
        grain.MapDataset.source(source)
        .shuffle(seed=seed)
        .repeat()[jax.process_index() :: jax.process_count()]
        .batch(per_process, drop_remainder=True)
    )
    return iter(dataset.to_iter_dataset())


def fingerprint(batch: dict[str, np.ndarray]) -> int:
    """CRC32 of a batch's images and labels (what ``BATCH`` lines print)."""
    return zlib.crc32(np.asarray(batch["label"]).tobytes(), zlib.crc32(batch["image"].tobytes()))


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x).mean(axis=(1, 2))
        return nn.Dense(CLASSES)(x)


class TrainState(train_state.TrainState):
    batch_stats: Any


def create_state(seed: int) -> TrainState:
    model = CNN()
    variables = model.init(jax.random.key(seed), jnp.zeros((1, SIDE, SIDE, 1)), train=False)
    schedule = optax.cosine_decay_schedule(0.1, decay_steps=1000)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(schedule, momentum=0.9))
    return TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
    )


def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, jax.Array]:
    def loss_fn(params: Any) -> tuple[jax.Array, Any]:
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            train=True,
            mutable=["batch_stats"],
        )
        labels = batch["label"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
    return state, loss


def train(mgr: jaxckpt.CheckpointManager) -> None:
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    abstract = jax.eval_shape(lambda: create_state(_SEED.value))
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), abstract
    )
    data = make_iterator(_DATA.value, _SEED.value, _BATCH.value)
    if mgr.latest_step() is None:
        state = jax.jit(lambda: create_state(_SEED.value), out_shardings=replicated)()
        logging.info("fresh start under %s", mgr.root)
    else:
        state = mgr.restore(target=target)
        data.set_state(mgr.restored_process_state)  # the data position of the same step
        logging.info("resumed from step %d", mgr.restored_step)
    step_fn = jax.jit(train_step, donate_argnums=0, out_shardings=(replicated, replicated))
    step = int(state.step)
    while step < _STEPS.value:
        batch = next(data)
        print(f"BATCH {step + 1} {fingerprint(batch)}", flush=True)
        global_batch = {
            k: jax.make_array_from_process_local_data(split, np.asarray(v))
            for k, v in batch.items()
        }
        state, loss = step_fn(state, global_batch)
        step += 1
        mgr.save(step, state, process_state=data.get_state, force=step == _STEPS.value)
    mgr.wait()
    logging.info("done at step %d: loss %.4f", step, float(loss) if _STEPS.value else 0.0)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CACHE.value:
        jax.config.update("jax_compilation_cache_dir", _CACHE.value)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    with jaxckpt.flags.manager_from_flags() as mgr:
        train(mgr)


if __name__ == "__main__":
    define_flags()
    app.run(main)
