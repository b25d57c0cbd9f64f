"""Step ids across the whole supported range (0 to 2**63 - 1), e.g. millisecond timestamps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import jaxckpt
from jaxckpt import cli
from jaxckpt.records import MAX_STEP, marker_key, parse_marker_key

WIDE = 10**12  # the first step past the 12-digit marker names


def test_marker_names_round_trip_and_sort_by_step():
    steps = [0, 7, 10**12 - 1, 10**12, 1_733_000_000_000, MAX_STEP]
    keys = [marker_key(s, 3) for s in steps]
    assert sorted(keys) == keys  # a listing's order is step order
    assert [parse_marker_key(k).step for k in keys] == steps  # type: ignore[union-attr]
    # Names of the steps format 2 always supported are unchanged.
    assert marker_key(10**12 - 1, 3) == "commits/999999999999.e3.json"
    assert marker_key(5, 1) == "commits/000000000005.e1.json"
    # ... and those of larger steps are pinned: roots written with them must stay readable.
    assert marker_key(10**12, 3) == "commits/w0000001000000000000.e3.json"
    assert parse_marker_key("commits/1000000000000.e3.json") is None  # never written


def test_large_steps_save_list_and_restore(storage_root, capsys):
    big = [1_733_000_000_000, MAX_STEP]
    with jaxckpt.CheckpointManager(storage_root) as mgr:
        mgr.save(5, {"x": np.arange(4)})
        mgr.save(WIDE - 1, {"x": np.arange(4) + 1})
        for i, step in enumerate(big):
            assert mgr.save(step, {"x": np.arange(4) + 2 + i})
    mgr = jaxckpt.CheckpointManager(storage_root, read_only=True)
    assert mgr.steps() == [5, WIDE - 1, *big]
    assert mgr.latest_step() == MAX_STEP
    np.testing.assert_array_equal(mgr.restore(big[0])["x"], np.arange(4) + 2)
    np.testing.assert_array_equal(mgr.restore()["x"], np.arange(4) + 3)
    assert cli.main(["ls", storage_root]) == 0
    out = capsys.readouterr().out
    assert str(big[0]) in out and "orphaned" not in out


@pytest.mark.parametrize("step", [MAX_STEP + 1, 2**64])
def test_a_step_past_the_bound_is_refused_before_anything_is_written(tmp_path: Path, step):
    root = tmp_path / "root"
    with jaxckpt.CheckpointManager(str(root)) as mgr:
        with pytest.raises(ValueError, match="2\\*\\*63"):
            mgr.save(step, {"x": np.arange(4)})
        assert mgr.steps() == []
    assert not list(root.glob("attempts/*")) and not list(root.glob("pending/*"))
