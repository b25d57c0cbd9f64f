"""The ``jaxckpt`` command line: every subcommand, JSON output, errors and exit codes."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from rootpaths import data_steps, step_dir

import jaxckpt
from jaxckpt import cli
from jaxckpt.commit import CommitProtocol, scan
from jaxckpt.records import StepLocation, json_record, new_attempt
from jaxckpt.storage import open_storage

STEPS = (1, 2, 5, 10, 20, 30)
ARTICLE = [
    "plan",
    "--params=30e9",
    "--step-seconds=2.5",
    "--write-gbps=1.2",
    "--every-steps=1000",
    "--mtbf-hours=24",
    "--gpus=64",
    "--gpu-hour-usd=4",
]


def _state(step: int) -> dict:
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    return {
        "params": {
            "w": jax.device_put(
                np.arange(64 * 32, dtype=np.float32).reshape(64, 32) * step,
                NamedSharding(mesh, P("data", None)),
            ),
            "b": np.zeros(32, dtype=np.float32),
        },
        "emb": np.full((16, 8), step, dtype=np.int16),
        "rng": jax.random.key(step),
        "legacy_rng": jax.random.PRNGKey(step),
        "step": step,
        "name": "run",
    }


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("cli") / "root")
    with jaxckpt.CheckpointManager(root, layout="plain") as mgr:  # its chunk objects are read
        for step in STEPS:
            mgr.save(
                step, _state(step), metrics={"loss": 1.0 / step}, keep=step == 2, metadata={"a": 1}
            )
    return root


@pytest.fixture
def root(saved_root: str, tmp_path: Path) -> str:
    """A private copy of the saved root, for tests that change it."""
    copy = str(tmp_path / "copy")
    shutil.copytree(saved_root, copy)
    return copy


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def _partial(root: str, step: int, *, age_s: float) -> None:
    """Leaves a partial save of ``step`` that started ``age_s`` seconds ago."""
    storage = open_storage(root)
    started = time.time() - age_s
    loc = StepLocation(step, new_attempt(CommitProtocol(storage).epochs.newest(), started))
    storage.write(loc.pending_key, json_record(operation="save", started=started))
    storage.write(loc.arrays_prefix + "x/c/0", b"half-written")
    # gc judges age by the storage's clock: the record must be as old there too.
    os.utime(os.path.join(storage.uri, loc.pending_key), (started, started))


# ---------------------------------------------------------------------------------- ls


def test_ls_lists_steps_sizes_and_times(capsys, saved_root):
    rc, out, _ = run(capsys, "ls", saved_root)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"{saved_root}: 6 committed steps (")
    rows = [line.split() for line in lines[2:8]]
    assert [int(r[0]) for r in rows] == list(STEPS)
    assert all(r[1] == "committed" for r in rows)
    assert "KiB" in out and " ago)" in out
    assert "pinned" in lines[3] and "newest" in lines[7]
    assert "retention" not in out and len(lines) == 8  # no hint unless there is something to say


def test_ls_limit_shows_the_newest_steps(capsys, saved_root):
    rc, out, _ = run(capsys, "ls", saved_root, "--limit", "2")
    lines = out.splitlines()
    assert rc == 0 and lines[0].startswith(f"{saved_root}: 6 committed steps (")
    assert [int(line.split()[0]) for line in lines[2:4]] == [20, 30]
    assert lines[4] == "(4 older committed steps not shown; --limit 0 shows all)"
    listing = run_json(capsys, "ls", saved_root, "--limit=3")
    assert [s["step"] for s in listing["committed"]] == [10, 20, 30] and listing["not_shown"] == 3
    assert len(run_json(capsys, "ls", saved_root)["committed"]) == 6  # JSON lists all by default


def test_ls_json_with_retention_flags(capsys, saved_root):
    listing = run_json(capsys, "ls", saved_root, "--keep-last=2", "--keep-milestones")
    by_step = {s["step"]: s for s in listing["committed"]}
    assert list(by_step) == list(STEPS)
    assert by_step[30]["kept_by"] == ["KeepLast(2)", "newest"]
    assert by_step[20]["kept_by"] == ["KeepLast(2)", "milestone 20"]
    assert by_step[2]["kept_by"] == ["milestone 2", "pinned"]
    assert by_step[2]["keep"] is True and listing["retention"] is not None
    assert by_step[10]["metrics"] == {"loss": 0.1}
    # Without flags ls applies no rule, and the job's own rule is not recorded: it says
    # nothing about one ("no retention policy" was untrue for a job that had one).
    plain = run_json(capsys, "ls", saved_root)
    assert plain["retention"] is None
    assert {s["step"]: s["kept_by"] for s in plain["committed"]} == {
        1: [],
        2: ["pinned"],
        5: [],
        10: [],
        20: [],
        30: ["newest"],
    }
    assert "no retention policy" not in run(capsys, "ls", saved_root)[1]
    assert by_step[5]["nbytes"] > 64 * 32 * 4
    assert listing["partial"] == []


def test_ls_shows_partial_steps(capsys, root):
    _partial(root, 40, age_s=120)
    rc, out, _ = run(capsys, "ls", root)
    assert rc == 0 and ", 1 partial" in out.splitlines()[0]
    assert "partial (save)" in out and "started 2.0 min ago" in out
    listing = run_json(capsys, "ls", root)
    assert [p["step"] for p in listing["partial"]] == [40]


# ----------------------------------------------------------------------------- inspect


def test_inspect_shows_the_tree(capsys, saved_root):
    rc, out, _ = run(capsys, "inspect", saved_root)
    assert rc == 0
    assert out.startswith(f"step 30 of {saved_root}: committed ")
    assert "metrics: loss=0.0333333" in out and 'metadata: {"a": 1}' in out
    row = next(line for line in out.splitlines() if line.startswith("params.w "))
    assert row.split()[1:4] == ["array", "(64,", "32)"]
    assert "float32" in row and "Named(data=1; P('data', None))" in row and "8.0 KiB" in row
    assert "key<threefry2x32>" in out
    assert any(
        line.startswith("step ") and line.rstrip().endswith("30") for line in out.splitlines()
    )


def test_inspect_json(capsys, saved_root):
    info = run_json(capsys, "inspect", saved_root, "5")
    assert info["step"] == 5 and info["metadata"] == {"a": 1} and info["metrics"] == {"loss": 0.2}
    leaves = {x["path"]: x for x in info["leaves"]}
    w = leaves["params.w"]
    assert w["keystr"] == "['params']['w']"  # the form rename= takes
    assert (w["shape"], w["dtype"], w["nbytes"]) == ([64, 32], "float32", 64 * 32 * 4)
    assert w["sharding"] == {"type": "NamedSharding", "mesh": {"data": 1}, "spec": ["data", None]}
    assert w["stored_bytes"] >= w["nbytes"]
    assert leaves["emb"]["nbytes"] == 16 * 8 * 2
    assert leaves["rng"]["kind"] == "key" and leaves["rng"]["key_impl"] == "threefry2x32"
    assert leaves["legacy_rng"]["dtype"] == "uint32"
    assert leaves["step"]["value"] == 5 and leaves["name"]["value"] == "run"
    assert sum(x["stored_bytes"] for x in info["leaves"]) == info["nbytes"]


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "{missing}"],
        ["inspect", "{missing}"],
        ["verify", "{missing}"],
        ["prune", "{missing}", "--keep-last=1"],
        ["gc", "{missing}"],
        ["cp", "{missing}", "{other}"],
        ["ls", "{empty}"],
        ["inspect", "{root}", "7"],
        ["verify", "{root}", "7"],
        ["cp", "{root}:7", "{other}"],
        ["ls", "ftp://host/root"],
    ],
)
def test_errors_are_one_line_without_traceback(capsys, saved_root, tmp_path, argv):
    (tmp_path / "empty").mkdir()
    names = {
        "missing": str(tmp_path / "nope"),
        "empty": str(tmp_path / "empty"),
        "root": saved_root,
        "other": str(tmp_path / "other"),
    }
    rc, _, err = run(capsys, *[a.format(**names) for a in argv])
    assert rc == 1
    assert err.count("\n") == 1 and err.startswith("jaxckpt: error: "), err
    assert "Traceback" not in err
    if "{missing}" in argv:
        assert "does not exist" in err
    if argv[1] == "{empty}":
        assert "is not a jaxckpt root" in err
    if "7" in argv or "{root}:7" in argv:
        assert "step 7 not found" in err and "1, 2, 5, 10, 20, 30" in err


def test_errors_exit_non_zero_from_the_console_entry_point(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxckpt", "inspect", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr == f"jaxckpt: error: {tmp_path / 'nope'} does not exist\n"


def test_listing_commands_do_not_import_jax(saved_root, tmp_path):
    code = (
        "import sys; from jaxckpt import cli; "
        f"root = {saved_root!r}; missing = {str(tmp_path / 'nope')!r}; "
        "assert cli.main(['verify', missing]) == 1; "
        "assert cli.main(['export', missing, missing + '.out']) == 1; "
        "assert cli.main(['diff', missing + ':1', root]) == 1; "
        "assert cli.main(['stats', missing]) == 1; "
        "assert cli.main(['ls', root]) == 0; "
        "assert cli.main(['ls', root, '--json', '--keep-last=2']) == 0; "
        "assert cli.main(['inspect', root]) == 0; "
        "assert cli.main(['inspect', root, '10', '--json']) == 0; "
        "assert cli.main(['prune', root, '--keep-last=1', '--dry-run']) == 0; "
        "assert cli.main(['gc', root, '--dry-run']) == 0; "
        f"assert cli.main({ARTICLE!r}) == 0; "
        f"assert cli.main({[*ARTICLE, '--devices=64', '--leaves=100']!r}) == 0; "
        "assert 'jax' not in sys.modules, 'jax was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_version_and_subcommand_usage(capsys, saved_root):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    out, _ = capsys.readouterr()
    assert exit_.value.code == 0 and out.startswith("jaxckpt ") and out.strip() != "jaxckpt"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["verify", saved_root, "--all", "3"])
    _, err = capsys.readouterr()
    assert exit_.value.code == 2
    assert err.startswith("usage: jaxckpt verify ") and "unrecognized arguments: 3" in err
    with pytest.raises(SystemExit):
        cli.main(["verify", saved_root, "3", "--all"])
    assert "give a STEP or --all, not both" in capsys.readouterr()[1]


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_missing_bucket_is_one_line_without_http_body(capsys, request, kind):
    request.getfixturevalue(f"{kind}_server")
    scheme = "s3" if kind == "s3" else "gs"
    rc, _, err = run(capsys, "ls", f"{scheme}://no-such-bucket-{kind}/run")
    assert rc == 1 and err.count("\n") == 1 and err.startswith("jaxckpt: error: "), err
    assert f"{scheme}://no-such-bucket-{kind}/run/jaxckpt.json" in err
    if kind == "s3":  # the GCS emulator answers a missing bucket with an unparsable body
        assert "bucket 'no-such-bucket-s3' does not exist" in err and "[Errno" not in err
    assert "<" not in err and "{" not in err, err  # no raw XML / JSON response body


# ------------------------------------------------------------------------------ verify


def test_verify_all_steps(capsys, saved_root):
    rc, out, _ = run(capsys, "verify", saved_root, "--all")
    assert rc == 0
    assert [line.split(":")[0] for line in out.splitlines()[:6]] == [f"step {s}" for s in STEPS]
    assert "OK (" in out and out.rstrip().endswith("all 6 verified steps are intact")
    report = run_json(capsys, "verify", saved_root, "20")
    assert report["ok"] is True and [s["step"] for s in report["steps"]] == [20]
    assert run_json(capsys, "verify", f"{saved_root}:20") == report  # ROOT:STEP, as diff takes
    with pytest.raises(SystemExit) as exit_:
        cli.main(["verify", f"{saved_root}:20", "20"])
    assert exit_.value.code == 2 and "give the step once" in capsys.readouterr().err
    assert report["steps"][0]["bytes_checked"] > 0 and report["steps"][0]["problems"] == []


@pytest.mark.usefixtures("plain_by_default")
def test_verify_names_the_damaged_chunk(capsys, root):
    chunk = Path(step_dir(root, 10, "arrays", "params.w", "c", "0", "0"))
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    rc, out, err = run(capsys, "verify", root, "--all")
    assert rc == 1
    assert "step 10: 1 PROBLEMS" in out and "step 20: OK" in out
    assert "jaxckpt: step 10: params.w chunk c/0/0: checksum mismatch" in err
    assert "1 of 6 steps failed verification: [10]" in err
    rc, out, _ = run(capsys, "verify", root, "10", "--json")
    report = json.loads(out)
    assert rc == 1 and report["ok"] is False
    assert report["steps"][0]["problems"] == [
        {"path": "params.w", "chunk": "c/0/0", "message": "checksum mismatch"}
    ]


def test_progress_bar_draws_human_sizes():
    stream = io.StringIO()
    bar = cli.Progress("step 3", 3 << 20, stream=stream, enabled=True, interval=0)
    bar.update(1 << 20)
    bar.update(2 << 20)
    bar.finish()
    text = stream.getvalue()
    assert "\rstep 3 [##########" in text and " 33.3% 1.0 MiB / 3.0 MiB" in text
    assert text.endswith("100.0% 3.0 MiB / 3.0 MiB (" + text.rsplit("(", 1)[1])
    assert text.endswith("/s)\n")
    silent = io.StringIO()
    cli.Progress("x", 10, stream=silent, enabled=False).finish()
    assert silent.getvalue() == ""


# ------------------------------------------------------------------------------- prune


def test_prune_dry_run_changes_nothing(capsys, root):
    rc, out, _ = run(capsys, "prune", root, "--keep-last=2", "--dry-run")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["ACTION", "STEP", "SIZE", "WHY"]
    assert lines[1].split()[:3] == ["would", "delete", "1"] and "not kept by the rule" in lines[1]
    assert lines[2].split()[:2] == ["keep", "2"] and lines[2].endswith("pinned")
    # Columns line up: every step number ends where the STEP header ends.
    step_end = lines[0].index("STEP") + len("STEP")
    assert all(line[:step_end].rstrip().split()[-1].isdigit() for line in lines[1:7])
    assert all(line[step_end] == " " for line in lines[1:7])
    sizes = {s["step"]: s["nbytes"] for s in run_json(capsys, "ls", root)["committed"]}
    reclaimed = cli.human_bytes(sizes[1] + sizes[5] + sizes[10])
    assert out.rstrip().endswith(f"would delete 3 steps, reclaiming {reclaimed} (dry run)")
    assert jaxckpt.CheckpointManager(root, read_only=True).steps() == list(STEPS)


def test_prune_deletes_what_the_rules_do_not_keep(capsys, root):
    rc, out, _ = run(capsys, "prune", root, "--keep-last=1", "--keep-every=10")
    assert rc == 0 and "deleted 2 steps" in out
    assert jaxckpt.CheckpointManager(root, read_only=True).steps() == [2, 10, 20, 30]
    assert data_steps(open_storage(root)) == {2, 10, 20, 30}
    assert open_storage(root).list("pending/") == []
    rc, _, err = run(capsys, "prune", root)
    assert rc == 2 and "needs a retention rule" in err


# ---------------------------------------------------------------------------------- gc


def test_gc_removes_only_partial_steps_older_than_the_grace(capsys, root):
    _partial(root, 40, age_s=7200)
    _partial(root, 50, age_s=10)
    rc, out, _ = run(capsys, "gc", root, "--dry-run")
    assert rc == 0 and "would remove               step 40" in out
    assert "keep (within grace period) step 50" in out
    assert {40, 50} <= data_steps(open_storage(root))
    rc, out, _ = run(capsys, "gc", root, "--grace=3600")
    assert rc == 0 and "removed 1 attempts (grace 1.0 h)" in out
    assert data_steps(open_storage(root)) == {*STEPS, 50}
    assert [p.step for p in scan(CommitProtocol(open_storage(root)), full=True).attempts] == [50]
    assert jaxckpt.CheckpointManager(root, read_only=True).steps() == list(STEPS)


# ---------------------------------------------------------------------------------- cp


def _restored(root: str, step: int) -> dict:
    return jaxckpt.CheckpointManager(root, read_only=True).restore(step)


def _assert_same(a: dict, b: dict) -> None:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert np.asarray(x).dtype == np.asarray(y).dtype
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_cp_copies_and_commits_every_step(capsys, saved_root, tmp_path):
    dst = str(tmp_path / "dst")
    rc, out, _ = run(capsys, "cp", saved_root, dst)
    assert rc == 0 and out.rstrip().endswith(f"{dst}: 6 committed steps")
    assert jaxckpt.CheckpointManager(dst, read_only=True).steps() == list(STEPS)
    assert run(capsys, "verify", dst, "--all")[0] == 0
    _assert_same(_restored(saved_root, 20), _restored(dst, 20))
    src_ls = run_json(capsys, "ls", saved_root)["committed"]
    dst_ls = run_json(capsys, "ls", dst)["committed"]
    for a, b in zip(src_ls, dst_ls, strict=True):
        assert (a["nbytes"], a["keep"], a["metrics"]) == (b["nbytes"], b["keep"], b["metrics"])
    rc, out, _ = run(capsys, "cp", f"{saved_root}:20", dst)
    assert rc == 0 and "step 20: already committed" in out


@pytest.mark.usefixtures("plain_by_default")
def test_cp_one_step_with_zstd_restores_like_any_other(capsys, saved_root, tmp_path, monkeypatch):
    from jaxckpt.restoring import _stepreader as _restore

    codec_checks: list[int] = []
    plain_leaves = _restore.plain_leaves

    def counted(*args):  # type: ignore[no-untyped-def]
        codec_checks.append(1)
        return plain_leaves(*args)

    monkeypatch.setattr(_restore, "plain_leaves", counted)
    dst = str(tmp_path / "zst")
    rc, out, _ = run(capsys, "cp", f"{saved_root}:30", dst, "--compress", "zstd")
    assert rc == 0 and "of the source" in out
    assert jaxckpt.CheckpointManager(dst, read_only=True).steps() == [30]
    meta = json.loads(Path(step_dir(dst, 30, "arrays", "emb", "zarr.json")).read_bytes())
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd", "crc32c"]
    src_size = run_json(capsys, "ls", saved_root)["committed"][-1]["nbytes"]
    dst_size = run_json(capsys, "ls", dst)["committed"][0]["nbytes"]
    assert dst_size < src_size
    assert run_json(capsys, "verify", dst)["ok"] is True
    _assert_same(_restored(saved_root, 30), _restored(dst, 30))
    target = _state(0)
    restored = jaxckpt.CheckpointManager(dst, read_only=True).restore(target=target)
    assert restored["params"]["w"].sharding == target["params"]["w"].sharding
    assert codec_checks  # its manifest does not claim the plain chain: zarr.json decides


def test_cp_refuses_the_same_root(capsys, saved_root):
    rc, _, err = run(capsys, "cp", saved_root, saved_root)
    assert rc == 2 and "same root" in err


@pytest.mark.usefixtures("plain_by_default")
def test_cp_does_not_copy_a_damaged_step(capsys, root, tmp_path):
    chunk = Path(step_dir(root, 5, "arrays", "emb", "c", "0", "0"))
    chunk.write_bytes(b"\0" + chunk.read_bytes()[1:])
    dst = str(tmp_path / "dst")
    rc, _, err = run(capsys, "cp", f"{root}:5", dst)
    assert rc == 1 and "emb/c/0/0 does not match its manifest record" in err
    assert jaxckpt.CheckpointManager(dst, read_only=True).steps() == []
    assert data_steps(open_storage(dst)) == set() and open_storage(dst).list("pending/") == []


@pytest.mark.usefixtures("plain_by_default")
def test_cp_to_every_backend_and_back(capsys, saved_root, storage_root, tmp_path):
    rc, _, err = run(capsys, "cp", f"{saved_root}:20", storage_root, "--compress", "zstd")
    assert rc == 0, err
    assert [s["step"] for s in run_json(capsys, "ls", storage_root)["committed"]] == [20]
    info = run_json(capsys, "inspect", storage_root)
    assert {x["path"] for x in info["leaves"]} >= {"params.w", "rng", "step"}
    assert run_json(capsys, "verify", storage_root, "--all")["ok"] is True
    back = str(tmp_path / "back")
    assert run(capsys, "cp", storage_root, back)[0] == 0
    _assert_same(_restored(saved_root, 20), _restored(back, 20))


# -------------------------------------------------------------------------------- plan


def test_plan_article_example(capsys):
    result = run_json(capsys, *ARTICLE)
    assert result["checkpoint_gb"] == pytest.approx(60)
    assert result["save_seconds"] == pytest.approx(50)
    assert result["overhead_percent"] == pytest.approx(2.0)
    assert result["optimal_interval_steps"] == 1162
    assert result["checkpoints"] == 725
    assert set(result) == {
        "checkpoint_gb",
        "save_seconds",
        "overhead_percent",
        "optimal_interval_steps",
        "checkpoints",
        "idle_gpu_hours",
        "idle_cost_usd",
        "expected_lost_minutes_per_failure",
    }


def test_plan_human_output_and_bad_values(capsys):
    rc, out, _ = run(capsys, "plan", *ARTICLE[1:], "--params=30B", "--async-blocking-seconds=2")
    assert rc == 0
    assert "60.0 GB" in out and "50.0 s" in out and "0.08 % of training time" in out
    rc, _, err = run(capsys, *ARTICLE, "--write-gbps=0")
    assert rc == 2 and err.startswith("jaxckpt: error: write_gbps must be") and err[-1] == "\n"
    with pytest.raises(SystemExit):
        cli.main(["plan", "--params=lots"])


def test_plan_objects_and_request_cost_per_layout(capsys):
    argv = [*ARTICLE, "--params=70B", "--bytes-per-param=12", "--devices=256", "--leaves=2200"]
    result = run_json(capsys, *argv)
    assert result["objects_per_checkpoint"] == {"plain": 565438, "packed": 12550}
    assert result["request_cost_usd"]["plain"] == pytest.approx(2.83, abs=0.01)
    assert result["request_cost_usd"]["packed"] < 0.07
    assert set(result["request_seconds"]) == {"plain", "packed"}
    rc, out, _ = run(capsys, *argv)
    assert rc == 0 and "per checkpoint, by layout:" in out
    assert "565,438" in out and "$2.83" in out
    rc, _, err = run(capsys, *ARTICLE, "--devices=8")
    assert rc == 2 and "--devices and --leaves go together" in err


def test_python_dash_m_runs_the_same_command_line(saved_root):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxckpt", "ls", saved_root, "--json"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert [s["step"] for s in json.loads(proc.stdout)["committed"]] == list(STEPS)
