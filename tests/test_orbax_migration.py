"""Migration between Orbax and jaxckpt, both ways, with Flax states that resume.

Orbax ``CheckpointManager`` directories (Orbax's step numbers kept, every step
or chosen ones), Flax's legacy ``checkpoint_<N>`` directories, Composite items
besides the state, and ``export_orbax`` read back by Orbax's own
``CheckpointManager``. Everything is compared bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import linen, nnx
from flax.training import checkpoints as flax_checkpoints
from flax.training import train_state

import jaxckpt
from jaxckpt import cli


def _bits(x) -> tuple:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.asarray(x)
    return a.dtype.name, a.shape, a.tobytes()


def assert_bitexact(a, b) -> None:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    assert [_bits(x) for x in la] == [_bits(y) for y in lb]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------ the states


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return linen.Dense(3)(linen.relu(linen.Dense(8)(x)))


@functools.cache  # compiled once for the tests that share it (the states are immutable)
def _train_states(n: int) -> tuple[train_state.TrainState, ...]:
    """A TrainState with an optax chain (its EmptyState included) after 1..n updates."""
    module, x = LinenMLP(), jnp.ones((2, 4))
    params = module.init(jax.random.key(0), x)["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    state = train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)
    loss = jax.jit(jax.grad(lambda p: jnp.sum(module.apply({"params": p}, x) ** 2)))
    update = jax.jit(lambda s, g: s.apply_gradients(grads=g))  # step becomes an int32 array
    states = []
    for _ in range(n):
        state = update(state, loss(state.params))
        states.append(state)
    return tuple(states)


class NNXModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)  # an RNG stream in the state

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.drop(self.norm(self.up(x)))


def _nnx(seed: int) -> tuple[NNXModel, nnx.Optimizer]:
    model = NNXModel(nnx.Rngs(seed, dropout=seed + 1))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


# ------------------------------------------------------------------ Orbax -> jaxckpt


def test_train_state_from_an_orbax_manager_resumes_and_goes_back(tmp_path):
    states = _train_states(2)
    orbax_dir = str(tmp_path / "orbax")
    with ocp.CheckpointManager(orbax_dir) as mgr:
        for i, state in enumerate(states, start=1):
            mgr.save(i * 100, args=ocp.args.StandardSave(state))
        mgr.wait_until_finished()
    abstract = jax.eval_shape(lambda: states[-1])
    root = str(tmp_path / "root")

    results = jaxckpt.import_orbax(orbax_dir, root, target=abstract)
    assert [r.step for r in results] == [100, 200]  # every step, Orbax's numbers
    reader = jaxckpt.CheckpointManager(root, read_only=True)
    for step, state in zip((100, 200), states, strict=True):
        restored = reader.restore(step, target=abstract)
        assert isinstance(restored, train_state.TrainState)
        assert_bitexact(restored, state)
    assert reader.metadata(200).user_metadata["imported_from"] == (
        f"orbax:{os.path.join(orbax_dir, '200')}"
    )
    # The imported state trains on exactly like the original.
    grads = jax.tree.map(jnp.ones_like, states[-1].params)
    assert_bitexact(restored.apply_gradients(grads=grads), states[-1].apply_gradients(grads=grads))

    # And back: Orbax's own CheckpointManager restores the export bit for bit.
    dest = str(tmp_path / "back")
    result = jaxckpt.export_orbax(root, dest, step=100, target=abstract)
    assert (result.step, result.path) == (100, os.path.join(dest, "100", "default"))
    with ocp.CheckpointManager(dest) as mgr:
        assert mgr.all_steps() == [100]
        back = mgr.restore(100, args=ocp.args.StandardRestore(abstract))
    assert_bitexact(back, states[0])
    with pytest.raises(jaxckpt.StepAlreadyExistsError, match="already holds step 100"):
        jaxckpt.export_orbax(root, dest, step=100, target=abstract)


def test_nnx_state_round_trips_both_ways(tmp_path):
    model, optimizer = _nnx(0)
    state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    orbax_dir = str(tmp_path / "orbax")
    with ocp.CheckpointManager(orbax_dir) as mgr:
        mgr.save(7, args=ocp.args.StandardSave(state))
        mgr.wait_until_finished()
    abstract_model, abstract_opt = nnx.eval_shape(lambda: _nnx(1))
    graphdef, abstract_state = nnx.split(abstract_model)
    target = {"model": abstract_state, "optimizer": nnx.state(abstract_opt)}
    root = str(tmp_path / "root")

    (result,) = jaxckpt.import_orbax(orbax_dir, root, target=target, steps=7)
    assert result.step == 7 and result.arrays == len(jax.tree.leaves(state))
    restored = jaxckpt.CheckpointManager(root, read_only=True).restore(7, target=target)
    assert_bitexact(restored, state)  # the RNG stream's key and count included

    dest = str(tmp_path / "back")
    jaxckpt.export_orbax(root, dest, target=target)  # the newest step
    with ocp.CheckpointManager(dest) as mgr:
        assert_bitexact(mgr.restore(7, args=ocp.args.StandardRestore(target)), state)

    # The imported state rebuilds the model: same output, same dropout draws (calls
    # advance the RNG counts in place, so this comes after the comparisons).
    x = jnp.ones((2, 4))
    np.testing.assert_array_equal(nnx.merge(graphdef, restored["model"])(x), model(x))


def test_a_flax_checkpoints_directory_imports_every_step_with_its_number(capsys, tmp_path):
    states = _train_states(2)
    flax_dir = str(tmp_path / "flax")
    for step, state in zip((10, 20), states, strict=True):
        flax_checkpoints.save_checkpoint(flax_dir, state, step=step, keep=5)
    assert sorted(os.listdir(flax_dir)) == ["checkpoint_10", "checkpoint_20"]
    root = str(tmp_path / "root")

    rc, out, err = _run(capsys, "import", flax_dir, root)
    assert rc == 0, err
    assert [line.split(" with ")[0] for line in out.splitlines()] == [
        f"{root}: committed step 10",
        f"{root}: committed step 20",
    ]
    # Without a target: today's numpy nesting, Orbax's numbers.
    plain = jaxckpt.CheckpointManager(root, read_only=True).restore(20)
    assert _bits(plain["params"]["Dense_0"]["kernel"]) == _bits(
        states[1].params["Dense_0"]["kernel"]
    )

    # Flax's pre-Orbax msgpack files are named, not misread.
    msgpack_dir = tmp_path / "msgpack"
    msgpack_dir.mkdir()
    (msgpack_dir / "checkpoint_3").write_bytes(b"\x80")
    rc, _, err = _run(capsys, "import", str(msgpack_dir), str(tmp_path / "r3"), "--from", "orbax")
    assert rc == 1 and "checkpoint_3 is a file (Flax's msgpack checkpoint" in err

    # With the TrainState as target, each step resumes; one named directly keeps its number.
    abstract = jax.eval_shape(lambda: states[0])
    root2 = str(tmp_path / "root2")
    (only,) = jaxckpt.import_orbax(os.path.join(flax_dir, "checkpoint_20"), root2, target=abstract)
    assert only.step == 20
    restored = jaxckpt.CheckpointManager(root2, read_only=True).restore(20, target=abstract)
    assert isinstance(restored, train_state.TrainState)
    assert_bitexact(restored, states[1])
    # The legacy reader's own restore agrees.
    assert_bitexact(flax_checkpoints.restore_checkpoint(flax_dir, states[0], step=20), restored)


# ---------------------------------------------------------------------- Composite items


class _IteratorHandler(ocp.CheckpointHandler):
    """grain's Orbax handler's layout (``process_<i>-of-<n>.json``), without grain."""

    def save(self, directory, args):
        (directory / "process_0-of-1.json").write_text(json.dumps(args.state))

    def restore(self, directory, args=None):
        return json.loads((directory / "process_0-of-1.json").read_text())


@ocp.args.register_with_handler(_IteratorHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class _IteratorArgs(ocp.args.CheckpointArgs):
    state: dict | None = None


def _composite(path: str, step: int, **items) -> None:
    with ocp.CheckpointManager(path) as mgr:
        mgr.save(step, args=ocp.args.Composite(**items))
        mgr.wait_until_finished()


def test_composite_items_are_imported_or_refused_by_name_never_dropped(capsys, tmp_path):
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "step": 5}
    orbax_dir = str(tmp_path / "orbax")
    _composite(
        orbax_dir,
        5,
        state=ocp.args.StandardSave(state),
        config=ocp.args.JsonSave({"lr": 0.1, "layers": [1, 2]}),
        data_iter=_IteratorArgs({"next_index": 42}),
    )
    root = str(tmp_path / "root")
    # The data iterator round-trips as this step's process_state.
    assert [r.step for r in jaxckpt.import_orbax(orbax_dir, root)] == [5]
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    restored = mgr.restore(5)
    assert mgr.restored_process_state == {"next_index": 42}
    # Exported, the process state is a data-iterator item again, in grain's layout.
    dest = str(tmp_path / "back")
    assert jaxckpt.export_orbax(root, dest).path == os.path.join(dest, "5", "default")
    with ocp.CheckpointManager(dest, item_names=("default", "data_iter")) as back:
        items = back.restore(
            5,
            args=ocp.args.Composite(
                default=ocp.args.StandardRestore(state), data_iter=_IteratorArgs()
            ),
        )
    assert items["data_iter"] == {"next_index": 42}
    assert _bits(items["default"]["w"]) == _bits(state["w"])
    # Leaving the iterator out is explicit, and recorded.
    skipped = str(tmp_path / "skipped")
    rc, out, err = _run(capsys, "import", orbax_dir, skipped, "--skip-item", "data_iter")
    assert rc == 0, err
    assert out.startswith(f"{skipped}: committed step 5 with 1 arrays")
    without = jaxckpt.CheckpointManager(skipped, read_only=True)
    assert _bits(without.restore(5)["w"]) == _bits(state["w"])
    assert without.restored_process_state is None
    assert without.metadata(5).user_metadata["orbax_skipped_items"] == ["data_iter"]
    assert _bits(restored["w"]) == _bits(state["w"]) and restored["step"] == 5
    meta = mgr.metadata(5).user_metadata
    assert meta["orbax_items"] == {"config": {"lr": 0.1, "layers": [1, 2]}}

    # The iterator states of a 2-process job cannot be one process's state: refused.
    item = os.path.join(orbax_dir, "5", "data_iter")
    os.rename(os.path.join(item, "process_0-of-1.json"), os.path.join(item, "process_0-of-2.json"))
    with open(os.path.join(item, "process_1-of-2.json"), "w") as f:
        f.write('{"next_index": 43}')
    with pytest.raises(jaxckpt.CheckpointError, match="state of 2 processes"):
        jaxckpt.import_orbax(orbax_dir, str(tmp_path / "r3"))

    # An item of a kind jaxckpt cannot read is refused, naming it and the way out.
    other = str(tmp_path / "other")
    _composite(other, 3, state=ocp.args.StandardSave(state), table=ocp.args.ArraySave(np.ones(3)))
    with pytest.raises(jaxckpt.CheckpointError, match=r"item 'table' \(.*ArrayCheckpointHandler"):
        jaxckpt.import_orbax(other, str(tmp_path / "r2"), skip_items=["data_iter"])


def test_several_tree_items_become_one_dict_and_need_one_target_each(tmp_path):
    params = {"w": np.arange(4, dtype=np.float32)}
    opt = {"mu": np.ones(4, np.float32)}
    orbax_dir = str(tmp_path / "orbax")
    _composite(orbax_dir, 1, params=ocp.args.StandardSave(params), opt=ocp.args.StandardSave(opt))
    root = str(tmp_path / "root")
    jaxckpt.import_orbax(orbax_dir, root)
    assert_bitexact(
        jaxckpt.CheckpointManager(root, read_only=True).restore(1), {"opt": opt, "params": params}
    )
    with pytest.raises(jaxckpt.TreeMismatchError, match=r"items \['opt', 'params'\]"):
        jaxckpt.import_orbax(orbax_dir, str(tmp_path / "r2"), target=params)


def test_orbax_metrics_and_custom_metadata_are_kept(tmp_path):
    orbax_dir = str(tmp_path / "orbax")
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(orbax_dir, options=options) as mgr:
        mgr.save(
            4,
            args=ocp.args.StandardSave({"w": np.ones(2, np.float32)}),
            metrics={"loss": 0.25, "acc": 0.5},
            custom_metadata={"run": "a"},
        )
    root = str(tmp_path / "root")
    jaxckpt.import_orbax(orbax_dir, root)
    meta = jaxckpt.CheckpointManager(root, read_only=True).metadata(4)
    assert meta.metrics == {"loss": 0.25, "acc": 0.5}  # what KeepBest ranks steps by
    assert meta.user_metadata["orbax_metrics"] == {"loss": 0.25, "acc": 0.5}
    assert meta.user_metadata["orbax_custom_metadata"] == {"run": "a"}
    assert "orbax_items" not in meta.user_metadata


def test_a_target_that_would_change_shapes_or_lose_values_is_refused(tmp_path):
    orbax_dir = str(tmp_path / "orbax")
    _composite(orbax_dir, 1, default=ocp.args.StandardSave({"w": np.linspace(0, 1, 4)}))
    root = str(tmp_path / "root")
    # Orbax itself would silently return 4 values for 5, and round float64 to bfloat16.
    wider = {"w": jax.ShapeDtypeStruct((5,), jnp.float32)}
    with pytest.raises(jaxckpt.TreeMismatchError, match=r"\['w'\]: saved \(4,\), target \(5,\)"):
        jaxckpt.import_orbax(orbax_dir, root, target=wider)
    narrow = {"w": jax.ShapeDtypeStruct((4,), jnp.bfloat16)}
    with pytest.raises(jaxckpt.TreeMismatchError, match="saved float64, target bfloat16"):
        jaxckpt.import_orbax(orbax_dir, root, target=narrow)
    assert not os.path.exists(root)  # checked from Orbax's metadata before anything is written
    jaxckpt.import_orbax(orbax_dir, root, target=narrow, allow_lossy_cast=True)
    restored = jaxckpt.CheckpointManager(root, read_only=True).restore(1, target=narrow)
    assert restored["w"].dtype == jnp.bfloat16


# ----------------------------------------------------------------------------- the CLI


def test_cli_chooses_steps_exports_to_orbax_and_refuses_what_it_cannot_write(capsys, tmp_path):
    orbax_dir = str(tmp_path / "orbax")
    with ocp.CheckpointManager(orbax_dir) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, args=ocp.args.StandardSave({"w": np.full(3, step, np.int32)}))
        mgr.wait_until_finished()
    os.makedirs(os.path.join(orbax_dir, "tensorboard_4", "plugins"))  # not a step
    root = str(tmp_path / "root")
    rc, out, err = _run(capsys, "import", orbax_dir, root, "--step", "3", "--step", "1")
    assert rc == 0, err
    assert jaxckpt.CheckpointManager(root, read_only=True).steps() == [1, 3]
    rc, _, err = _run(capsys, "import", orbax_dir, root, "--step", "9")
    assert rc == 1 and "has no Orbax step 9 (its steps: 1, 2, 3)" in err
    rc, _, err = _run(capsys, "import", orbax_dir, root)  # step 2 is free, 1 and 3 are not
    assert rc == 1 and "step 1 already exists" in err
    assert jaxckpt.CheckpointManager(root, read_only=True).steps() == [1, 3]  # nothing written
    rc, _, err = _run(capsys, "import", orbax_dir, f"{root}:50", "--step", "2")
    assert rc == 0, err

    dest = str(tmp_path / "back")
    rc, out, err = _run(capsys, "export", f"{root}:3", dest, "--format", "orbax")
    assert rc == 0, err
    assert out.startswith(f"step 3: exported 1 arrays (12 B) to {dest}/3/default (Orbax)")
    with ocp.CheckpointManager(dest) as mgr:
        back = mgr.restore(3)
        custom = mgr.metadata(3).custom_metadata
    assert _bits(back["w"]) == _bits(np.full(3, 3, np.int32))
    assert custom["exported_from"] == f"jaxckpt:{root}"
    with pytest.raises(SystemExit):
        cli.main(["export", root, dest, "--format", "orbax", "--leaf", "w"])
    assert "apply to --format safetensors only" in capsys.readouterr().err

    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(60, {"w": np.ones(2), "name": "run-a"})
        mgr.save(61, {"w": np.ones(2, np.float32), "empty": np.zeros((0, 3))})
    rc, _, err = _run(capsys, "export", f"{root}:60", dest, "--format", "orbax")
    assert rc == 1 and "leaf name is a string" in err
    rc, _, err = _run(capsys, "export", f"{root}:61", dest, "--format", "orbax")
    assert rc == 1 and "leaf empty is an empty array" in err
    assert not os.path.exists(os.path.join(dest, "61"))
    # The way out: a target without the leaf, partial.
    subset = {"w": jax.ShapeDtypeStruct((2,), np.float32)}
    jaxckpt.export_orbax(root, dest, step=61, target=subset, partial=True)
    with ocp.CheckpointManager(dest) as mgr:
        assert mgr.restore(61, args=ocp.args.StandardRestore(subset))["w"].tolist() == [1, 1]
