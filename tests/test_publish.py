"""Published weights (``publish=``): the HF layout, the tree filter, the memory budget,
a SIGKILLed publish redone on the next open, failures that never fail a save."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path

import numpy as np
import pytest
from benchkit import servers
from harness import child_env, kill, reached_file, wait_until
from safetensors.numpy import load, load_file

import jaxckpt
from jaxckpt.cli import main as cli_main
from jaxckpt.ledger import read_ledger
from jaxckpt.lifecycle import _publish
from jaxckpt.policy import AtSteps, EveryNSteps
from jaxckpt.records import publish_key
from jaxckpt.storage import open_storage

INDEX = "model.safetensors.index.json"


def _state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "params": {
            "dense": {"kernel": rng.standard_normal((64, 256), dtype=np.float32)},
            "embed": rng.standard_normal((128, 64)).astype(np.float16),
        },
        "opt_state": {"mu": np.full((64, 256), step, np.float32)},
        "step": step,
    }


def _published(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a published step, read through its index."""
    index = json.loads((directory / INDEX).read_text())
    tensors: dict[str, np.ndarray] = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors |= load_file(directory / name)
    assert set(tensors) == set(index["weight_map"])
    return tensors


def test_every_n_steps_publishes_the_params_in_the_hugging_face_layout(tmp_path):
    root, dest = tmp_path / "ckpt", tmp_path / "weights"
    pub = jaxckpt.PublishOptions(
        policy=EveryNSteps(2), destination=str(dest), max_shard_bytes=40_000
    )
    with jaxckpt.CheckpointManager(root, publish=pub, chunk_bytes=16 << 10) as mgr:
        for step in range(5):
            assert mgr.save(step, _state(step))
    assert sorted(os.listdir(dest)) == ["0", "2", "4"]
    for step in (0, 2, 4):
        names = sorted(os.listdir(dest / str(step)))
        shards = [n for n in names if n != INDEX]
        assert len(shards) == 2 and names == sorted([*shards, INDEX])
        assert shards[0] == "model-00001-of-00002.safetensors"
        tensors = _published(dest / str(step))
        params = _state(step)["params"]
        assert sorted(tensors) == ["params.dense.kernel", "params.embed"]  # no optimizer
        np.testing.assert_array_equal(tensors["params.dense.kernel"], params["dense"]["kernel"])
        np.testing.assert_array_equal(tensors["params.embed"], params["embed"])
        index = json.loads((dest / str(step) / INDEX).read_text())
        assert index["metadata"]["total_size"] == 64 * 256 * 4 + 128 * 64 * 2
    storage = open_storage(str(root))
    assert storage.read(publish_key(2)) is not None and storage.read(publish_key(1)) is None
    assert not [k for k in storage.list("publish/") if k.endswith(".due.json")]
    (run,) = read_ledger(storage)
    assert [(e["step"], e["outcome"]) for e in run.of("publish")] == [
        (0, "published"),
        (2, "published"),
        (4, "published"),
    ]


def test_publishes_from_an_object_store_root_under_a_budget(s3_server, tmp_path):
    root, dest = f"s3://{s3_server.bucket}/{tmp_path.name}", tmp_path / "weights"
    pub = jaxckpt.PublishOptions(
        policy=AtSteps([2]), destination=str(dest), max_memory_bytes=200 << 10
    )
    with jaxckpt.CheckpointManager(root, publish=pub, chunk_bytes=16 << 10) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    assert sorted(os.listdir(dest)) == ["2"]
    tensors, params = _published(dest / "2"), _state(2)["params"]
    np.testing.assert_array_equal(tensors["params.dense.kernel"], params["dense"]["kernel"])
    np.testing.assert_array_equal(tensors["params.embed"], params["embed"])


def _published_in(uri: str) -> dict[str, np.ndarray]:
    """Every tensor of a step published to a bucket, read through its index."""
    storage = open_storage(uri)
    index = json.loads(storage.read(INDEX) or b"null")
    tensors: dict[str, np.ndarray] = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors |= load(storage.read(name) or b"")
    assert set(tensors) == set(index["weight_map"])
    return tensors


def _big(step: int) -> dict:
    """A 6 MiB kernel (more than one S3 part) and a small embedding."""
    rng = np.random.default_rng(step)
    kernel = rng.standard_normal((1536, 1024), dtype=np.float32)
    return {"params": {"kernel": kernel, "embed": np.arange(512, dtype=np.float16)}, "step": step}


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_publishes_to_a_bucket_in_parts_under_the_budget(
    scheme, s3_server, gcs_server, tmp_path, monkeypatch
):
    """Shards larger than the 1 MiB budget go up from a local spool file in parts (an S3
    multipart upload of two parts, a GCS resumable upload); the smaller
    shard in one write; the spool is gone afterwards."""
    spool = tmp_path / "tmp"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    dest = f"{scheme}://{servers.BUCKET}/{tmp_path.name}/weights/"
    pub = jaxckpt.PublishOptions(
        policy=AtSteps([2]), destination=dest, max_memory_bytes=1 << 20, max_shard_bytes=4 << 20
    )
    assert pub.destination == dest.rstrip("/")
    with jaxckpt.CheckpointManager(tmp_path / "ckpt", publish=pub, chunk_bytes=64 << 10) as mgr:
        mgr.save(1, _big(1))
        mgr.save(2, _big(2))
    assert mgr._publisher.published == 1 and mgr._publisher.failures == 0
    step_uri = f"{dest}2"
    tensors, params = _published_in(step_uri), _big(2)["params"]
    assert sorted(tensors) == ["params.embed", "params.kernel"]
    np.testing.assert_array_equal(tensors["params.kernel"], params["kernel"])
    np.testing.assert_array_equal(tensors["params.embed"], params["embed"])
    assert open_storage(step_uri).list("") == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        INDEX,
    ]
    if scheme == "s3":  # the kernel's shard is a multipart object (its ETag counts the parts)
        key = f"{tmp_path.name}/weights/2/model-00002-of-00002.safetensors"
        head = servers.s3_client().head_object(Bucket=servers.BUCKET, Key=key)
        assert head["ContentLength"] > 6 << 20 and head["ETag"].strip('"').endswith("-2")
    done = json.loads(open_storage(str(tmp_path / "ckpt")).read(publish_key(2)) or b"null")
    assert done["destination"] == step_uri and len(done["files"]) == 3
    assert list(spool.iterdir()) == []  # the spool directory went


def test_the_spool_of_a_killed_export_is_removed_by_the_next(s3_server, tmp_path, monkeypatch):
    spool = tmp_path / "tmp"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process that exited: its pid names no process now
    killed = spool / f"jaxckpt-export-{gone.pid}-abc"
    live = spool / f"jaxckpt-export-{os.getppid()}-def"  # a live process's: kept
    for d in (killed, live):
        d.mkdir()
        (d / "model-00001-of-00002.safetensors").write_bytes(b"half a shard")
    root, out = tmp_path / "ckpt", f"s3://{servers.BUCKET}/{tmp_path.name}/w"
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, _state(1))
    jaxckpt.export_safetensors(root, out)
    assert sorted(spool.iterdir()) == [live]


def test_with_a_local_tier_the_local_copy_is_read(tmp_path):
    root, local, dest = tmp_path / "durable", tmp_path / "local", tmp_path / "weights"
    pub = jaxckpt.PublishOptions(policy=AtSteps([2]), destination=str(dest))
    opts = {"local_root": str(local), "promote_policy": AtSteps([1]), "publish": pub}
    with jaxckpt.CheckpointManager(root, **opts) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))  # committed locally only: never promoted
        assert mgr.wait_durable(1) == 1 and mgr.steps("durable") == [1]
    assert sorted(_published(dest / "2")) == ["params.dense.kernel", "params.embed"]
    assert open_storage(str(root)).read(publish_key(2)) is not None  # ls of the durable root


def test_ls_shows_what_is_published(tmp_path, capsys):
    root, dest = tmp_path / "ckpt", tmp_path / "weights"
    pub = jaxckpt.PublishOptions(policy=AtSteps([1]), destination=str(dest))
    with jaxckpt.CheckpointManager(root, publish=pub) as mgr:
        mgr.save(0, _state(0))
        mgr.save(1, _state(1))
    assert cli_main(["ls", str(root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["committed"]
    assert [(s["step"], s["published"]) for s in listed] == [(0, None), (1, "published")]
    assert cli_main(["ls", str(root)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[-1] == "PUBLISHED"
    assert table[2].split()[-1] == "-" and table[3].split()[-1] == "published"


@pytest.mark.parametrize(
    ("tree_filter", "expected"),
    [
        (["opt_state.*"], ["opt_state.mu"]),
        (lambda name: name.endswith("embed"), ["params.embed"]),
    ],
)
def test_a_tree_filter_chooses_the_leaves(tmp_path, tree_filter, expected):
    root, dest = tmp_path / "ckpt", tmp_path / "weights"
    pub = jaxckpt.PublishOptions(
        policy=EveryNSteps(1), destination=str(dest), tree_filter=tree_filter
    )
    with jaxckpt.CheckpointManager(root, publish=pub) as mgr:
        mgr.save(3, _state(3))
    assert sorted(_published(dest / "3")) == expected


def test_without_params_everything_is_published(tmp_path):
    root, dest = tmp_path / "ckpt", tmp_path / "weights"
    pub = jaxckpt.PublishOptions(policy=EveryNSteps(1), destination=str(dest))
    with jaxckpt.CheckpointManager(root, publish=pub) as mgr:
        mgr.save(1, {"w": np.arange(6.0), "b": np.ones(2, np.int32)})
    assert sorted(_published(dest / "1")) == ["b", "w"]


def test_a_failed_publish_never_fails_the_save_and_is_counted(tmp_path):
    root, blocker = tmp_path / "ckpt", tmp_path / "not-a-directory"
    blocker.write_text("a file where the destination's directory would be")
    pub = jaxckpt.PublishOptions(
        policy=EveryNSteps(1),
        destination=str(blocker / "weights"),
        retries=1,
        backoff_s=(0.01, 0.02),
    )
    mgr = jaxckpt.CheckpointManager(root, publish=pub)
    assert mgr.save(1, _state(1))
    mgr.wait()
    assert mgr.save(2, _state(2))
    mgr.close()  # waits for the publications; neither failure reaches the saves
    assert mgr.steps() == [1, 2]
    assert mgr._publisher.failures == 2 and mgr._publisher.published == 0
    storage = open_storage(str(root))
    assert storage.read(publish_key(1, due=True)) is not None  # left for the next open
    (run,) = read_ledger(storage)
    failed = run.of("publish")
    assert [(e["step"], e["outcome"]) for e in failed] == [(1, "failed"), (2, "failed")]
    assert "weights" in failed[0]["error"]


def test_a_publisher_behind_skips_the_oldest_waiting_step(tmp_path, monkeypatch):
    root, dest = tmp_path / "ckpt", tmp_path / "weights"
    started, release = threading.Event(), threading.Event()
    real = _publish.Publisher.publish

    def held(self, step):
        if step == 0:
            started.set()
            assert release.wait(60)
        return real(self, step)

    monkeypatch.setattr(_publish.Publisher, "publish", held)
    pub = jaxckpt.PublishOptions(policy=EveryNSteps(1), destination=str(dest), queue=1)
    with jaxckpt.CheckpointManager(root, publish=pub) as mgr:
        mgr.save(0, _state(0))
        assert started.wait(60)  # step 0 is being published
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))  # step 1 waits; step 2 comes: step 1 is skipped
        mgr.wait()
        release.set()
    assert sorted(os.listdir(dest)) == ["0", "2"]
    assert mgr._publisher.skipped == 1
    assert open_storage(str(root)).read(publish_key(1, due=True)) is None


def test_several_processes_wait_until_the_step_is_durable(tmp_path):
    """Several processes with a local tier publish from the durable root: a step committed
    locally but not promoted yet is looked for again (not a failure) until it is there."""
    root, dest = tmp_path / "durable", tmp_path / "weights"
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, _state(1))
    tried = threading.Event()

    class Watched(_publish.Publisher):
        def publish(self, step):
            try:
                return super().publish(step)
            except jaxckpt.CheckpointError:
                tried.set()
                raise

    pub = jaxckpt.PublishOptions(
        policy=EveryNSteps(1), destination=str(dest), backoff_s=(0.01, 0.05), retries=0
    )
    publisher = Watched(pub, [(str(root), {})], open_storage(str(root)), several=True)
    publisher.start()
    publisher.committed(types.SimpleNamespace(step=3))  # a local commit of step 3
    assert tried.wait(60)  # looked for on the durable root: not there yet
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(3, _state(3))  # promoted
    publisher.close(60)
    assert publisher.published == 1 and publisher.failures == 0
    assert sorted(_published(dest / "3")) == ["params.dense.kernel", "params.embed"]


_KILLED_CHILD = """
import sys, numpy as np, jaxckpt
from jaxckpt.policy import EveryNSteps
root, dest = sys.argv[1], sys.argv[2]
pub = jaxckpt.PublishOptions(policy=EveryNSteps(5), destination=dest, max_shard_bytes=40_000)
mgr = jaxckpt.CheckpointManager(root, publish=pub)
rng = np.random.default_rng(5)
mgr.save(5, {"params": {"a": rng.standard_normal((64, 256), dtype=np.float32),
                        "b": rng.standard_normal((64, 256), dtype=np.float32)}})
mgr.close()
"""


def test_a_publish_killed_mid_way_is_redone_by_the_next_open(tmp_path):
    root, dest, pauses = tmp_path / "ckpt", tmp_path / "weights", tmp_path / "pauses"
    pauses.mkdir()
    env = child_env(pause_at="shard_written", resume_dir=pauses, pause_s=120)
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CHILD, str(root), str(dest)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(
            reached_file(pauses, "shard_written", 5).exists,
            what="the first published shard",
            timeout_s=120,
            gone=lambda: proc.poll() is not None,
        )
    finally:
        kill(proc)
    left = sorted(os.listdir(dest / "5"))
    assert len(left) == 1 and ".tmp-" in left[0]  # one shard, no index: not published
    storage = open_storage(str(root))
    assert storage.read(publish_key(5, due=True)) is not None
    pub = jaxckpt.PublishOptions(
        policy=EveryNSteps(5), destination=str(dest), max_shard_bytes=40_000
    )
    with jaxckpt.CheckpointManager(root, publish=pub) as mgr:
        assert mgr.steps() == [5]
    assert sorted(os.listdir(dest / "5")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        INDEX,
    ]
    rng = np.random.default_rng(5)
    expected = {f"params.{k}": rng.standard_normal((64, 256), dtype=np.float32) for k in "ab"}
    tensors = _published(dest / "5")
    assert sorted(tensors) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(tensors[name], value)
    assert storage.read(publish_key(5, due=True)) is None and storage.read(publish_key(5))
    killed, reopened = read_ledger(storage)  # the redone publication is the second run's
    assert killed.of("publish") == []
    assert [(e["step"], e["outcome"]) for e in reopened.of("publish")] == [(5, "published")]


_RSS_CHILD = """
import json, sys
from jaxckpt.lifecycle import Publisher
from jaxckpt.policy import EveryNSteps
from jaxckpt.storage import open_storage
import jaxckpt

def status(field):
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024

root, dest, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
pub = jaxckpt.PublishOptions(policy=EveryNSteps(1), destination=dest, max_memory_bytes=budget)
publisher = Publisher(pub, [(root, {})], open_storage(root), destination_options={})
publisher.publish(0)  # warm: every module and code path loaded
if "://" in dest:  # and the destination's clients made (for S3: botocore's, ~19 MiB once)
    open_storage(dest).write(".warm", b"", exclusive=True)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current resident size
baseline = status("VmRSS")
result = publisher.publish(1)
print(json.dumps({"baseline": baseline, "peak": status("VmHWM"), "nbytes": result.nbytes}))
"""


@pytest.mark.parametrize("where", ["local", "s3", "gs"])
def test_publishing_a_state_4x_the_budget_stays_under_it(request, tmp_path, where):
    """A 64 MiB state published with a 16 MiB budget: the peak RSS above the
    publisher's own stays under the budget (a 32 MiB leaf in blocks, a 16 MiB leaf
    of one wide chunk row chunk by chunk; to a bucket, the 64 MiB shard uploaded from
    its spool file in parts of 16 MiB)."""
    root, dest, budget = tmp_path / "ckpt", str(tmp_path / "weights"), 16 << 20
    if where != "local":
        request.getfixturevalue("s3_server" if where == "s3" else "gcs_server")
        dest = f"{where}://{servers.BUCKET}/{tmp_path.name}/weights"
    small = {"params": {"a": np.ones((8, 8), np.float32), "wide": np.ones((1, 64), np.float32)}}
    big = {
        "params": {
            "embed": np.ones((4096, 2048), np.float32),  # 32 MiB
            "dense": np.ones((2048, 2048), np.float32),  # 16 MiB
            "wide": np.ones((1, 4 << 20), np.float32),  # 16 MiB, chunks along the row
        }
    }
    with jaxckpt.CheckpointManager(root, chunk_bytes=4 << 20) as mgr:
        mgr.save(0, small)
        mgr.save(1, big)
    del big
    done = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(root), str(dest), str(budget)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["nbytes"] == 64 << 20
    grown = measured["peak"] - measured["baseline"]
    print(f"{where}: peak RSS above the publisher's own: {grown / 2**20:.1f} MiB (budget 16 MiB)")
    assert grown < budget, measured
    shard = "1/model-00001-of-00001.safetensors"
    stored = open_storage(dest).read(shard) if where != "local" else None
    wide = load(stored) if stored else load_file(os.path.join(dest, shard))
    wide = wide["params.wide"]
    assert wide.shape == (1, 4 << 20) and bool((wide == 1).all())


def test_the_budget_must_hold_two_chunks(tmp_path):
    root = tmp_path / "ckpt"
    with jaxckpt.CheckpointManager(root, chunk_bytes=64 << 10) as mgr:
        mgr.save(1, {"w": np.ones((64, 1024), np.float32)})
    with pytest.raises(jaxckpt.CheckpointError, match=r"below three chunks of w"):
        jaxckpt.export_safetensors(root, tmp_path / "out", max_memory_bytes=100 << 10)


def test_export_max_memory_on_the_command_line(tmp_path, capsys):
    root, out = tmp_path / "ckpt", tmp_path / "out"
    w = np.arange(3 * 5 * 20000, dtype=np.float32).reshape(3, 5, 20000)
    with jaxckpt.CheckpointManager(root, chunk_bytes=64 << 10) as mgr:
        mgr.save(1, {"w": w})
    argv = ["export", str(root), str(out), "--max-memory", "200KiB", "--no-progress"]
    assert cli_main(argv) == 0
    np.testing.assert_array_equal(load_file(out / "model.safetensors")["w"], w)


def test_export_to_a_bucket_on_the_command_line(s3_server, tmp_path, capsys):
    root, out = tmp_path / "ckpt", f"s3://{servers.BUCKET}/{tmp_path.name}/w/model.safetensors"
    state = _big(1)
    with jaxckpt.CheckpointManager(root, chunk_bytes=64 << 10) as mgr:
        mgr.save(1, state)
    argv = ["export", str(root), out, "--max-memory", "1MiB", "--no-progress"]
    assert cli_main(argv) == 0
    assert f"to {out}" in capsys.readouterr().out
    stored = open_storage(out.rpartition("/")[0])
    assert stored.list("") == ["model.safetensors"]
    tensors = load(stored.read("model.safetensors") or b"")
    np.testing.assert_array_equal(tensors["params.kernel"], state["params"]["kernel"])
    with pytest.raises(jaxckpt.CheckpointError, match="'ftp://host/w'"):
        jaxckpt.export_safetensors(root, "ftp://host/w")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": 5}, "save policy"),
        ({"destination": "ftp://example.com/weights"}, "'ftp://example.com/weights' is not valid"),
        ({"destination": "gs:/bucket/w"}, "use 'gs://bucket/w'"),
        ({"destination": "s3://Bad_Bucket/w"}, "bucket 'Bad_Bucket' is not a valid s3"),
        ({"destination": "s3://bucket/../w"}, "may not contain '..'"),
        ({"destination": "gs://bucket/w", "storage_options": {"region": "x"}}, "s3:// roots"),
        ({"destination": ""}, "must be a path"),
        ({"format": "orbax"}, "format"),
        ({"max_memory_bytes": 0}, "max_memory_bytes"),
        ({"queue": True}, "queue"),
        ({"retries": -1}, "retries"),
        ({"backoff_s": (2.0, 1.0)}, "backoff_s"),
    ],
)
def test_publish_options_are_checked(tmp_path, kwargs, message):
    given = {"policy": EveryNSteps(10), "destination": str(tmp_path)} | kwargs
    with pytest.raises(ValueError, match=message):
        jaxckpt.PublishOptions(**given)
    with pytest.raises(ValueError, match="PublishOptions"):
        jaxckpt.CheckpointOptions(publish="weights")  # type: ignore[arg-type]
    assert jaxckpt.PublishOptions(
        policy=EveryNSteps(1), destination=f"file://{tmp_path}", tree_filter="params.*"
    ) == jaxckpt.PublishOptions(
        policy=EveryNSteps(1), destination=str(tmp_path), tree_filter=("params.*",)
    )
