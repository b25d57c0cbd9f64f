"""The command line on a live root (steps deleted by another process while a command
runs) and the validation of its numeric arguments."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from rootpaths import step_dir

import jaxckpt
from jaxckpt import cli

STEPS = (1, 2, 3, 4, 5, 6)


@pytest.fixture
def root(tmp_path: Path) -> str:
    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root, layout="plain", chunk_bytes=1024) as mgr:
        for step in STEPS:
            mgr.save(step, {"w": np.full(64 * 256, step, np.float32), "step": step})
    return root


def _jaxckpt(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``jaxckpt ARGV`` in a process of its own: another operator on the same root."""
    return subprocess.Popen(
        [sys.executable, "-m", "jaxckpt", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def test_verify_all_skips_steps_deleted_meanwhile(capsys, root, monkeypatch):
    import jaxckpt.tools as verify_module  # the face: what the CLI calls

    verify_step = verify_module.verify_step
    raced: list[int] = []

    def racing(protocol, context, step, *, on_progress):
        if step == 1:  # listed; now a second process prunes all but the newest
            rc, _, err = _finish(_jaxckpt("prune", root, "--keep-last=2"))
            assert rc == 0, err
        if step == 5:  # deleted halfway through its chunk reads
            first = [True]

            def progress(nbytes: int) -> None:
                if first[0]:
                    first[0] = False
                    rc, _, err = _finish(_jaxckpt("prune", root, "--keep-last=1"))
                    assert rc == 0, err
                on_progress(nbytes)

            raced.append(step)
            return verify_step(protocol, context, step, on_progress=progress)
        return verify_step(protocol, context, step, on_progress=on_progress)

    monkeypatch.setattr(verify_module, "verify_step", racing)
    rc = cli.main(["verify", root, "--all", "--no-progress"])
    out, err = capsys.readouterr()
    assert raced == [5] and rc == 0, err
    lines = out.splitlines()
    assert lines[:5] == [f"step {s}: deleted meanwhile, skipped" for s in (1, 2, 3, 4, 5)]
    assert lines[5].startswith("step 6: OK (")
    assert lines[6] == "all 1 verified steps are intact; 5 deleted meanwhile"
    assert err == ""
    # What remains is still checked: damage in the newest step fails the run.
    chunk = Path(step_dir(root, 6, "arrays", "w", "c", "0"))
    chunk.write_bytes(bytes([chunk.read_bytes()[0] ^ 1]) + chunk.read_bytes()[1:])
    rc = cli.main(["verify", root, "--all", "--no-progress"])
    assert rc == 1 and "1 of 1 steps failed verification: [6]" in capsys.readouterr().err


def test_prune_racing_another_prune_exits_zero(capsys, root, tmp_path):
    resume = tmp_path / "resume"
    resume.mkdir()
    for step in STEPS[1:]:  # pause at step 1 only
        (resume / f"delete_retracted-{step}.resume").touch()
    first = _jaxckpt(
        "prune",
        root,
        "--keep-last=1",
        env={
            "JAXCKPT_PAUSE_AT": "delete_retracted",
            "JAXCKPT_RESUME_DIR": str(resume),
            "JAXCKPT_PAUSE_S": "120",
        },
    )
    deadline = time.monotonic() + 120
    while not (resume / "delete_retracted-1.reached").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.02)
    # The first prune listed steps 1-6 and is deleting step 1; a second one deletes 2-5.
    assert cli.main(["prune", root, "--keep-last=1"]) == 0
    assert "deleted 4 steps" in capsys.readouterr().out
    (resume / "delete_retracted-1.resume").touch()
    rc, out, err = _finish(first)
    assert rc == 0, err
    for step in (2, 3, 4, 5):
        assert f"step {step}: deleted meanwhile (by another process), skipped" in out
    assert (
        "deleted 1 step, reclaiming " in out and "(4 deleted meanwhile by another process)" in out
    )
    assert jaxckpt.CheckpointManager(root, read_only=True).steps() == [6]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gc", "{root}", "--grace", "-5"], "argument --grace: must be a number of seconds >= 0"),
        (["gc", "{root}", "--grace", "nan"], "argument --grace: must be a number of seconds >= 0"),
        (["prune", "{root}", "--keep-last", "0"], "argument --keep-last: must be an integer >= 1"),
        (["prune", "{root}", "--keep-every", "-1"], "argument --keep-every: must be an integer"),
        (["prune", "{root}", "--keep-milestones", "1,x"], "must be integers >= 1 separated"),
        (["prune", "{root}", "--keep-milestones", "0"], "must be integers >= 1 separated"),
        (["ls", "{root}", "--keep-last", "0"], "argument --keep-last: must be an integer >= 1"),
        (["ls", "{root}", "--limit", "-1"], "argument --limit: must be an integer >= 0"),
        (["cp", "{root}", "{root}2", "--level", "99"], "argument --level: must be an integer"),
        (["verify", "{root}", "-3"], "argument step: must be an integer >= 0"),
        (["inspect", "{root}", "x"], "argument step: must be an integer >= 0"),
    ],
)
def test_numbers_are_checked_with_one_line_errors(capsys, tmp_path, argv, message):
    argv = [a.format(root=str(tmp_path / "r")) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "error:" in x]  # argparse: usage + one error
    assert message in line and err.splitlines()[-1] == line and err.startswith("usage: ")
