"""``process_state`` as a port meets it: numpy scalars, an imported step without one (the
README's loop as pasted), and what ``jaxckpt inspect`` and ``jaxckpt diff`` show of it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

import jaxckpt
from jaxckpt import cli

README = Path(__file__).resolve().parent.parent / "README.md"


def _run(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out + err


def test_numpy_scalars_are_saved_as_the_numbers_they_equal(tmp_path):
    state = {"epoch": np.int64(3), "pos": [np.int32(7), np.uint8(1)], "frac": np.float32(0.5)}
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": np.zeros(2)}, process_state=state)
    mgr = jaxckpt.CheckpointManager(tmp_path)
    mgr.restore()
    assert mgr.restored_process_state == {"epoch": 3, "pos": [7, 1], "frac": 0.5}


def _readme_grain_loop() -> str:
    text = README.read_text()
    section = text[text.index("## The data iterator") :]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL)[1]


def test_the_readme_loop_resumes_an_imported_step_without_a_data_position(tmp_path):
    src = str(tmp_path / "orbax")
    with ocp.CheckpointManager(src) as orbax:
        orbax.save(5, args=ocp.args.StandardSave({"w": np.arange(3.0)}))
    root = str(tmp_path / "run")
    jaxckpt.import_orbax(src, root)
    code = _readme_grain_loop().replace('"/tmp/run"', repr(root))
    namespace = {
        "abstract_state": None,
        "num_steps": 8,
        "train_step": lambda state, batch: state,
    }
    exec(compile(code, "README.md", "exec"), namespace)  # as pasted: before, a TypeError
    mgr = jaxckpt.CheckpointManager(root)
    assert mgr.steps() == [5, 6, 7]
    mgr.restore(7)
    assert isinstance(mgr.restored_process_state, bytes)  # the loader's position


def test_inspect_shows_and_diff_compares_process_states(tmp_path, capsys):
    root = str(tmp_path)
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": np.zeros(2)}, process_state={"pos": 7})
        mgr.save(2, {"w": np.zeros(2)}, process_state={"pos": 9})
        mgr.save(3, {"w": np.zeros(2)}, process_state={"pos": 9})
        mgr.save(4, {"w": np.zeros(2)})
    rc, text = _run(capsys, "inspect", root, "1")
    assert rc == 0
    assert re.search(
        r'process_state of process 0: json, 9 B, crc32c:[0-9a-f]{8}: \{"pos": 7\}', text
    )
    rc, text = _run(capsys, "inspect", root, "1", "--json")
    [record] = json.loads(text)["process_states"]
    assert record["kind"] == "json" and record["size"] == 9 and record["preview"] == '{"pos": 7}'
    assert re.fullmatch(r"crc32c:[0-9a-f]{8}", record["digest"])

    rc, text = _run(capsys, "diff", root, "1", "2")
    assert rc == 1 and re.search(r"changed\s+process_state\[0\]", text)
    rc, text = _run(capsys, "diff", root, "2", "3")
    assert rc == 0, text
    rc, text = _run(capsys, "diff", root, "3", "4", "--json")
    rows = {d["path"]: d for d in json.loads(text)["leaves"]}
    assert rc == 1 and rows["process_state[0]"]["status"] == "removed"
