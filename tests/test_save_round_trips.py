"""What a save sends, and in which order, where round trips cost (a store far away).

Against moto behind the benchmark's shaping proxy (``benchkit.shaper``), whose
request log shows every request of a save.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from benchkit import servers
from benchkit.shaper import Profile, Shaper
from triggers import HANG_S

import jaxckpt
from jaxckpt.records import SPREAD_SLOTS
from jaxckpt.storage import open_storage


@pytest.fixture
def shaped(s3_server: servers.Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Shaper]:
    with Shaper(s3_server.endpoint, Profile(name="bare")) as sh:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", sh.endpoint)
        yield sh


def _state(n: int = 6) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    return {f"w{i}": jnp.asarray(rng.standard_normal(4096, dtype=np.float32)) for i in range(n)}


def test_a_packed_save_sends_no_head_reads_back_nothing_and_raises_a_new_hint_unread(
    shaped: Shaper, s3_server: servers.Server
) -> None:
    root = f"s3://{s3_server.bucket}/trips-{uuid.uuid4().hex[:8]}"
    with jaxckpt.CheckpointManager(root, layout="packed") as mgr:
        shaped.trace = []
        mgr.save(1, _state())
        mgr.wait()
        lines = [line.split()[:2] for _, line in shaped.trace]
        attempt = open_storage(root).list("attempts/1/")[0].split("/")[2]
    assert lines, "the save sent nothing through the proxy"
    assert [m for m, _ in lines if m == "HEAD"] == []  # the marker is one conditional PUT
    # The commit takes its own records' digests from the bytes it wrote, and checks that
    # they and every pack are there with one listing of each prefix the attempt can have
    # used: its own and the hashed ones of its part and packs (one process: not all 32).
    read_back = [p for m, p in lines if m == "GET" and ("tree.json" in p or "/manifest/" in p)]
    assert read_back == []
    listed = [p for m, p in lines if m == "GET" and "list-type=2" in p and attempt in p]
    used = {k.split("/")[1] for k in open_storage(root).list("data/") if f".{attempt}/" in k}
    assert len(listed) == 1 + len(used) and len(used) < SPREAD_SLOTS, (listed, used)
    hint = [m for m, path in lines if "/commits/latest." in path]
    assert hint == ["PUT"]  # raised, never read: this writer took the epoch just now
    markers = [m for m, path in lines if "/commits/000000000001." in path]
    assert markers[-1] == "PUT" and markers.count("PUT") == 1
    assert open_storage(root).list("pending/") == []  # closing settled the record's removal


def test_resaving_a_committed_step_raises_and_leaves_no_record(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    with jaxckpt.CheckpointManager(root, layout="packed") as mgr:
        mgr.save(1, _state(2))
        mgr.wait()
        with pytest.raises(jaxckpt.StepAlreadyExistsError, match="step 1 already exists"):
            mgr.save(1, _state(2))
        storage = open_storage(root)
        assert storage.list("pending/") == []  # the record written beside the listing went
        assert len({k.split("/")[2] for k in storage.list("attempts/1/")}) == 1


def test_the_packed_manifest_part_is_written_while_the_last_packs_upload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jaxckpt.storage import LocalStorage

    root = str(tmp_path / "ckpt")
    release = threading.Event()
    seen: list[bool] = []
    original = LocalStorage.start_write

    def held_start(self: LocalStorage, key: str, pieces: Any) -> Callable[[], None]:
        wait = original(self, key, pieces)

        def held() -> None:
            # Each pack waits until the manifest part exists (or a hang's bound passes).
            seen.append(release.wait(HANG_S))
            wait()

        return held

    original_write = LocalStorage.write

    def write(self: LocalStorage, key: str, data: Any, **kw: Any) -> None:
        original_write(self, key, data, **kw)
        if "/manifest/" in key:
            release.set()

    monkeypatch.setattr(LocalStorage, "start_write", held_start)
    monkeypatch.setattr(LocalStorage, "write", write)
    with jaxckpt.CheckpointManager(root, layout="packed", max_object_bytes=64 << 10) as mgr:
        mgr.save(1, _state())
        mgr.wait()
    assert seen and all(seen), seen  # no pack finished before the manifest part was written
    monkeypatch.undo()
    restored = jaxckpt.CheckpointManager(root, read_only=True).restore(1)
    for name, value in _state().items():
        assert np.asarray(restored[name]).tobytes() == np.asarray(value).tobytes()


@pytest.mark.parametrize("name", ["tree.json", "manifest/0.json", "packs/0.0.bin"])
def test_a_commit_refuses_when_a_record_or_pack_it_wrote_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """What the commit does not read back it still finds in the attempt's listing: gone
    (a collection of the attempt meanwhile), the step is not committed."""
    from jaxckpt.commit import CommitProtocol

    root = str(tmp_path / "ckpt")
    original = CommitProtocol.commit

    def commit(self: CommitProtocol, loc: Any, **kwargs: Any) -> Any:
        self.storage.delete(loc.key(name))  # collected between the data and the marker
        return original(self, loc, **kwargs)

    monkeypatch.setattr(CommitProtocol, "commit", commit)
    with jaxckpt.CheckpointManager(root, layout="packed") as mgr:
        mgr.save(1, _state(2))
        with pytest.raises(jaxckpt.CheckpointError, match=rf"cannot commit step 1: .*{name}"):
            mgr.wait()
        assert mgr.steps() == []
