"""Train a small byte-level transformer on the Python standard library, checkpointing with jaxckpt.

    python scripts/train.py --checkpoint_root=/tmp/lm --steps=300 --checkpoint_every_steps=25

The text is the standard library's own ``*.py`` files (read from
``os.path.dirname(os.__file__)`` in sorted order), so it runs offline. The model is a
Flax NNX decoder (2 layers, d_model 64 by default) trained with optax AdamW, its matrices
sharded over a (data, model) mesh: FSDP over `data`, tensor parallel over `model`
(``--model_parallel``).

What it shows:

* **Automatic resume.** At start it restores the newest committed step, if any: model
  parameters, optimizer state, the step, the data position and the PRNG key, into an
  abstract state (``nnx.eval_shape``) with explicit shardings attached. The batch of a
  step is a pure function of the step, so a resumed run is bit-identical to one that
  was never interrupted.
* **Preemption.** SIGTERM (or Ctrl-C) makes the next step boundary save; once that save
  is committed the script exits with status 0.
* **Pre-flight.** ``--preflight`` (or ``--checkpoint_preflight_steps=N``) first proves
  that a checkpoint of the starting state resumes bit-exactly (``jaxckpt.check_resume``)
  and prints the report; a failed check exits with status 2 before any training.
* **Overhead.** Each committed save is logged with its bytes and throughput, and the
  run ends with the seconds blocked on checkpoints as a share of wall time.

Every ``--checkpoint_*`` flag of :mod:`jaxckpt.flags` applies; e.g.
``--checkpoint_init_from=OTHER_ROOT --checkpoint_init_partial`` starts a new run from
another run's model, optimizer and PRNG key (its step counter starts at 0).
"""

from __future__ import annotations

import contextlib
import functools
import logging as std_logging
import os
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
import jaxckpt.flags
from jaxckpt.saving import human_bytes

_STEPS = flags.DEFINE_integer("steps", 300, "Train until this step.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Sequences per step.")
_SEQ = flags.DEFINE_integer("seq_len", 64, "Bytes per sequence.")
_D_MODEL = flags.DEFINE_integer("d_model", 64, "Model width.")
_LAYERS = flags.DEFINE_integer("num_layers", 2, "Transformer blocks.")
_HEADS = flags.DEFINE_integer("num_heads", 4, "Attention heads.")
_LR = flags.DEFINE_float("learning_rate", 3e-3, "AdamW learning rate.")
_DROPOUT = flags.DEFINE_float("dropout", 0.1, "Dropout rate (uses the checkpointed PRNG key).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the initialisation, data order and dropout.")
_MODEL_PARALLEL = flags.DEFINE_integer(
    "model_parallel",
    1,
    "Devices per tensor-parallel group (the mesh's 'model' axis).",
    lower_bound=1,
)
_LOG_EVERY = flags.DEFINE_integer("log_every", 20, "Log the loss every N steps.")
_SLEEP = flags.DEFINE_float(
    "simulated_step_seconds", 0.0, "Sleep this long per step, to act like a bigger model."
)
_CACHE = flags.DEFINE_string("compilation_cache", None, "JAX persistent compilation cache dir.")
_PREFLIGHT = flags.DEFINE_bool(
    "preflight",
    False,
    "Before training, check that a checkpoint of the starting state resumes bit-exactly "
    "(jaxckpt.check_resume, --checkpoint_preflight_steps steps, default 10), print the "
    "report, and exit with status 2 if it fails.",
)

jaxckpt.flags.define_flags()
flags.FLAGS.set_default("checkpoint_every_steps", 50)
flags.FLAGS.set_default("checkpoint_keep_last", 3)

VOCAB = 256  # bytes


# ------------------------------------------------------------------------------- data


def load_corpus() -> np.ndarray:
    """The standard library's top-level ``*.py`` files, sorted by name, as bytes."""
    directory = os.path.dirname(os.__file__)
    names = sorted(n for n in os.listdir(directory) if n.endswith(".py"))
    parts = []
    for name in names:
        with open(os.path.join(directory, name), "rb") as f:
            parts.append(f.read())
    logging.info(
        "corpus: %d files, %s from %s", len(names), human_bytes(sum(map(len, parts))), directory
    )
    return np.frombuffer(b"\n".join(parts), dtype=np.uint8)


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, windows: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(windows)


def batch_at(corpus: np.ndarray, step: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
    """The batch of ``step``: a pure function of the step (and the seed).

    Example ``i = step * batch + b`` is window ``perm_e[i % windows]`` of epoch
    ``e = i // windows``, where windows are the corpus's non-overlapping runs of
    ``seq_len + 1`` bytes and ``perm_e`` is a seeded permutation per epoch.
    """
    width = seq_len + 1
    windows = len(corpus) // width
    rows = []
    for i in range(step * batch, (step + 1) * batch):
        w = int(_epoch_order(seed, i // windows, windows)[i % windows])
        rows.append(corpus[w * width : (w + 1) * width])
    return np.stack(rows).astype(np.int32)


# ------------------------------------------------------------------------------ model


def _dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0:
        return x
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0)


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, dropout: float, *, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, keep_rngs=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)
        self.dropout = dropout

    def __call__(self, x: jax.Array, mask: jax.Array, key: jax.Array | None) -> jax.Array:
        k1, k2 = jax.random.split(key) if key is not None else (None, None)
        x = x + _dropout(self.attn(self.ln1(x), mask=mask), self.dropout, k1)
        return x + _dropout(self.down(nnx.gelu(self.up(self.ln2(x)))), self.dropout, k2)


class ByteLM(nnx.Module):
    """A decoder-only transformer over bytes, with tied input/output embeddings."""

    def __init__(self, *, d: int, layers: int, heads: int, seq_len: int, dropout: float, rngs):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, d)))
        self.blocks = nnx.List([Block(d, heads, dropout, rngs=rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, tokens: jax.Array, key: jax.Array | None = None) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mask = nnx.make_causal_mask(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, mask, None if key is None else jax.random.fold_in(key, i))
        return self.embed.attend(self.ln(x))


def make_model_and_optimizer(seed: int) -> tuple[ByteLM, nnx.Optimizer]:
    model = ByteLM(
        d=_D_MODEL.value,
        layers=_LAYERS.value,
        heads=_HEADS.value,
        seq_len=_SEQ.value,
        dropout=_DROPOUT.value,
        rngs=nnx.Rngs(seed),
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(_LR.value, weight_decay=0.01))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


# -------------------------------------------------------------------------- sharding


def sharding_for(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Matrices split their first axis over ``data`` (FSDP) and their second over ``model``
    (tensor parallel) where the axis divides; the rest replicate."""
    if len(shape) < 2:
        return NamedSharding(mesh, P())
    spec = [
        axis if shape[i] % mesh.shape[axis] == 0 and mesh.shape[axis] > 1 else None
        for i, axis in enumerate(("data", "model"))
    ]
    return NamedSharding(mesh, P(*spec))


def with_shardings(mesh: Mesh, abstract: Any) -> Any:
    """Attaches explicit shardings to an abstract state (``nnx.eval_shape`` drops them)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_for(mesh, x.shape)),
        abstract,
    )


def abstract_train_state(mesh: Mesh, seed: int) -> tuple[Any, Any, dict[str, Any]]:
    """Graph definitions of model and optimizer, and the sharded abstract train state."""
    model, optimizer = nnx.eval_shape(lambda: make_model_and_optimizer(seed))
    model_def, model_state = nnx.split(model)
    opt_def, opt_state = nnx.split(optimizer)
    key = jax.eval_shape(lambda: jax.random.key(seed))
    abstract = {"model": model_state, "optimizer": opt_state, "rng": key}
    return model_def, opt_def, with_shardings(mesh, abstract)


def init_train_state(seed: int, shardings: Any) -> dict[str, Any]:
    """A fresh train state, initialised under jit straight into its shardings."""

    def init() -> dict[str, Any]:
        model, optimizer = make_model_and_optimizer(seed)
        return {
            "model": nnx.state(model),
            "optimizer": nnx.state(optimizer),
            "rng": jax.random.key(seed),
        }

    return jax.jit(init, out_shardings=shardings)()


def make_train_step(model_def: Any, opt_def: Any, shardings: Any, mesh: Mesh) -> Any:
    def train_step(state: dict[str, Any], tokens: jax.Array) -> tuple[dict[str, Any], jax.Array]:
        model = nnx.merge(model_def, state["model"])
        optimizer = nnx.merge(opt_def, state["optimizer"])
        rng, dropout_key = jax.random.split(state["rng"])

        def loss_fn(model: ByteLM) -> jax.Array:
            logits = model(tokens[:, :-1], dropout_key)
            labels = tokens[:, 1:]
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        new_state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer), "rng": rng}
        return new_state, loss

    return jax.jit(
        train_step,
        donate_argnums=0,
        out_shardings=(shardings, NamedSharding(mesh, P())),
    )


# --------------------------------------------------------------------------- training


class Overhead:
    """Adds up the seconds the loop is blocked on checkpoints; logs each committed save once."""

    def __init__(self, mgr: jaxckpt.CheckpointManager) -> None:
        self._mgr = mgr
        self._seen = 0
        self.in_save_s = 0.0  # inside save(): host copy, plus waiting for the previous save
        self.final_wait_s = 0.0  # waiting for the last save to commit at the end

    @contextlib.contextmanager
    def blocking(self, *, final: bool = False) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            if final:
                self.final_wait_s += elapsed
            else:
                self.in_save_s += elapsed
            self.report()

    def report(self) -> None:
        stats = self._mgr.save_stats()
        for s in stats[self._seen :]:
            logging.info(
                "checkpoint: step %d committed, %s in %.2f s (%s/s), blocked %.3f s",
                s.step,
                human_bytes(s.nbytes),
                s.total_s,
                human_bytes(s.throughput_bps),
                s.blocking_s,
            )
        self._seen = len(stats)

    def summary(self, step: int, wall_s: float) -> str:
        blocked = self.in_save_s + self.final_wait_s
        return (
            f"done at step {step}: {self._seen} saves committed; checkpoint overhead "
            f"{blocked:.2f} s of {wall_s:.1f} s wall = {100 * blocked / wall_s:.1f}% "
            f"({self.in_save_s:.2f} s in save(), {self.final_wait_s:.2f} s waiting for the "
            "last commit)"
        )


def restore_or_init(
    mgr: jaxckpt.CheckpointManager, target: dict[str, Any], shardings: Any, seed: int
) -> tuple[dict[str, Any], int]:
    """The newest committed train state and its step, or a fresh state at step 0."""
    start = time.perf_counter()
    if mgr.latest_step() is None:
        logging.info("fresh start at step 0 under %s", mgr.root)
        initial = jaxckpt.flags.init_from_flags(mgr, target)  # --checkpoint_init_from
        return initial if initial is not None else init_train_state(seed, shardings), 0
    restored = mgr.restore(target={**target, "step": 0, "data_position": 0})
    step = restored.pop("step")
    position = restored.pop("data_position")
    if position != step * _BATCH.value:
        raise app.UsageError(
            f"the checkpoint of step {step} is at data position {position}, but "
            f"--batch_size={_BATCH.value} puts step {step} at {step * _BATCH.value}"
        )
    elapsed = time.perf_counter() - start
    logging.info("resumed from step %d (data position %d) in %.2f s", step, position, elapsed)
    return restored, step


def preflight(train_step: Any, state: Any, step: int, batches: Any, target: Any) -> None:
    """Runs the resume pre-flight on the starting state when asked; exits if it fails.

    The check restores into ``target``, the same abstract state a real resume uses, and
    feeds the batches this run would train on next.
    """
    steps = flags.FLAGS.checkpoint_preflight_steps or (10 if _PREFLIGHT.value else 0)
    if not steps:
        return
    start = time.perf_counter()
    report = jaxckpt.check_resume(
        train_step,
        state,
        [batches(step + i) for i in range(steps)],
        steps=steps,
        root=flags.FLAGS.checkpoint_preflight_root,
        target=target,
    )
    print(report, flush=True)
    logging.info("pre-flight (%.1f s): %s", time.perf_counter() - start, str(report).split("\n")[0])
    if not report.ok:
        raise SystemExit(2)


def train(mgr: jaxckpt.CheckpointManager) -> None:
    corpus = load_corpus()
    devices = np.array(jax.devices())
    if devices.size % _MODEL_PARALLEL.value:
        raise app.UsageError(f"--model_parallel must divide the {devices.size} devices")
    mesh = Mesh(devices.reshape(-1, _MODEL_PARALLEL.value), ("data", "model"))
    split = _BATCH.value % mesh.shape["data"] == 0
    batch_sharding = NamedSharding(mesh, P("data") if split else P())
    logging.info("devices: %d x %s, mesh %s", devices.size, devices.flat[0].platform, mesh.shape)
    seed = _SEED.value
    model_def, opt_def, target = abstract_train_state(mesh, seed)
    shardings = jax.tree.map(lambda x: x.sharding, target)
    start = time.perf_counter()
    state, step = restore_or_init(mgr, target, shardings, seed)
    train_step = make_train_step(model_def, opt_def, shardings, mesh)

    def batch(i: int) -> jax.Array:
        return jax.device_put(batch_at(corpus, i, _BATCH.value, _SEQ.value, seed), batch_sharding)

    preflight(train_step, state, step, batch, target)
    overhead = Overhead(mgr)
    last_log = (step, time.perf_counter())
    preempted = False
    while step < _STEPS.value and not preempted:
        state, loss = train_step(state, batch(step))
        step += 1
        time.sleep(_SLEEP.value)
        metrics = {"loss": float(loss)}
        checkpoint = {**state, "step": step, "data_position": step * _BATCH.value}
        with overhead.blocking():
            saved = mgr.save(step, checkpoint, metrics=metrics, force=step == _STEPS.value)
            preempted = mgr.preempted(step)  # SIGTERM: save this step, then stop
            if preempted and not saved:  # the notice came after the policy was asked
                mgr.save(step, checkpoint, metrics=metrics, force=True)
        if step % _LOG_EVERY.value == 0:
            now = time.perf_counter()
            rate = (step - last_log[0]) / (now - last_log[1])
            logging.info("step %d: loss %.4f (%.1f steps/s)", step, metrics["loss"], rate)
            last_log = (step, now)
    with overhead.blocking(final=True):
        mgr.wait()
    if preempted:
        logging.info("preempted: step %d saved and committed; exiting", step)
    logging.info("%s", overhead.summary(step, time.perf_counter() - start))


def _quiet_libraries(record: Any) -> bool:
    """Drops Orbax's per-save INFO lines and jaxckpt's own copy of the save line below."""
    if record.levelno >= std_logging.WARNING:
        return True
    return "orbax" not in record.pathname and record.module != "_telemetry"


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.get_absl_handler().python_handler.addFilter(_quiet_libraries)
    if _CACHE.value:
        jax.config.update("jax_compilation_cache_dir", _CACHE.value)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    with jaxckpt.flags.manager_from_flags() as mgr:  # a flag error is a usage error
        train(mgr)


if __name__ == "__main__":
    app.run(main)
