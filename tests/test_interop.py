"""Interop: safetensors export/import, Orbax import, zarr-python on every backend."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.flax
import safetensors.numpy
from rootpaths import step_dir
from safetensors import safe_open

import jaxckpt
from jaxckpt import cli, zarr_compat
from jaxckpt.restoring import dotted_path
from jaxckpt.tools import SafetensorsFormatError, read_safetensors


def _state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "params": {
            "w": jnp.asarray(rng.standard_normal((40, 24)), dtype=jnp.bfloat16),
            "b": rng.standard_normal(24).astype(np.float32),
        },
        "emb": rng.integers(-100, 100, (6, 5)).astype(np.int8),
        "mask": rng.integers(0, 2, (3, 3)).astype(bool),
        "f8": jnp.asarray(rng.standard_normal(8), dtype=jnp.float8_e4m3fn),
        "f16": rng.standard_normal(5).astype(np.float16),
        "scale": np.float32(step + 0.5),
        "empty": np.zeros((0, 3), np.float32),
        "layers": [np.full(4, step, np.int64), {"k": np.arange(3, dtype=np.uint16)}],
        "rng": jax.random.key(step),
        "step": step,
        "name": "run",
    }


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("interop") / "root")
    # many chunks per leaf, each a zarr chunk object (the plain layout)
    with jaxckpt.CheckpointManager(root, chunk_bytes=256, layout="plain") as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    return root


def _bits(x) -> tuple:
    a = np.asarray(x)
    return a.dtype.name, a.shape, a.tobytes()


def _expected(root: str, step: int) -> dict[str, np.ndarray]:
    view = jaxckpt.open_step(root, step)
    return {v.path: v.read() for v in view.arrays()}


def _load(path: str) -> dict:
    """Every tensor of a file, through the safetensors package (numpy API; bfloat16 through
    its flax API), except float8 ones, which safetensors 0.8 cannot hand to numpy or jax;
    those are checked against the header's dtype code and read with jaxckpt's reader."""
    out = {}
    with safe_open(path, framework="numpy") as f, safe_open(path, framework="flax") as fx:
        names = f.keys()  # a safe_open handle is not iterable
        for name in names:
            dtype = f.get_slice(name).get_dtype()
            if dtype == "BF16":  # jax would narrow 64-bit types; numpy lacks bfloat16
                out[name] = fx.get_tensor(name)
            elif not dtype.startswith("F8_"):
                out[name] = f.get_tensor(name)
    ours = dict(read_safetensors(path))
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    for name, info in header.items():
        if name != "__metadata__" and info["dtype"].startswith("F8_"):
            assert info["dtype"] == {"float8_e4m3fn": "F8_E4M3"}[ours[name].dtype.name]
            out[name] = ours[name]
    return out


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------------ export


def test_export_one_file_loads_bit_exact_with_safetensors(capsys, ckpt, tmp_path):
    rc, out, err = _run(capsys, "export", f"{ckpt}:2", str(tmp_path / "out"))
    assert rc == 0, err
    assert out.startswith("step 2: exported 11 tensors (") and "shards" not in out
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
    path = str(tmp_path / "out" / "model.safetensors")
    loaded = _load(path)
    expected = _expected(ckpt, 2)
    assert set(loaded) == set(expected) == {
        "params.w", "params.b", "emb", "mask", "f8", "f16", "scale", "empty",
        "layers.0", "layers.1.k", "rng",
    }  # fmt: skip
    for name, array in expected.items():
        assert _bits(loaded[name]) == _bits(array), name
    state = _state(2)
    assert _bits(loaded["params.w"]) == _bits(state["params"]["w"])
    assert loaded["params.w"].dtype == jnp.bfloat16 and loaded["f8"].dtype == jnp.float8_e4m3fn
    assert _bits(loaded["rng"]) == _bits(jax.random.key_data(state["rng"]))
    with safe_open(path, framework="flax") as f:
        meta = f.metadata()
    assert meta["jaxckpt.step"] == "2" and meta["format"] == "flax"
    assert json.loads(meta["jaxckpt.values"]) == {"step": 2, "name": "run"}


def test_export_shards_in_the_hugging_face_layout(capsys, ckpt, tmp_path):
    out = tmp_path / "sharded"
    rc, text, err = _run(
        capsys, "export", ckpt, str(out), "--max-shard-size", "1000", "--leaf", "params.*"
    )
    assert rc == 0, err
    assert "step 2: exported 2 tensors" in text and ", 2 shards" in text
    assert sorted(os.listdir(out)) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "params.b": "model-00001-of-00002.safetensors",  # tree order: b before w
        "params.w": "model-00002-of-00002.safetensors",
    }
    assert index["metadata"]["total_size"] == 40 * 24 * 2 + 24 * 4
    expected = _expected(ckpt, 2)
    for name, file in index["weight_map"].items():
        assert _bits(_load(str(out / file))[name]) == _bits(expected[name])


def test_export_streams_in_small_blocks_bit_exact(ckpt, tmp_path):
    path = str(tmp_path / "one.safetensors")
    written: list[int] = []
    result = jaxckpt.export_safetensors(
        ckpt, path, step=1, block_bytes=64, max_shard_bytes=1, on_progress=written.append
    )
    assert result.files == (path,) and result.step == 1  # a .safetensors path: one file
    view = jaxckpt.open_step(ckpt, 1)
    w = view["params.w"]
    row = 24 * 2
    assert w.leaf.chunk_shape[0] * row < 64 * 4  # several chunk rows fit the chunk budget
    regions = list(w.block_regions(64))
    assert len(regions) > 4 and all(
        (hi - lo) == w.leaf.chunk_shape[0] for (lo, hi), _ in regions[:-1]
    )  # one chunk row per block: memory stays at max(block_bytes, one chunk row)
    assert sum(written) == result.total_size
    loaded = _load(path)
    for name, array in _expected(ckpt, 1).items():
        assert _bits(loaded[name]) == _bits(array), name


def test_export_errors_name_the_leaf(capsys, tmp_path):
    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"z": np.ones(2, np.complex128), "ok": np.ones(2)})
        mgr.save(2, {"a.b": np.ones(1), "a": {"b": np.zeros(1)}})
    rc, _, err = _run(capsys, "export", f"{root}:1", str(tmp_path / "o1"))
    assert rc == 1 and "step 1: z has dtype complex128, which safetensors cannot store" in err
    rc, _, err = _run(capsys, "export", f"{root}:1", str(tmp_path / "o2"), "--leaf", "nope*")
    assert rc == 1 and "no array leaf matches 'nope*'" in err
    rc, _, err = _run(capsys, "export", f"{root}:2", str(tmp_path / "o3"))
    assert rc == 1 and "two leaves have the tensor name 'a.b'" in err
    assert not (tmp_path / "o1").exists() or not os.listdir(tmp_path / "o1")
    rc, _, err = _run(capsys, "export", f"{root}:9", str(tmp_path / "o4"))
    assert rc == 1 and "step 9 not found" in err and err.count("\n") == 1


# ------------------------------------------------------------------------------ import


def test_import_an_export_round_trips_the_tree(capsys, ckpt, tmp_path):
    out = tmp_path / "exp"
    assert _run(capsys, "export", ckpt, str(out), "--max-shard-size", "2KB")[0] == 0
    dst = str(tmp_path / "dst")
    rc, text, err = _run(capsys, "import", str(out), f"{dst}:7")
    assert rc == 0, err
    assert f"{dst}: committed step 7 with 11 arrays" in text
    restored = jaxckpt.CheckpointManager(dst, read_only=True).restore(7)
    expected = _expected(ckpt, 2)
    assert _bits(restored["params"]["w"]) == _bits(expected["params.w"])
    assert _bits(restored["layers"]["1"]["k"]) == _bits(expected["layers.1.k"])  # lists: "0", "1"
    assert _bits(restored["empty"]) == _bits(expected["empty"])
    assert jaxckpt.CheckpointManager(dst, read_only=True).metadata(7).user_metadata == {
        "imported_from": f"safetensors:{out}"
    }
    assert _run(capsys, "diff", f"{ckpt}:2", f"{dst}:7", "--values", "--json")[0] == 1
    rc, _, err = _run(capsys, "import", str(out), f"{dst}:7")
    assert rc == 1 and "step 7 already exists" in err


def test_import_files_written_by_the_safetensors_package(tmp_path):
    f32 = np.arange(12, dtype=np.float32).reshape(3, 4)
    safetensors.numpy.save_file(
        {"model.layers.0.weight": f32, "model.norm": np.ones(4, np.int32)},
        str(tmp_path / "a.safetensors"),
    )
    bf16 = jnp.linspace(-2, 2, 10, dtype=jnp.bfloat16)
    safetensors.flax.save_file({"lm_head": bf16}, str(tmp_path / "b.safetensors"))
    root = str(tmp_path / "root")
    first = jaxckpt.import_safetensors(tmp_path / "a.safetensors", root)
    second = jaxckpt.import_safetensors(tmp_path / "b.safetensors", root)
    assert (first.step, second.step) == (0, 1) and first.nbytes == 48 + 16
    view = jaxckpt.open_step(root, 0)
    assert sorted(view.paths()) == ["model.layers.0.weight", "model.norm"]
    np.testing.assert_array_equal(view["model.layers.0.weight"][1:, 2], f32[1:, 2])
    assert _bits(jaxckpt.open_step(root, 1)["lm_head"].read()) == _bits(bf16)


def test_import_rejects_a_damaged_file(tmp_path):
    path = tmp_path / "x.safetensors"
    safetensors.numpy.save_file({"w": np.ones((64,), np.float32)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-8])  # truncated download
    with pytest.raises(SafetensorsFormatError, match=r"x.safetensors: tensor 'w': data_offsets"):
        list(read_safetensors(path))
    path.write_bytes(struct.pack("<Q", 10**9) + data[8:])
    with pytest.raises(SafetensorsFormatError, match="header length 1000000000 is invalid"):
        list(read_safetensors(path))
    with pytest.raises(jaxckpt.CheckpointError, match="does not exist"):
        jaxckpt.import_safetensors(tmp_path / "nope.safetensors", str(tmp_path / "root"))


def test_import_an_orbax_checkpoint(capsys, tmp_path):
    import orbax.checkpoint as ocp

    state = {
        "params": {"w": jnp.arange(24, dtype=jnp.bfloat16).reshape(4, 6), "b": jnp.ones(6)},
        "opt": [np.full(3, 2.5, np.float32), np.arange(2, dtype=np.int32)],
        "step": 300,
    }
    orbax_dir = str(tmp_path / "orbax")
    with ocp.CheckpointManager(orbax_dir) as mgr:
        mgr.save(300, args=ocp.args.StandardSave(state))
        mgr.wait_until_finished()
    root = str(tmp_path / "root")
    rc, out, err = _run(capsys, "import", orbax_dir, root)
    assert rc == 0, err
    assert f"{root}: committed step 300 with 4 arrays" in out and "from orbax" in out
    restored = jaxckpt.CheckpointManager(root, read_only=True).restore(300)
    assert _bits(restored["params"]["w"]) == _bits(state["params"]["w"])
    assert _bits(restored["params"]["b"]) == _bits(state["params"]["b"])
    assert _bits(restored["opt"][1]) == _bits(state["opt"][1])
    assert restored["step"] == 300 and type(restored["step"]) is int
    rc, _, err = _run(capsys, "import", os.path.join(orbax_dir, "300"), root)
    assert rc == 1 and "step 300 already exists" in err
    rc, _, err = _run(capsys, "import", str(tmp_path), str(tmp_path / "r2"), "--from", "orbax")
    assert rc == 1 and "is not an Orbax checkpoint" in err


# ----------------------------------------------------------------------------- zarr


@pytest.mark.usefixtures("plain_by_default")
def test_zarr_python_opens_the_step_and_every_leaf(ckpt):
    import zarr

    zarr_compat.register_dtypes()
    assert zarr_compat.register_dtypes() == ()  # idempotent
    step = zarr.open_group(step_dir(ckpt, 2), mode="r")  # the committed attempt's prefix
    arrays = step["arrays"]
    assert isinstance(arrays, zarr.Group)
    expected = {
        leaf.name: jaxckpt.open_step(ckpt, 2)[dotted_path(leaf)].read()
        for leaf in jaxckpt.open_step(ckpt, 2).leaves
        if leaf.kind != "value"
    }
    members = dict(arrays.arrays())
    assert set(members) == set(expected)
    for name, array in members.items():
        assert _bits(array[...]) == _bits(expected[name]), name
    assert members["params.w"].dtype == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_zarr_compat_on_object_stores(object_root, layout):
    w = jnp.arange(300, dtype=jnp.bfloat16).reshape(20, 15)
    with jaxckpt.CheckpointManager(object_root, chunk_bytes=128, layout=layout) as mgr:
        mgr.save(4, {"params": {"w": w}, "f8": jnp.ones(3, jnp.float8_e5m2)})
    group = zarr_compat.open_group(object_root)
    assert _bits(group["params.w"][...]) == _bits(w)
    assert _bits(group["params.w"][3:5, ::2]) == _bits(np.asarray(w)[3:5, ::2])
    assert group["f8"].dtype == np.dtype(ml_dtypes.float8_e5m2)
    with pytest.raises(jaxckpt.StepNotFoundError, match="step 5 not found"):
        zarr_compat.open_group(object_root, 5)


def test_open_step_reads_slices_on_every_backend(storage_root):
    w = np.arange(30 * 8, dtype=np.float32).reshape(30, 8)
    with jaxckpt.CheckpointManager(storage_root, chunk_bytes=128) as mgr:
        mgr.save(3, {"params": {"w": w}, "k": jax.random.key(1), "lr": 0.5})
    view = jaxckpt.open_step(storage_root)
    assert (view.step, view.paths()) == (3, ["k", "lr", "params.w"])
    leaf = view["params.w"]
    assert leaf is not None and view["lr"] == 0.5 and view["['params']['w']"].shape == (30, 8)
    np.testing.assert_array_equal(leaf[7:19, 2::3], w[7:19, 2::3])
    np.testing.assert_array_equal(leaf[-1], w[-1])
    np.testing.assert_array_equal(leaf[..., 5], w[..., 5])
    np.testing.assert_array_equal(leaf[::-4, 0], w[::-4, 0])
    np.testing.assert_array_equal(np.asarray(leaf), w)
    with pytest.raises(IndexError, match=r"params.w: index 30 is out of bounds for axis 0"):
        leaf[30]
    with pytest.raises(KeyError, match=r"has no leaf 'params.v'; leaves: k, lr, params.w"):
        view["params.v"]
    with pytest.raises(jaxckpt.StepNotFoundError, match="committed steps: 3"):
        jaxckpt.open_step(storage_root, 4)


@pytest.mark.usefixtures("plain_by_default")
def test_open_step_names_a_damaged_chunk(tmp_path):
    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root, chunk_bytes=64) as mgr:
        mgr.save(1, {"w": np.arange(64, dtype=np.float32)})
    chunk = Path(step_dir(root, 1, "arrays", "w", "c", "2"))
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    leaf = jaxckpt.open_step(root)["w"]
    np.testing.assert_array_equal(leaf[:16], np.arange(16))  # untouched chunks read fine
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"step 1: \['w'\]: chunk c/2"):
        leaf[30:40]
