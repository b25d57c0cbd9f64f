"""Restore reads on object stores: ranged GETs into aligned buffers under a memory budget.

Real loopback servers (moto, the GCS emulator); part sizes are shrunk so that
small objects exercise many parts, a budget smaller than one object and
several threads sharing it. The read tests run on both read paths: jaxckpt's
own connections (``direct_reads``, the default) and TensorStore's (the
fallback, and the budget's subject).
"""

from __future__ import annotations

import threading
import uuid

import jax.numpy as jnp
import numpy as np
import pytest
from benchkit import servers
from rootpaths import chunk_path

import jaxckpt
from jaxckpt.storage import open_storage

SMALL_PARTS = {"read_part_bytes": 1000, "read_ahead_bytes": 3000}
THROUGH_TENSORSTORE = {"direct_reads": False}


@pytest.fixture(params=["direct", "tensorstore"])
def parts(request: pytest.FixtureRequest) -> dict[str, object]:
    """Small parts, read by jaxckpt's own connections or through TensorStore."""
    return {**SMALL_PARTS, "direct_reads": request.param == "direct"}


def test_ranged_read_is_exact_aligned_and_writable(object_root: str, parts) -> None:
    storage = open_storage(object_root, **parts)
    data = np.random.default_rng(0).bytes(10_007)
    storage.write("obj/a", data)
    buffer = storage.read_buffer("obj/a", len(data))
    assert isinstance(buffer, np.ndarray)
    assert bytes(buffer) == data
    assert buffer.ctypes.data % 64 == 0 and buffer.flags.writeable
    assert storage.read_buffer("obj/missing", 5000) is None


def test_a_shorter_object_is_read_whole_so_the_size_check_sees_it(object_root: str, parts) -> None:
    storage = open_storage(object_root, **parts)
    storage.write("obj/short", b"x" * 2500)
    whole = storage.read_buffer("obj/short", 4000)
    assert whole is not None and bytes(whole) == b"x" * 2500
    # A longer object: exactly the first `size` bytes, which the manifest's CRC covers.
    first = storage.read_buffer("obj/short", 2000)
    assert first is not None and bytes(first) == b"x" * 2000


def test_threads_sharing_a_budget_smaller_than_their_objects_all_finish(
    object_root: str, parts
) -> None:
    storage = open_storage(
        object_root, read_part_bytes=700, read_ahead_bytes=1400, direct_reads=parts["direct_reads"]
    )
    blobs = {f"obj/{i}": np.random.default_rng(i).bytes(5_000 + i) for i in range(6)}
    for key, blob in blobs.items():
        storage.write(key, blob)
    results: dict[str, bytes] = {}

    def read(key: str) -> None:
        buffer = storage.read_buffer(key, len(blobs[key]))
        results[key] = b"" if buffer is None else bytes(buffer)

    threads = [threading.Thread(target=read, args=(k,)) for k in blobs for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "readers sharing the budget deadlocked"
    assert results == blobs


@pytest.mark.usefixtures("plain_by_default")
def test_restore_through_small_parts_is_bit_exact_and_catches_damage(
    object_root: str, parts
) -> None:
    state = {"w": jnp.arange(4096, dtype=jnp.float32), "b": jnp.ones((3, 5), jnp.int8)}
    with jaxckpt.CheckpointManager(object_root, storage_options=parts) as mgr:
        mgr.save(1, state)
    mgr = jaxckpt.CheckpointManager(object_root, read_only=True, storage_options=parts)
    restored = mgr.restore(1, target=state)
    for name in state:
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(state[name]))
    servers.corrupt_object(chunk_path(object_root, 1, "w", 0), offset=9_000)
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"step 1: \['w'\]: chunk c/0"):
        mgr.restore(1)


@pytest.mark.usefixtures("plain_by_default")
def test_restore_reports_a_truncated_chunk_by_its_size(object_root: str, parts) -> None:
    with jaxckpt.CheckpointManager(object_root, storage_options=parts) as mgr:
        mgr.save(1, {"w": jnp.arange(4096, dtype=jnp.float32)})
    storage = open_storage(object_root)
    key = chunk_path(object_root, 1, "w", 0)[len(object_root.rstrip("/")) + 1 :]
    storage.write(key, (storage.read(key) or b"")[:5000])
    mgr = jaxckpt.CheckpointManager(object_root, read_only=True, storage_options=parts)
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"chunk c/0 .*size 5000 != recorded"):
        mgr.restore(1)


@pytest.mark.parametrize(
    "options",
    [
        {"read_part_bytes": 0},
        {"read_ahead_bytes": -1},
        {"read_part_bytes": 1.5},
        {"direct_reads": "yes"},
    ],
)
def test_read_options_are_validated(options: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        open_storage("s3://bucket/p", **options)


@pytest.mark.usefixtures("plain_by_default")
def test_saved_array_metadata_is_what_tensorstore_create_writes(tmp_path) -> None:
    """Saves write zarr.json themselves (assume_metadata): the bytes TensorStore would."""
    import json

    import tensorstore as ts

    root = str(tmp_path / "root")
    state = {"w": jnp.zeros((6, 4), jnp.bfloat16), "i": jnp.arange(7, dtype=jnp.int32)}
    with jaxckpt.CheckpointManager(root, chunk_bytes=16) as mgr:
        mgr.save(1, state)
    for name, value in state.items():
        array_dir = chunk_path(root, 1, name).rsplit("/c/", 1)[0]
        with open(array_dir + "/zarr.json", "rb") as f:
            stored = f.read()
        spec = {"driver": "zarr3", "kvstore": {"driver": "memory"}, "metadata": json.loads(stored)}
        created = ts.open(spec, create=True).result().kvstore.read("zarr.json").result().value
        assert stored == created, name
        # TensorStore's own zarr reader opens the array and reads the saved values.
        kvstore = {"driver": "file", "path": array_dir + "/"}
        read = ts.open({"driver": "zarr3", "kvstore": kvstore}, read=True).result().read().result()
        np.testing.assert_array_equal(read, np.asarray(value))


@pytest.mark.usefixtures("plain_by_default")
def test_a_save_sends_one_request_per_array_record_and_chunk(s3_server: servers.Server) -> None:
    """The round trips removed by issue 14 stay removed: no GET/HEAD of array metadata."""
    import re

    root = f"s3://{s3_server.bucket}/requests-{uuid.uuid4().hex[:8]}"
    state = {f"a{i}": jnp.full((2, 8), i, jnp.float32) for i in range(4)}
    with jaxckpt.CheckpointManager(root, chunk_bytes=32) as mgr:  # 2 chunks per array
        start = s3_server.log_path.stat().st_size
        mgr.save(1, state)
        mgr.wait()
        # the log is complete: each server logs a request before it answers it
        with open(s3_server.log_path, "rb") as f:
            f.seek(start)
            log = f.read().decode("utf-8", "replace")
    requests = re.findall(r'"(?:\x1b\[[0-9;]*m)*([A-Z]+) (\S+) HTTP', log)
    arrays = [(m, p) for m, p in requests if "/arrays/a" in p]
    metadata = [m for m, p in arrays if p.endswith("/zarr.json")]
    chunks = [m for m, p in arrays if "/c/" in p]
    assert metadata == ["PUT"] * 4, arrays
    assert chunks == ["PUT"] * 8, arrays


def test_restore_memory_budget_bounds_the_response_bytes_in_flight(object_root: str) -> None:
    state = {f"w{i}": jnp.arange(2048 + i, dtype=jnp.float32) for i in range(4)}  # ~8 KiB each
    with jaxckpt.CheckpointManager(object_root) as mgr:
        mgr.save(1, state)
    # The storage option: restore_memory_bytes refuses budgets under 1 MiB.
    mgr = jaxckpt.CheckpointManager(
        object_root,
        read_only=True,
        storage_options={"read_ahead_bytes": 3000, **THROUGH_TENSORSTORE},
    )
    restored = mgr.restore(1, target=state)
    for name in state:
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(state[name]))
    reader = mgr._storage._ranged  # type: ignore[attr-defined]
    assert reader._part == 600  # a fifth of the budget: two parts in flight, three kept
    assert 0 < reader.peak_inflight_bytes <= 3000 - 3 * 600
    mgr.close()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"restore_memory_bytes": 0}, "restore_memory_bytes"),
        ({"restore_memory_bytes": 1}, "1 MiB"),  # one-byte ranged GETs otherwise
        ({"restore_memory_bytes": 2.5}, "restore_memory_bytes"),
        (
            {"restore_memory_bytes": 1 << 20, "storage_options": {"read_ahead_bytes": 1 << 20}},
            "same budget",
        ),
    ],
)
def test_restore_memory_option_is_validated(options: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        jaxckpt.CheckpointOptions(**options)  # type: ignore[arg-type]


_RETURNED = """
import numpy as np
from jaxckpt.storage import aligned_empty
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
np.ones(16 << 20, np.uint8)  # glibc now keeps 16 MiB heap blocks: a malloc'd buffer would stay
before = rss()
buffers = [aligned_empty(4 << 20) for _ in range(8)]
for b in buffers:
    assert b.ctypes.data % 4096 == 0 and b.flags.writeable
    b[:] = 1
held = rss() - before
del buffers, b
print(held >> 20, (rss() - before) >> 20)
"""


def test_large_restore_buffers_are_their_own_pages_and_go_back_when_dropped() -> None:
    """Restored arrays never share heap pages with transient responses (Linux)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _RETURNED], capture_output=True, text=True, check=True
    )
    held, kept = (int(x) for x in out.stdout.split())
    assert held >= 30, out.stdout  # 32 MiB written
    assert kept <= 2, out.stdout


def test_every_part_is_placed_by_one_thread(object_root: str, monkeypatch) -> None:
    """Responses become bytes on one thread: one malloc arena reuses their memory."""
    from jaxckpt.storage import _ranged

    placers: set[int] = set()
    place = _ranged.RangedReader._place

    def recording(self, *args):  # type: ignore[no-untyped-def]
        placers.add(threading.get_ident())
        return place(self, *args)

    monkeypatch.setattr(_ranged.RangedReader, "_place", recording)
    state = {f"w{i}": jnp.arange(4096 + i, dtype=jnp.float32) for i in range(8)}
    options = {**SMALL_PARTS, **THROUGH_TENSORSTORE}
    with jaxckpt.CheckpointManager(object_root, storage_options=options) as mgr:
        mgr.save(1, state)
        restored = mgr.restore(1, target=state)
    for name in state:
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(state[name]))
    assert len(placers) == 1, placers
    assert threading.get_ident() not in placers


def test_default_restore_budget_is_a_tenth_of_the_restore(object_root: str) -> None:
    storage = open_storage(object_root)
    storage.plan_restore(400 << 20)  # type: ignore[attr-defined]
    reader = storage._ranged  # type: ignore[attr-defined]
    assert (reader.ahead_bytes, reader._part) == (40 << 20, (40 << 20) // 5)
    storage.plan_restore(4 << 30)  # type: ignore[attr-defined]
    assert (reader.ahead_bytes, reader._part) == ((4 << 30) // 10, 16 << 20)  # parts <= 16 MiB
    storage.plan_restore(1 << 20)  # type: ignore[attr-defined]
    assert (reader.ahead_bytes, reader._part) == (16 << 20, (16 << 20) // 5)  # the floor
    fixed = open_storage(object_root, read_ahead_bytes=3000)
    fixed.plan_restore(400 << 20)  # type: ignore[attr-defined]
    assert fixed._ranged.ahead_bytes == 3000  # type: ignore[attr-defined]


@pytest.mark.usefixtures("plain_by_default")
def test_a_saved_step_is_restored_without_reading_its_zarr_json(
    object_root: str, monkeypatch
) -> None:
    """Its manifest says the codec chain (``"codecs": "bytes+crc32c"``): one GET per leaf less."""
    from jaxckpt.records import PLAIN_CODECS
    from jaxckpt.restoring import _stepreader as _restore

    state = {f"w{i}": jnp.arange(1000 + i, dtype=jnp.float32) for i in range(3)}
    with jaxckpt.CheckpointManager(object_root) as mgr:
        mgr.save(1, state)
        mgr.wait()
        marker = mgr._protocol.require_marker(1)  # type: ignore[attr-defined]
        loaded = _restore.load_step(mgr._protocol, marker)  # type: ignore[attr-defined]
        assert loaded.plain_codecs
        manifests = marker.manifest_names()
        raw = mgr._protocol.read_step_file(marker, manifests[0])  # type: ignore[attr-defined]
        assert f'"codecs":"{PLAIN_CODECS}"' in raw.decode().replace(" ", "")

        def no_zarr_json(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("zarr.json read")

        monkeypatch.setattr(_restore, "plain_leaves", no_zarr_json)
        restored = mgr.restore(1, target=state)
    for name in state:
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(state[name]))
