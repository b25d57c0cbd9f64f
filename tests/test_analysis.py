"""Analysis: diff between steps (from manifests, and with --values), stats across steps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from rootpaths import packed_chunk, step_dir

import jaxckpt
from jaxckpt import cli


def _state(step: int) -> dict:
    return {
        "params": {
            "w": jnp.asarray(np.linspace(-1, 1, 32 * 16).reshape(32, 16) * step, jnp.bfloat16),
            "b": np.full(16, 0.5, np.float32),  # never changes
        },
        "count": np.arange(6, dtype=np.int32) + (step >= 20),
        "step": step,
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("analysis") / "root")
    with jaxckpt.CheckpointManager(root, chunk_bytes=256, layout="plain") as mgr:
        for step in (1, 2, 5, 10, 20, 50, 100, 200):
            mgr.save(step, _state(step))
    return root


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _diff_json(capsys, *argv: str) -> tuple[int, dict]:
    rc, out, err = _run(capsys, "diff", *argv, "--json")
    assert rc in (0, 1), err
    return rc, json.loads(out)


# -------------------------------------------------------------------------------- diff


def test_diff_of_a_step_with_itself_is_identical(capsys, root):
    rc, report = _diff_json(capsys, f"{root}:5", f"{root}:5")
    assert rc == 0 and report["identical"] is True
    assert {d["status"] for d in report["leaves"]} == {"identical"}
    rc, out, _ = _run(capsys, "diff", f"{root}:5", f"{root}:5")
    assert rc == 0 and out.splitlines() == [f"{root}:5 vs {root}:5: 4 leaves, 4 identical"]


def test_diff_names_changed_leaves_from_the_manifests(capsys, root):
    rc, report = _diff_json(capsys, f"{root}:10", f"{root}:20")
    status = {d["path"]: d["status"] for d in report["leaves"]}
    assert rc == 1 and report["identical"] is False
    assert status == {
        "count": "changed",
        "params.b": "identical",
        "params.w": "changed",
        "step": "changed",
    }
    w = next(d for d in report["leaves"] if d["path"] == "params.w")
    assert w["detail"] == "4 of 4 chunks differ" and w["max_abs_diff"] is None
    rc, out, _ = _run(capsys, "diff", f"{root}:10", f"{root}:20")
    assert rc == 1 and "4 leaves, 1 identical, 3 changed" in out.splitlines()[0]
    assert "params.b" not in out  # identical leaves only with --all
    assert "params.b" in _run(capsys, "diff", f"{root}:10", f"{root}:20", "--all")[1]


def test_diff_values_reports_the_largest_absolute_difference(capsys, root):
    rc, report = _diff_json(capsys, f"{root}:10", f"{root}:20", "--values")
    by = {d["path"]: d for d in report["leaves"]}
    a = np.asarray(_state(10)["params"]["w"], np.float64)
    b = np.asarray(_state(20)["params"]["w"], np.float64)
    assert rc == 1 and by["params.w"]["max_abs_diff"] == np.abs(a - b).max()
    assert by["count"]["max_abs_diff"] == 1.0 and by["params.b"]["max_abs_diff"] == 0.0
    rc, out, _ = _run(capsys, "diff", f"{root}:10", f"{root}:20", "--values")
    assert "MAX |A-B|" in out.splitlines()[1]


def test_diff_added_removed_and_other_roots(capsys, root, tmp_path):
    other = str(tmp_path / "other")
    state = _state(20)
    del state["count"]
    state["extra"] = np.zeros(3)
    with jaxckpt.CheckpointManager(other, chunk_bytes=256) as mgr:
        mgr.save(20, state)
    rc, report = _diff_json(capsys, f"{root}:20", other)  # ROOT alone: its newest step
    status = {d["path"]: d["status"] for d in report["leaves"]}
    assert rc == 1 and report["b"] == {"root": other, "step": 20}
    assert status == {
        "count": "removed",
        "params.b": "identical",
        "params.w": "identical",
        "step": "identical",
        "extra": "added",
    }


def _flip_one_byte(root: str, step: int) -> None:
    """Flips one data byte of ``step``'s ``params.w`` (plain or packed layout)."""
    if Path(step_dir(root, step, "arrays", "params.w", "c", "0", "0")).exists():
        path, offset = Path(step_dir(root, step, "arrays", "params.w", "c", "0", "0")), 0
    else:
        uri, offset, _ = packed_chunk(root, step, "params.w", 0, 0)
        path = Path(uri)
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_diff_reports_a_step_with_a_flipped_byte_as_damaged(capsys, tmp_path, layout):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    for root in (one, two):
        with jaxckpt.CheckpointManager(root, chunk_bytes=256, layout=layout) as mgr:
            mgr.save(50, _state(50))
    assert _diff_json(capsys, f"{one}:50", f"{two}:50")[0] == 0
    _flip_one_byte(two, 50)
    for extra in ((), ("--values",)):
        rc, report = _diff_json(capsys, f"{one}:50", f"{two}:50", *extra)
        by = {d["path"]: d for d in report["leaves"]}
        assert rc == 1 and report["identical"] is False and report["damaged"] == ["params.w"]
        assert (
            by["params.w"]["status"] == "damaged"
            and "step 50: chunk c/0/0" in (by["params.w"]["detail"])
        )
        assert by["params.b"]["status"] == "identical"
    rc, out, err = _run(capsys, "diff", f"{two}:50", f"{one}:50")
    assert rc == 1 and "1 damaged" in out.splitlines()[0]
    assert err.startswith("jaxckpt: error: params.w: damaged: step 50: chunk c/0/0 of ")
    # --records-only compares the manifests alone: it cannot see the damage, as it says
    rc, report = _diff_json(capsys, f"{one}:50", f"{two}:50", "--records-only")
    assert rc == 0 and report["identical"] is True


def test_diff_checks_leaves_only_one_step_has(tmp_path):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    with jaxckpt.CheckpointManager(one, chunk_bytes=256, layout="plain") as mgr:
        mgr.save(50, _state(50))
    with jaxckpt.CheckpointManager(two, chunk_bytes=256, layout="plain") as mgr:
        mgr.save(50, {k: v for k, v in _state(50).items() if k != "params"})
    _flip_one_byte(one, 50)
    result = jaxckpt.diff_steps(jaxckpt.open_step(one), jaxckpt.open_step(two))
    status = {d.path: d.status for d in result.leaves}
    assert status == {
        "params.w": "damaged",
        "params.b": "removed",
        "count": "identical",
        "step": "identical",
    }
    assert result.counts()["damaged"] == 1 and [d.path for d in result.damaged] == ["params.w"]


@pytest.mark.usefixtures("plain_by_default")
def test_diff_unknown_when_layouts_differ_settled_by_values(capsys, root, tmp_path):
    other = str(tmp_path / "rechunked")
    with jaxckpt.CheckpointManager(other) as mgr:  # default chunk_bytes: one chunk per leaf
        mgr.save(5, _state(5))
    zst = str(tmp_path / "zst")
    assert _run(capsys, "cp", f"{root}:5", zst, "--compress", "zstd")[0] == 0
    for b, detail in ((other, "chunk shapes differ"), (zst, "compressed chunks")):
        rc, report = _diff_json(capsys, f"{root}:5", b)
        w = next(d for d in report["leaves"] if d["path"] == "params.w")
        assert rc == 1 and w["status"] == "unknown" and detail in w["detail"]
        rc, report = _diff_json(capsys, f"{root}:5", b, "--values")
        assert rc == 0 and report["identical"] is True
    rc, out, _ = _run(capsys, "diff", f"{root}:5", other)
    assert "--values compares the data" in out


def test_diff_steps_api(root):
    a, b = jaxckpt.open_step(root, 1), jaxckpt.open_step(root, 2)
    result = jaxckpt.diff_steps(a, b)
    assert not result.identical and result.counts()["changed"] == 2
    assert jaxckpt.diff_steps(a, jaxckpt.open_step(root, 1)).identical


# ------------------------------------------------------------------------------- stats


def _numpy_stats(x: np.ndarray) -> dict[str, float]:
    x = np.asarray(x, np.float64).reshape(-1)
    return {
        "norm": float(np.sqrt((x * x).sum())),
        "mean": float(x.mean()),
        "std": float(x.std()),
        "max_abs": float(np.abs(x).max()),
    }


def test_stats_match_numpy_for_every_step(capsys, root):
    rc, out, err = _run(capsys, "stats", root, "--leaf", "params.*", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert [s["step"] for s in report["steps"]] == [1, 2, 5, 10, 20, 50, 100, 200]
    for s in report["steps"]:
        state = _state(s["step"])
        by = {x["path"]: x for x in s["leaves"]}
        assert set(by) == {"params.b", "params.w"}
        for path, array in (("params.w", state["params"]["w"]), ("params.b", state["params"]["b"])):
            for key, value in _numpy_stats(array).items():
                assert by[path][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (path, key)
        both = np.concatenate(
            [
                np.asarray(state["params"]["b"], np.float64),
                np.asarray(state["params"]["w"], np.float64).ravel(),
            ]
        )
        for key, value in _numpy_stats(both).items():
            assert s["combined"][key] == pytest.approx(value, rel=1e-9, abs=1e-12)
        assert s["combined"]["count"] == 16 + 32 * 16


def test_stats_table_and_plot(capsys, root, tmp_path):
    png = tmp_path / "trajectory.png"
    rc, out, err = _run(
        capsys, "stats", root, "--leaf", "params.w", "--steps", "1,10,200", "--plot", str(png)
    )
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "LEAF", "NORM", "MEAN", "STD", "MAX", "|X|"]
    assert [line.split()[0] for line in lines[1:4]] == ["1", "10", "200"]
    max_abs = float(lines[3].split()[-1])
    assert max_abs == pytest.approx(200.0, rel=1e-3)  # linspace(-1, 1) * 200 in bfloat16
    assert lines[-1] == f"plot written to {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rc, _, err = _run(capsys, "stats", root, "--leaf", "nope")
    assert rc == 1 and "no array leaf matches ['nope']" in err
    rc, _, err = _run(capsys, "stats", root, "--steps", "3")
    assert rc == 1 and "step 3 not found" in err


def test_trajectory_api_handles_zero_size_and_integer_leaves(tmp_path):
    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"e": np.zeros((0, 2), np.float32), "i": np.array([-3, 4], np.int8)})
    from jaxckpt.tools import trajectory

    (only,) = trajectory(root)
    e, i = only.leaves
    assert e.count == 0 and math.isnan(e.mean) and e.norm == 0.0
    assert (i.norm, i.mean, i.std, i.max_abs) == (5.0, 0.5, 3.5, 4.0)
