"""The command line's consistent forms: steps as ROOT STEP or ROOT:STEP, dotted paths,
export into a directory that does not exist yet, and the README's lists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import jaxckpt
from jaxckpt import cli, policy

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("forms") / "root")
    with jaxckpt.CheckpointManager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, {"params": {"w": np.full((2, 3), step, np.float32)}, "n": step})
    return root


def _json(capsys, *argv: str) -> tuple[int, dict]:
    rc = cli.main([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_steps_as_root_step_or_root_colon_step(capsys, root):
    for argv in (["inspect", root, "1"], ["inspect", f"{root}:1"]):
        rc, info = _json(capsys, *argv)
        assert rc == 0 and info["step"] == 1
    assert _json(capsys, "diff", root, "1", "2") == _json(capsys, "diff", f"{root}:1", f"{root}:2")
    rc, report = _json(capsys, "diff", root, "1", "1")
    assert rc == 0 and report["identical"] is True
    with pytest.raises(SystemExit):
        cli.main(["diff", f"{root}:1", "1", "2"])
    assert "ROOT A B with two step numbers" in capsys.readouterr().err


def test_paths_are_dotted_in_every_command(capsys, root):
    rc, info = _json(capsys, "inspect", root)
    assert rc == 0
    assert [x["path"] for x in info["leaves"]] == ["n", "params.w"]
    assert [x["keystr"] for x in info["leaves"]] == ["['n']", "['params']['w']"]
    cli.main(["inspect", root])
    table = capsys.readouterr().out.splitlines()
    assert any(line.startswith("params.w ") for line in table)
    assert not any("['" in line for line in table)
    _, report = _json(capsys, "diff", f"{root}:1", f"{root}:2")
    assert [d["path"] for d in report["leaves"]] == ["n", "params.w"]


def test_export_creates_a_missing_directory_and_names_the_output(capsys, root, tmp_path):
    out = tmp_path / "not" / "yet"
    assert cli.main(["export", root, str(out / "model.safetensors"), "--no-progress"]) == 0
    assert cli.main(["export", root, str(tmp_path / "new" / "dir"), "--no-progress"]) == 0
    assert (out / "model.safetensors").is_file()
    assert (tmp_path / "new" / "dir" / "model.safetensors").is_file()
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    (tmp_path / "file").write_text("")
    capsys.readouterr()
    assert cli.main(["export", root, str(tmp_path / "file" / "x.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"jaxckpt: error: cannot create the output directory {tmp_path / 'file'}: File exists\n"
    )


def test_readme_lists_every_policy_and_the_current_layout():
    public = [
        name
        for name in policy.__all__
        if isinstance(getattr(policy, name), type)
        and issubclass(getattr(policy, name), policy.ComposableSave | policy.ComposableRetention)
        and not name.startswith(("Any", "Composable"))
    ]
    assert {"KeepBest", "AtSteps"} <= set(public)
    assert [name for name in public if f"`{name}(" not in README] == []
    zarr = README[README.index("### Reading with zarr-python") :]
    zarr = zarr[: zarr.index("\n## ")]
    assert "ROOT/attempts/<step>/<attempt>/" in zarr
    assert not re.search(r"`ROOT/steps/<step>/arrays/` is a zarr", zarr)


def test_errors_print_dotted_paths(capsys, tmp_path):
    from rootpaths import data_objects

    root = str(tmp_path / "damaged")
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"params": {"w": np.arange(64, dtype=np.float32)}})
    (key,) = data_objects(root, 1)
    path = Path(root, key)
    data = bytearray(path.read_bytes())
    data[3] ^= 1
    path.write_bytes(bytes(data))
    assert cli.main(["export", root, str(tmp_path / "out"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jaxckpt: error: step 1: params.w: chunk c/0 of ") and "['" not in err
