"""The packed layout (``layout="packed"``): a few pack objects per process, on every backend.

The plain layout's contract (``test_backends``) holds here too: commit protocol,
CRC32C checked on every read naming the chunk, ``verify``, ``cp``, mixed roots;
on top, each process writes at most four data objects per step whatever the
number of leaves, and a restore reads only the byte ranges it needs.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from benchkit import servers
from rootpaths import data_objects, packed_chunk, step_key, step_object
from trees import assert_tree_bitexact, sample_state
from triggers import HANG_S

import jaxckpt
from jaxckpt import cli
from jaxckpt.commit import CommitProtocol
from jaxckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from jaxckpt.records import MAX_PACKS, pack_count
from jaxckpt.records._step import (
    FORMAT_VERSION,
    PACKED_VERSION,
    ChunkRecord,
    ManifestPart,
    _check_version,
    crc32c,
    dumps,
)
from jaxckpt.storage import LocalStorage, open_storage


def many_leaves(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {f"l{i:03d}": jnp.asarray(rng.standard_normal(64, dtype=np.float32)) for i in range(n)}


def test_round_trip_verify_and_at_most_four_objects(storage_root: str) -> None:
    state = {**sample_state(3), "many": many_leaves(60, 3)}
    with jaxckpt.CheckpointManager(storage_root, layout="packed", chunk_bytes=128) as mgr:
        assert mgr.save(3, state)
    objects = data_objects(storage_root, 3)
    prefix = step_key(storage_root, 3)
    # 60 + 13 array leaves in >150 chunks, all in one pack object of process 0.
    assert objects == [step_object(storage_root, 3, "packs/0.0.bin")]
    assert not [k for k in open_storage(storage_root).list(prefix) if "/arrays/l0" in k]
    reader = jaxckpt.CheckpointManager(storage_root, read_only=True)
    assert_tree_bitexact(reader.restore(target=state), state)
    report = reader.verify(3)
    assert report.ok, report.problems
    assert report.chunks_checked > 150


def test_pack_count_is_bounded_and_packs_are_filled_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert [pack_count(n, min_pack_bytes=100) for n in (0, 1, 100, 101, 399, 10**9)] == [
        0,
        1,
        1,
        2,
        4,
        MAX_PACKS,
    ]
    # The cap adds packs beyond MAX_PACKS: bytes over the cap, rounded up.
    assert pack_count(10**9, min_pack_bytes=100, max_object_bytes=10**6) == 1000
    from jaxckpt.formats import _packed as _pack

    root = str(tmp_path / "root")
    state = many_leaves(40, 1)  # 40 x 260 stored bytes
    monkeypatch.setattr(_pack, "MIN_PACK_BYTES", 1000)  # 10,400 bytes: split in 4
    with jaxckpt.CheckpointManager(root, layout="packed", objects_in_flight=4) as mgr:
        mgr.save(1, state)
    packs = sorted(step_object(root, 1, f"packs/0.{k}.bin") for k in range(4))
    assert data_objects(root, 1) == packs
    assert len({k.split("/")[1] for k in packs}) > 1  # one process's packs: several prefixes
    sizes = {
        k.rsplit("/", 2)[-2] + "/" + k.rsplit("/", 1)[-1]: Path(root, k).stat().st_size
        for k in data_objects(root, 1)
    }
    protocol = CommitProtocol(open_storage(root))
    (part,) = protocol.read_manifest(protocol.require_marker(1))
    assert dict(part.packs) == sizes
    chunks = sorted((c.pack, c.offset, c.size) for cs in part.arrays.values() for c in cs)
    assert len(chunks) == 40 and all(size == 260 for _, _, size in chunks)
    # Chunks start 64-byte aligned, back to back up to the padding; each pack ends with one.
    assert all(offset % 64 == 0 for _, offset, _ in chunks)
    for (p1, o1, _), (p2, o2, _) in itertools.pairwise(chunks):
        assert o2 == 0 if p2 != p1 else o2 == o1 + 320
    assert {p: max(o + s for q, o, s in chunks if q == p) for p, _, _ in chunks} == sizes
    assert_tree_bitexact(jaxckpt.CheckpointManager(root).restore(target=state), state)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_no_pack_exceeds_max_object_bytes_and_packs_upload_at_once(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    from jaxckpt.formats import _packed as _pack

    if kind == "s3":
        server: servers.Server = request.getfixturevalue("s3_server")
        root = f"s3://{server.bucket}/maxobj-{tmp_path.name}"
    else:
        root = str(tmp_path / "root")
    rng = np.random.default_rng(5)
    # 200 leaves of 4 KiB + 8 of 64 KiB: 1.3 MiB, 8 packs at a 192 KiB cap (not 4)
    state = {
        f"s{i:03d}": jnp.asarray(rng.standard_normal(1024, dtype=np.float32)) for i in range(200)
    }
    state |= {f"b{i}": jnp.asarray(rng.standard_normal(16384, dtype=np.float32)) for i in range(8)}
    cap = 192 << 10
    storage_type = type(open_storage(root))
    original_start = storage_type.start_write
    in_flight = peak = packs_in_flight = 0
    lock = threading.Lock()
    overlapped = threading.Event()  # two pack uploads were in flight at once

    def start_write(self: object, key: str, pieces: list[bytes]) -> Callable[[], None]:
        nonlocal in_flight, peak, packs_in_flight
        pack = "/packs/" in key
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
            packs_in_flight += pack
            if packs_in_flight >= 2:
                overlapped.set()
        try:
            if pack:  # held until the next pack has started (a serial writer: until HANG_S)
                overlapped.wait(HANG_S)
            wait = original_start(self, key, pieces)  # type: ignore[arg-type]
            wait()
            return wait
        finally:
            with lock:
                in_flight -= 1
                packs_in_flight -= pack

    monkeypatch.setattr(_pack, "MIN_PACK_BYTES", 1)
    monkeypatch.setattr(storage_type, "start_write", start_write)
    with jaxckpt.CheckpointManager(root, layout="packed", max_object_bytes=cap) as mgr:
        mgr.save(1, state)
    monkeypatch.undo()
    storage = open_storage(root)
    protocol = CommitProtocol(storage)
    (part,) = protocol.read_manifest(protocol.require_marker(1))
    assert len(part.packs) >= 7 and max(part.packs.values()) <= cap, dict(part.packs)
    objects = data_objects(root, 1)
    assert len(objects) == len(part.packs)
    assert peak > 1  # several packs were uploading at once
    assert_tree_bitexact(jaxckpt.CheckpointManager(root).restore(target=state), state)


def test_max_object_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_object_bytes"):
        jaxckpt.CheckpointOptions(max_object_bytes=0)


def test_power_of_two_chunks_fill_packs_under_a_cap_with_headroom(tmp_path: Path) -> None:
    """The default cap is 64 MiB plus ``OBJECT_HEADROOM_BYTES``: a 64 MiB leaf is one chunk,
    and power-of-two chunks fill a pack whole. Scaled down: 80 chunks of 256 KiB under a
    cap of 1 MiB + headroom go 4 to a pack; under exactly 1 MiB only 3 fit (the checksums
    and alignment take the rest), so the same state needs more, emptier packs."""
    from jaxckpt._options import OBJECT_HEADROOM_BYTES

    defaults = jaxckpt.CheckpointOptions()
    assert defaults.max_object_bytes == (64 << 20) + OBJECT_HEADROOM_BYTES
    assert defaults.stored_chunk_bytes == 64 << 20  # a 64 MiB leaf is one chunk
    rng = np.random.default_rng(9)
    state = {f"l{i:02d}": jnp.asarray(rng.standard_normal(1 << 16, dtype=np.float32))
             for i in range(80)}  # fmt: skip
    counts = {}
    for name, cap in {"headroom": (1 << 20) + OBJECT_HEADROOM_BYTES, "exact": 1 << 20}.items():
        root = str(tmp_path / name)
        with jaxckpt.CheckpointManager(root, layout="packed", max_object_bytes=cap) as mgr:
            mgr.save(1, state)
            assert_tree_bitexact(mgr.restore(1, target=state), state)
        protocol = CommitProtocol(open_storage(root))
        (part,) = protocol.read_manifest(protocol.require_marker(1))
        assert max(part.packs.values()) <= cap, part.packs
        per_pack = Counter(c.pack for c in itertools.chain(*part.arrays.values()))
        counts[name] = (len(part.packs), sorted(set(per_pack.values())))
    assert counts == {"headroom": (20, [4]), "exact": (27, [2, 3])}, counts


def test_corrupt_chunk_is_named_and_restore_falls_back(storage_root: str) -> None:
    with jaxckpt.CheckpointManager(storage_root, layout="packed", chunk_bytes=512) as mgr:
        mgr.save(1, {"w": jnp.arange(1024.0)})
        mgr.save(2, {"w": jnp.arange(1024.0) * 2})
    uri, offset, size = packed_chunk(storage_root, 2, "w", 3)
    assert size == 512 + 4
    servers.corrupt_object(uri, offset + 17)
    mgr = jaxckpt.CheckpointManager(storage_root)
    with pytest.raises(
        CorruptCheckpointError, match=r"step 2: \['w'\]: chunk c/3 .*pack packs/0.0.bin.*checksum"
    ):
        mgr.restore(2)
    np.testing.assert_array_equal(mgr.restore()["w"], np.arange(1024.0))
    report = mgr.verify(2)
    assert not report.ok
    assert [(p.chunk, "checksum mismatch" in p.message) for p in report.problems] == [("c/3", True)]
    assert mgr.verify(1).ok


def test_a_slice_reads_only_the_byte_ranges_it_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(tmp_path / "root")
    w = np.arange(4096, dtype=np.float32)
    with jaxckpt.CheckpointManager(root, layout="packed", chunk_bytes=1024) as mgr:
        mgr.save(1, {"w": w, "other": np.ones(4096, np.float32)})
    reads: list[tuple[str, int, int]] = []
    original = LocalStorage.read_range

    def spy(self: LocalStorage, key: str, offset: int, size: int) -> object:
        reads.append((key.rsplit("/", 1)[-1], offset, size))
        return original(self, key, offset, size)

    monkeypatch.setattr(LocalStorage, "read_range", spy)
    step = jaxckpt.open_step(root)
    np.testing.assert_array_equal(step["w"][300:600], w[300:600])
    _, off1, _ = packed_chunk(root, 1, "w", 1)
    _, off2, _ = packed_chunk(root, 1, "w", 2)
    # Chunks of 256 elements: [300, 600) overlaps chunks 1 and 2, which lie side by side
    # in the pack: one ranged read of exactly their bytes, nothing else.
    assert off2 == off1 + 1088  # 1,028 bytes, padded to 64-byte alignment
    assert reads == [("0.0.bin", off1, 1088 + 1028)]
    reads.clear()
    np.testing.assert_array_equal(step["w"][2900], w[2900])
    _, off11, _ = packed_chunk(root, 1, "w", 11)
    assert reads == [("0.0.bin", off11, 1028)]
    reads.clear()
    # A whole restore reads each pack in runs of adjacent chunks: 2 leaves, 1 pack, 1 run.
    out = jaxckpt.CheckpointManager(root, read_only=True).restore(1)
    np.testing.assert_array_equal(out["w"], w)
    assert len(reads) == 1 and reads[0][2] == 31 * 1088 + 1028


def test_damaged_packs_fail_loudly(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root, layout="packed", chunk_bytes=256) as mgr:
        mgr.save(1, {"w": jnp.arange(256.0)})  # 4 chunks of 64 float32
    uri, offset, _ = packed_chunk(root, 1, "w", 3)
    Path(uri).write_bytes(Path(uri).read_bytes()[: offset + 10])  # truncated in chunk c/3
    mgr = jaxckpt.CheckpointManager(root, fallback_on_corrupt=False)
    with pytest.raises(CorruptCheckpointError, match=r"chunk c/3 .*size 10 != recorded 260"):
        mgr.restore(1)
    assert [p.chunk for p in mgr.verify(1).problems] == ["c/3"]
    Path(uri).unlink()
    with pytest.raises(CorruptCheckpointError, match=r"chunk c/0 .*missing"):
        mgr.restore(1)
    assert [p.chunk for p in mgr.verify(1).problems] == ["c/0", "c/1", "c/2", "c/3"]


def test_commit_refuses_when_a_pack_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(tmp_path / "root")
    original = LocalStorage.start_write

    def lose_packs(self: LocalStorage, key: str, pieces: list[bytes]) -> Callable[[], None]:
        if "/packs/" in key:  # a store that acknowledged the pack but lost it
            return lambda: None
        return original(self, key, pieces)

    with jaxckpt.CheckpointManager(root, layout="packed") as mgr:
        mgr.save(1, {"w": jnp.arange(8.0)})
        mgr.wait()
        monkeypatch.setattr(LocalStorage, "start_write", lose_packs)
        mgr.save(2, {"w": jnp.arange(8.0)})
        with pytest.raises(
            jaxckpt.SaveFailedError, match=r"chunk c/0 of w .*packs/0.0.bin.* missing"
        ):
            mgr.wait()
        monkeypatch.undo()
    assert jaxckpt.CheckpointManager(root).steps() == [1]


def test_plain_and_packed_steps_share_a_root_and_the_cli_reads_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, other = str(tmp_path / "root"), str(tmp_path / "other")
    states = {s: {"w": jnp.arange(300.0) * s, "n": s} for s in (1, 2, 3)}
    for step, layout in [(1, "plain"), (2, "packed"), (3, "plain")]:
        with jaxckpt.CheckpointManager(root, layout=layout, chunk_bytes=256) as mgr:
            mgr.save(step, states[step])
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    for step in (1, 2, 3):
        assert_tree_bitexact(mgr.restore(step, target=states[step]), states[step])
    assert cli.main(["ls", root, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in listed["committed"]] == [1, 2, 3]
    assert cli.main(["inspect", root, "2"]) == 0
    out = capsys.readouterr().out
    assert "layout: packed (1 data objects)" in out and "\nw " in out
    assert cli.main(["inspect", root, "1", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    (w,) = [x for x in shown["leaves"] if x["path"] == "w"]
    assert (
        shown["layout"] == "plain" and shown["data_objects"] == -(-300 // w["chunk_shape"][0]) > 1
    )
    assert cli.main(["verify", root, "--all"]) == 0
    capsys.readouterr()
    from jaxckpt import zarr_compat

    assert zarr_compat.open_group(root, 3)["w"][:3].tolist() == [0.0, 3.0, 6.0]
    # A packed step through its reference manifest: each chunk a byte range of a pack.
    spec = json.loads(json.dumps(zarr_compat.reference_manifest(root, 2)))
    chunk_refs = [v for k, v in spec["refs"].items() if k.startswith("w/c/")]
    assert len(chunk_refs) > 1 and all(r[0].endswith("packs/0.0.bin") for r in chunk_refs)
    packed_w = zarr_compat.open_group(root, 2)["w"]
    assert packed_w[:].tobytes() == (np.arange(300.0, dtype=np.float32) * 2).tobytes()
    assert packed_w[70:75].tolist() == [140.0, 142.0, 144.0, 146.0, 148.0]
    assert cli.main(["export", f"{root}:2", str(tmp_path / "st")]) == 0
    capsys.readouterr()
    from safetensors.numpy import load_file

    (exported,) = (tmp_path / "st").glob("*.safetensors")
    np.testing.assert_array_equal(load_file(exported)["w"], np.arange(300.0, dtype=np.float32) * 2)
    assert cli.main(["diff", f"{root}:2", f"{root}:2"]) == 0
    capsys.readouterr()

    assert cli.main(["cp", f"{root}:2", other]) == 0
    capsys.readouterr()
    assert [k.rsplit("/", 2)[-2:] for k in data_objects(other, 2)] == [["packs", "0.0.bin"]]
    copied = jaxckpt.CheckpointManager(other, read_only=True)
    assert_tree_bitexact(copied.restore(2, target=states[2]), states[2])
    assert copied.verify(2).ok

    # --compress re-encodes a packed step into zstd zarr chunk objects (an archive).
    archive = str(tmp_path / "z")
    assert cli.main(["cp", f"{root}:2", archive, "--compress", "zstd"]) == 0
    capsys.readouterr()
    assert not [k for k in open_storage(archive).list("") if "/packs/" in k]
    zipped = jaxckpt.CheckpointManager(archive, read_only=True)
    assert_tree_bitexact(zipped.restore(2, target=states[2]), states[2])
    assert zipped.verify(2).ok

    uri, offset, _ = packed_chunk(root, 2, "w", 1)
    servers.corrupt_object(uri, offset)
    assert cli.main(["cp", f"{root}:2", str(tmp_path / "third")]) != 0
    assert "chunk c/1" in capsys.readouterr().err
    assert jaxckpt.CheckpointManager(str(tmp_path / "third"), read_only=True).steps() == []


def test_manifest_records_round_trip_and_older_readers_refuse_packed_steps() -> None:
    packed = ChunkRecord(key="c/1", size=12, crc32c=7, pack="packs/0.0.bin", offset=24)
    plain = ChunkRecord(key="c/0", size=12, crc32c=7)
    part = ManifestPart(
        step=1,
        process=0,
        num_processes=1,
        arrays={"w": (packed,), "v": (plain,)},
        layout="packed",
        packs={"packs/0.0.bin": 36},
    )
    data = part.to_bytes()
    assert ManifestPart.from_bytes(data, "m") == part
    # An older reader (of format 2, before packing, or 3) reads records with this check,
    # up to its own version: it refuses.
    with pytest.raises(UnsupportedFormatError, match=f"version {FORMAT_VERSION}"):
        _check_version(json.loads(data), "manifest/0.json", newest=PACKED_VERSION)
    plain_part = ManifestPart(step=1, process=0, num_processes=1, arrays={"v": (plain,)})
    assert json.loads(plain_part.to_bytes())["version"] == FORMAT_VERSION
    assert json.loads(plain_part.to_bytes())["arrays"] == {"v": [["c/0", 12, 7]]}
    bad_obj = json.loads(data.replace(b'"packs/0.0.bin",24', b'"packs/0.0.bin"'))
    bad_obj.pop("part_crc32c")  # resealed: the record itself is what is refused
    bad = dumps({**bad_obj, "part_crc32c": crc32c(dumps(bad_obj))})
    with pytest.raises(CorruptCheckpointError, match="malformed chunk record"):
        ManifestPart.from_bytes(bad, "m")
    with pytest.raises(ValueError, match="layout"):
        jaxckpt.CheckpointOptions(layout="zip")


def test_object_store_spans_arrive_aligned_in_parts_and_a_short_pack_is_named(
    object_root: str,
) -> None:
    with jaxckpt.CheckpointManager(object_root, layout="packed", chunk_bytes=256) as mgr:
        mgr.save(1, {"w": jnp.arange(256.0)})  # 4 chunks of 64 float32, 260 bytes each
    uri, offset, size = packed_chunk(object_root, 1, "w", 1)
    key = uri.removeprefix(object_root.rstrip("/") + "/")
    storage = open_storage(object_root, read_part_bytes=100)  # a span in 7 ranged GETs
    whole = storage.read(key)
    assert whole is not None
    span = storage.read_range(key, offset, 2 * 320 + size)  # chunks c/1..c/3, padding included
    assert isinstance(span, np.ndarray) and span.flags.writeable
    assert span.ctypes.data % 64 == 0  # chunk slices alias into jax arrays
    assert span.tobytes() == whole[offset : offset + 2 * 320 + size]
    restored = jaxckpt.CheckpointManager(object_root, read_only=True).restore(1)
    np.testing.assert_array_equal(restored["w"], np.arange(256.0, dtype=np.float32))
    _, offset3, _ = packed_chunk(object_root, 1, "w", 3)
    storage.write(key, whole[: offset3 + 10])  # truncated inside chunk c/3
    assert storage.read_range(key, offset3, size) == whole[offset3 : offset3 + 10]
    mgr = jaxckpt.CheckpointManager(object_root, fallback_on_corrupt=False)
    with pytest.raises(CorruptCheckpointError, match=r"chunk c/3 .*size 10 != recorded 260"):
        mgr.restore(1)


def test_packed_is_the_default_layout(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    assert jaxckpt.CheckpointOptions().layout == "packed"
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": jnp.arange(1000.0), "b": jnp.ones(3)})
    assert data_objects(root, 1) == [step_object(root, 1, "packs/0.0.bin")]  # one pack only
    assert_tree_bitexact(
        jaxckpt.CheckpointManager(root).restore(), {"w": jnp.arange(1000.0), "b": jnp.ones(3)}
    )
