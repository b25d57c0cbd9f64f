"""Restoring into a changed model: partial restores, renamed paths, and who wrote a step."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from trees import assert_tree_bitexact

import jaxckpt
from jaxckpt import cli
from jaxckpt.commit import CommitProtocol
from jaxckpt.restoring import load_step
from jaxckpt.storage import LocalStorage, open_storage


def _state() -> dict:
    rng = np.random.default_rng(0)
    return {
        "params": {
            "encoder": {"kernel": jnp.asarray(rng.standard_normal((8, 4), dtype=np.float32))},
            "decoder": {"kernel": jnp.asarray(rng.standard_normal((4, 8)), dtype=jnp.bfloat16)},
        },
        "opt": {"mu": jnp.ones((64, 64)), "nu": np.arange(10, dtype=np.int64)},
        "step": 3,
    }


@pytest.fixture
def root(tmp_path: Path) -> str:
    root = str(tmp_path / "ckpt")
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(3, _state())
    return root


def _damage_all_but(root: str, step: int, keep: tuple[str, ...]) -> list[str]:
    """Deletes every array of ``step`` whose tree path is not under one of ``keep``."""
    protocol = CommitProtocol(open_storage(root))
    marker = protocol.require_marker(step)
    loaded = load_step(protocol, marker)
    damaged = []
    for leaf in loaded.leaves:
        if leaf.name is not None and not leaf.path_text.startswith(keep):
            protocol.storage.delete_prefix(marker.location.array_prefix(leaf.name))
            damaged.append(leaf.path_text)
    return damaged


@pytest.mark.usefixtures("plain_by_default")
def test_partial_restore_reads_only_the_target_paths(root, monkeypatch):
    damaged = _damage_all_but(root, 3, ("['params']['decoder']",))
    assert len(damaged) == 3  # encoder kernel, opt mu, opt nu
    reads: list[str] = []
    read_buffer = LocalStorage.read_buffer

    def recording(self, key, size=None):
        reads.append(key)
        return read_buffer(self, key, size)

    monkeypatch.setattr(LocalStorage, "read_buffer", recording)
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    subset = {"params": {"decoder": _state()["params"]["decoder"]}}
    restored = mgr.restore(3, target=subset, partial=True)
    assert_tree_bitexact(restored, subset)
    arrays = CommitProtocol(open_storage(root)).require_marker(3).location.arrays_prefix
    assert reads and all(k.startswith(arrays + "params.decoder.") for k in reads)
    # The damage is real: a full restore finds it and names the path.
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="missing") as info:
        mgr.restore(3, target=_state())
    assert any(path in str(info.value) for path in damaged)


def test_partial_restore_of_the_newest_step_does_not_fall_back(root, caplog):
    _damage_all_but(root, 3, ("['params']",))
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    restored = mgr.restore(target={"params": _state()["params"], "step": 0}, partial=True)
    assert restored["step"] == 3
    assert "falling back" not in caplog.text


def test_a_subset_target_without_partial_names_every_path_it_lacks(root):
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    with pytest.raises(jaxckpt.TreeMismatchError) as info:
        mgr.restore(3, target={"params": _state()["params"]})
    text = str(info.value)
    for path in ("['opt']['mu']", "['opt']['nu']", "['step']"):
        assert f"not in target: {path}" in text
    assert "partial=True" in text


def test_partial_still_requires_every_target_path_to_be_saved(root):
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    target = {"params": {"head": {"kernel": jnp.zeros((2, 2))}}}
    with pytest.raises(jaxckpt.TreeMismatchError, match=r"not in checkpoint: \['params'\]\['head'"):
        mgr.restore(3, target=target, partial=True)


def _renamed_params() -> dict:
    params = _state()["params"]
    return {"enc": params["encoder"], "dec": params["decoder"]}


def test_rename_maps_saved_module_paths_to_new_ones(root):
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    rename = {
        "['params']['encoder']": "['model']['enc']",
        "['params']['decoder']": "['model']['dec']",
    }
    target = {"model": _renamed_params(), "opt": _state()["opt"], "step": 0}
    restored = mgr.restore(3, target=target, rename=rename)
    assert_tree_bitexact(restored, {**target, "step": 3})
    # Without the mapping every renamed path is named, on both sides.
    with pytest.raises(jaxckpt.TreeMismatchError) as info:
        mgr.restore(3, target=target)
    text = str(info.value)
    assert "not in checkpoint: ['model']['enc']['kernel']" in text
    assert "not in target: ['params']['encoder']['kernel']" in text


def test_rename_function_with_partial_and_collisions(root):
    mgr = jaxckpt.CheckpointManager(root, read_only=True)

    def only_params(path: str) -> str | None:
        return path.replace("['params']", "") if path.startswith("['params']") else None

    restored = mgr.restore(3, target=_state()["params"], rename=only_params)
    assert_tree_bitexact(restored, _state()["params"])
    # A shape mismatch after renaming names both paths.
    bad = {"enc": {"kernel": jnp.zeros((4, 8))}}
    with pytest.raises(jaxckpt.TreeMismatchError, match=r"saved as \['params'\]\['encoder'\]"):
        mgr.restore(3, target=bad, rename={"['params']['encoder']": "['enc']"}, partial=True)
    # Two saved leaves renamed onto one target path is an error, not a silent pick.
    both = {"['params']['encoder']": "['x']", "['params']['decoder']": "['x']"}
    with pytest.raises(jaxckpt.TreeMismatchError, match=r"two saved paths map to \['x'\]"):
        mgr.restore(3, target={"x": {"kernel": jnp.zeros((8, 4))}}, rename=both, partial=True)


def test_partial_or_rename_without_a_target_is_refused(root):
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    with pytest.raises(ValueError, match="needs a target"):
        mgr.restore(3, partial=True)
    with pytest.raises(ValueError, match="needs a target"):
        mgr.restore(rename={"a": "b"})


def test_tree_record_carries_the_writer_versions_and_inspect_shows_them(root, capsys):
    expected = {
        name: importlib.metadata.version(name)
        for name in ("jaxckpt", "jax", "orbax-checkpoint", "tensorstore", "numpy")
    }
    versions = jaxckpt.CheckpointManager(root, read_only=True).metadata(3).versions
    assert expected.items() <= versions.items()
    assert cli.main(["inspect", root]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("written by:"))
    for name, version in expected.items():
        assert f"{name} {version}" in line
    assert cli.main(["inspect", root, "--json"]) == 0
    assert expected.items() <= json.loads(capsys.readouterr().out)["versions"].items()


def test_inspect_says_when_versions_were_not_recorded(capsys):
    v1 = Path(__file__).parent / "fixtures" / "v1" / "root"
    assert cli.main(["inspect", str(v1), "1"]) == 0
    assert "written by: not recorded" in capsys.readouterr().out
