"""Importing an untrusted or mistyped Orbax source: nothing half-made, nothing out of reach.

A relative source path works; a failed import leaves the destination as it was
(a root it created is gone, so "import unless the root exists" retries); the
source is checked before the destination is touched: arrays whose claimed shape
exceeds the bound, links out of the source, records nested too deeply and step
numbers past 2**63 - 1 are one-line errors; an open manager of this process is
never fenced by an import into its root; an abstract target made under
``jax.set_mesh`` imports as it restores.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxckpt
from jaxckpt import cli
from jaxckpt.workflows import ImportSourceError, import_orbax


def _orbax(path, steps=(10,), *, ocdbt=True, tree=None) -> str:
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt)
    with ocp.CheckpointManager(os.path.abspath(path), item_handlers=handler) as mgr:
        for step in steps:
            state = tree or {"w": np.arange(8.0, dtype=np.float32) + step, "step": np.int32(step)}
            mgr.save(step, args=ocp.args.PyTreeSave(state))
    return str(path)


def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out + err


def test_a_relative_source_imports_with_and_without_a_target(tmp_path, monkeypatch, capsys):
    _orbax(tmp_path / "runs" / "orb")
    monkeypatch.chdir(tmp_path)
    rc, text = _cli(capsys, "import", "runs/orb", "runs/cli")
    assert rc == 0, text
    target = {"w": jax.ShapeDtypeStruct((8,), np.float32), "step": 0}
    [result] = import_orbax("runs/orb", "runs/api", target=target)
    assert result.step == 10
    for root in ("runs/cli", "runs/api"):
        np.testing.assert_array_equal(
            jaxckpt.CheckpointManager(root).restore(10)["w"], np.arange(8.0) + 10
        )


def test_a_failed_import_leaves_no_root_and_the_retry_works(tmp_path, monkeypatch):
    src = _orbax(tmp_path / "orb", steps=(1, 2))
    dst = str(tmp_path / "dst")
    bad = {"w": jax.ShapeDtypeStruct((3,), np.float32), "step": 0}  # another shape
    with pytest.raises(jaxckpt.TreeMismatchError, match=r"\['w'\]: saved \(8,\), target \(3,\)"):
        import_orbax(src, dst, target=bad)
    assert not os.path.exists(dst)  # refused before anything was written

    # A failure while reading the second step (after the first committed) removes the root.
    from jaxckpt.workflows import _orbax_import

    real = _orbax_import._restore_tree
    calls = []

    def fail_second(item, target):
        calls.append(item.path)
        if len(calls) == 2:
            raise ImportSourceError(f"cannot read Orbax checkpoint {item.path}: injected")
        return real(item, target)

    monkeypatch.setattr(_orbax_import, "_restore_tree", fail_second)
    with pytest.raises(ImportSourceError, match="injected"):
        import_orbax(src, dst)
    assert not os.path.exists(dst)
    monkeypatch.setattr(_orbax_import, "_restore_tree", real)

    # Into an existing root, a failure removes exactly the steps the import committed.
    with jaxckpt.CheckpointManager(dst) as mgr:
        mgr.save(0, {"w": np.zeros(8, np.float32)})
    calls.clear()
    monkeypatch.setattr(_orbax_import, "_restore_tree", fail_second)
    with pytest.raises(ImportSourceError, match="injected"):
        import_orbax(src, dst)
    monkeypatch.setattr(_orbax_import, "_restore_tree", real)
    with jaxckpt.CheckpointManager(dst, read_only=True) as mgr:
        assert mgr.steps() == [0]
    assert [r.step for r in import_orbax(src, dst)] == [1, 2]


def test_a_failed_import_into_a_plain_directory_removes_only_what_it_added(tmp_path, monkeypatch):
    src = _orbax(tmp_path / "orb")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    from jaxckpt.workflows import _import

    def fail(*args, **kwargs):
        raise jaxckpt.SaveFailedError("injected save failure")

    monkeypatch.setattr(_import, "_commit", fail)
    with pytest.raises(jaxckpt.SaveFailedError):
        import_orbax(src, dst)
    assert sorted(os.listdir(dst)) == ["notes.txt"]


def test_a_huge_claimed_shape_is_refused_before_anything_is_read_or_written(tmp_path, capsys):
    src = _orbax(tmp_path / "orb", ocdbt=False)
    [zarray] = glob.glob(f"{src}/**/w/.zarray", recursive=True)
    meta = json.loads(Path(zarray).read_text())
    meta["shape"] = [1 << 40]  # 4 TiB of float32 claimed, 32 bytes on disk
    Path(zarray).write_text(json.dumps(meta))
    dst = str(tmp_path / "dst")
    # A child under an address-space limit: before the check, TensorStore's allocation
    # of the claimed shape killed the process with std::bad_alloc.
    code = (
        "import sys; from jaxckpt import cli; sys.exit(cli.main(['import', sys.argv[1], "
        "sys.argv[2]]))"
    )
    run = subprocess.run(
        ["prlimit", f"--as={6 << 30}", "--", sys.executable, "-c", code, src, dst],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 1, run.stderr[-2000:]
    [line] = [x for x in run.stderr.splitlines() if x.startswith("jaxckpt: error")]
    assert "claims shape (1099511627776,) float32 (4.0 TiB)" in line
    assert "--max-bytes" in line
    assert not os.path.exists(dst)
    # A plausible but too large claim is refused against an explicit bound as well.
    with pytest.raises(ImportSourceError, match=r"more than the 16 B an import may hold"):
        import_orbax(_orbax(tmp_path / "small"), dst, max_bytes=16)
    assert not os.path.exists(dst)


def test_a_link_out_of_the_source_is_refused_not_followed(tmp_path):
    other = _orbax(tmp_path / "other", steps=(5,))
    src = _orbax(tmp_path / "orb", steps=(1,))
    item = os.path.join(src, "1", "default")
    os.rename(item, item + ".orig")
    os.symlink(os.path.join(other, "5", "default"), item)
    dst = str(tmp_path / "dst")
    with pytest.raises(ImportSourceError, match=r"symbolic link to .*other/5/default, outside"):
        import_orbax(src, dst)
    assert not os.path.exists(dst)
    # A link that stays inside the source is read as usual.
    os.unlink(item)
    os.rename(item + ".orig", os.path.join(src, "1", "real"))
    os.symlink(os.path.join(src, "1", "real"), item)
    assert [r.step for r in import_orbax(src, dst)] == [1]


def test_deep_records_and_huge_step_numbers_are_one_line_errors(tmp_path, capsys):
    src = _orbax(tmp_path / "orb", steps=(1,))
    record = os.path.join(src, "1", "_CHECKPOINT_METADATA")
    Path(record).write_text("[" * 100_000 + "]" * 100_000)
    rc, text = _cli(capsys, "import", src, str(tmp_path / "a"))
    assert rc == 1 and "Traceback" not in text
    assert "nested too deeply" in text and text.count("\n") == 1

    big = _orbax(tmp_path / "big", steps=(1,))
    os.rename(os.path.join(big, "1"), os.path.join(big, str(2**63)))
    rc, text = _cli(capsys, "import", big, str(tmp_path / "b"))
    assert rc == 1 and "Traceback" not in text
    assert f"step {2**63} is larger than 2**63 - 1" in text and text.count("\n") == 1
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def test_importing_into_the_root_of_an_open_manager_is_refused_or_goes_through_it(tmp_path):
    src = _orbax(tmp_path / "orb", steps=(7,))
    root = str(tmp_path / "run")
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": np.zeros(8, np.float32)})
        with pytest.raises(jaxckpt.CheckpointError, match="Import before opening the manager"):
            import_orbax(src, root)
        mgr.save(2, {"w": np.ones(8, np.float32)})  # not fenced
        assert [r.step for r in import_orbax(src, mgr)] == [7]
        mgr.save(8, {"w": np.ones(8, np.float32)})
        mgr.wait()
        assert mgr.steps() == [1, 2, 7, 8]
    assert [r.step for r in import_orbax(_orbax(tmp_path / "o2", steps=(9,)), root)] == [9]


def test_an_abstract_target_under_set_mesh_imports_as_it_restores(tmp_path):
    src = _orbax(tmp_path / "orb", steps=(3,))
    mesh = jax.make_mesh((1,), ("data",))
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(
            lambda: {"w": jax.numpy.zeros(8, np.float32), "step": jax.numpy.int32(0)}
        )
        abstract = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(
                s.shape,
                s.dtype,
                sharding=jax.sharding.NamedSharding(mesh.abstract_mesh, jax.P()),
            ),
            abstract,
        )
        [result] = import_orbax(src, tmp_path / "run", target=abstract)
        restored = jaxckpt.CheckpointManager(tmp_path / "run").restore(3, target=abstract)
    assert result.step == 3
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(8.0) + 3)
    with pytest.raises(jaxckpt.TreeMismatchError, match="no mesh is set"):
        import_orbax(src, tmp_path / "run2", target=abstract)
    assert not os.path.exists(tmp_path / "run2")
