"""A retired step is deleted with S3's batch delete, 1,000 keys a request (issue 35).

Requests are counted by ``scripts/faultproxy.py`` in front of moto, with no faults.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator

import faultproxy
import numpy as np
import pytest
from benchkit import servers

import jaxckpt
from jaxckpt.storage import open_storage


class _Counting(faultproxy.FaultProxy):
    """The proxy, counting requests by method and whether they are batch deletes."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.kinds: Counter[str] = Counter()

    def _choose(self, method: str, path: str) -> tuple[str | None, float]:
        with self._lock:
            self.kinds["DeleteObjects" if method == "POST" and "?delete" in path else method] += 1
        return super()._choose(method, path)


@pytest.fixture
def counted(s3_server: servers.Server) -> Iterator[_Counting]:
    proxy = _Counting(s3_server.endpoint)
    yield proxy
    proxy.close()


def test_delete_many_sends_a_batch_per_thousand_keys(
    counted: _Counting, s3_server: servers.Server
) -> None:
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    storage = open_storage(root, endpoint=counted.endpoint)
    written = [f"k/{i}" for i in range(5)]
    for key in written:
        storage.write(key, b"x")
    storage.write("kept", b"y")
    counted.kinds.clear()
    storage.delete_many([*written, *(f"k/missing-{i}" for i in range(1_495))])
    assert counted.kinds["DeleteObjects"] == 2 and counted.kinds["DELETE"] == 0, counted.kinds
    assert storage.list("") == ["kept"]


def test_deleting_a_step_batches_its_objects(counted: _Counting, s3_server: servers.Server) -> None:
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    options = {"endpoint": counted.endpoint}
    state = {f"w{i}": np.arange(1000.0) + i for i in range(40)}
    with jaxckpt.CheckpointManager(root, storage_options=options, layout="plain") as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        mgr.wait()
        objects = len(open_storage(root).list("attempts/"))
        counted.kinds.clear()
        mgr.delete(1)
        mgr.wait_for_deletions()
        assert mgr.steps() == [2]
    # One object per chunk and array of a plain step (80+ for 40 leaves): one batch.
    assert objects > 160
    assert counted.kinds["DeleteObjects"] == 1, counted.kinds
    assert counted.kinds["DELETE"] <= 3, counted.kinds  # the marker and its records
    assert len(open_storage(root).list("attempts/")) == objects // 2
