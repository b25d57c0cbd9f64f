"""The packed layout's write budget (``jaxckpt/records/_writebudget.py``): the pack count
follows the job's process count and the store's write rate, in the saves and in the model
(``jaxckpt plan --processes``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from trees import assert_tree_bitexact

import jaxckpt
from jaxckpt import cli
from jaxckpt.commit import CommitProtocol
from jaxckpt.planning import scale_plan
from jaxckpt.planning._measured import measured_profile
from jaxckpt.records import (
    GCS_WRITES_PER_S,
    MAX_PACKS,
    MIN_PACK_BYTES,
    S3_WRITES_PER_PREFIX_S,
    SPREAD_SLOTS,
    pack_count,
    store_writes_per_s,
    uploads_within,
)
from jaxckpt.records._writebudget import (
    CONN_BYTES_PER_S,
    MAX_MERGED_PACK_BYTES,
    REQUEST_RTT_S,
    budget_packs,
)
from jaxckpt.storage import LocalStorage, open_storage

CAP = (64 << 20) + (64 << 10)  # CheckpointOptions().max_object_bytes
STATE = 1.1e12  # 70B parameters with Adam
GCS = GCS_WRITES_PER_S
S3 = S3_WRITES_PER_PREFIX_S * SPREAD_SLOTS


def _packs(processes: int, writes_per_s: float | None) -> int:
    return pack_count(
        STATE / processes, max_object_bytes=CAP, processes=processes, writes_per_s=writes_per_s
    )


def test_the_store_rates_by_scheme() -> None:
    assert store_writes_per_s("gs://bucket/run", prefixes=SPREAD_SLOTS) == 1000
    assert store_writes_per_s("s3://bucket/run", prefixes=SPREAD_SLOTS) == 32 * 3500
    assert store_writes_per_s("s3://bucket/run", prefixes=1) == 3500
    assert store_writes_per_s("/local/run", prefixes=SPREAD_SLOTS) is None


@pytest.mark.parametrize(
    ("processes", "gcs", "s3"),
    [
        (1, 16376, 16376),  # a share far over the memory bound: the cap's count, as before
        (16, 1024, 1024),
        (1024, 4, 16),  # GCS: 4 packs of 268 MB, not 16 of 67 MB
        (8192, 1, 5),  # 134 MB a process: one object on GCS, 5 on S3 (was 16)
    ],
)
def test_the_pack_count_at_1_16_and_8192_processes(processes: int, gcs: int, s3: int) -> None:
    assert _packs(processes, None) == max(MAX_PACKS, -(-STATE / processes // CAP))
    assert (_packs(processes, GCS), _packs(processes, S3)) == (gcs, s3)
    for rate in (GCS, S3):
        packs = _packs(processes, rate)
        size = STATE / processes / packs
        assert size <= min(MAX_MERGED_PACK_BYTES, (MAX_PACKS + 1) * CAP)
        # the bytes in flight stay within the memory bound without a budget
        assert uploads_within(size, MAX_PACKS, CAP) * size <= (MAX_PACKS + 1) * CAP


def test_the_jobs_packs_at_8192_processes_fit_a_new_gcs_bucket_in_a_minute() -> None:
    before = 8192 * (_packs(8192, None) + 1) / GCS  # + each process's manifest part
    after = 8192 * (_packs(8192, GCS) + 1) / GCS
    assert before > 120 and after < 20


@pytest.mark.parametrize("processes", [1, 2, 4, 16])
@pytest.mark.parametrize("nbytes", [1e3, 1e4, 1e6, 64e6, 1e9, 64e9, 1e12])
@pytest.mark.parametrize("smallest", [1, 1000, MIN_PACK_BYTES])
def test_one_process_and_small_jobs_keep_the_count_of_a_save_without_budget(
    processes: int, nbytes: float, smallest: int
) -> None:
    """S3's budget over 32 prefixes never changes a small job's count; nor GCS's for one
    process (the bench's cloud profile and the scale bench's 2-16 processes on moto):
    their packs take the store less than a round trip."""
    args = {"max_object_bytes": CAP, "min_pack_bytes": smallest}
    plain = pack_count(nbytes, **args)
    assert pack_count(nbytes, processes=processes, writes_per_s=S3, **args) == plain
    if processes == 1:
        assert pack_count(nbytes, writes_per_s=GCS, **args) == plain


@pytest.mark.parametrize(
    ("nbytes", "processes", "rate", "cap"),
    [
        (1.07e9, 1024, GCS, CAP),
        (1.34e8, 8192, GCS, CAP),
        (8.6e9, 128, GCS, CAP),  # a share over the memory bound: more, smaller packs
        (1.34e8, 8192, S3, CAP),
        (3e8, 256, GCS, None),
        (5e7, 64, GCS, 1 << 20),
    ],
)
def test_the_budget_takes_the_quickest_count(
    nbytes: float, processes: int, rate: float, cap: int | None
) -> None:
    """Against every count in the range: the job's packs at the store's rate, or the bytes
    over the uploads in flight, whichever is longer, is shortest at the count chosen."""

    def step_s(packs: int) -> float:
        flying = min(packs, uploads_within(nbytes / packs, 16, cap))
        return max(processes * packs / rate, REQUEST_RTT_S + nbytes / (flying * CONN_BYTES_PER_S))

    fewest, most = 1, 4 * 16 + 64
    chosen = budget_packs(
        nbytes,
        processes=processes,
        writes_per_s=rate,
        uploads=16,
        max_object_bytes=cap,
        fewest=fewest,
        most=most,
    )
    assert step_s(chosen) == min(step_s(p) for p in range(fewest, most + 1))
    with pytest.raises(ValueError, match="fewest"):
        budget_packs(
            1, processes=1, writes_per_s=1, uploads=1, max_object_bytes=None, fewest=2, most=1
        )


def test_larger_packs_upload_fewer_at_once_within_the_same_bytes() -> None:
    assert uploads_within(CAP, 16, CAP) == 16
    assert uploads_within(4 * CAP, 16, CAP) == 4  # 17 caps' worth in flight at most
    assert uploads_within(17 * CAP, 16, CAP) == 1
    assert uploads_within(1 << 30, 16, None) == 16


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_the_model_meets_10_s_at_1024_and_60_s_at_8192_processes(store: str) -> None:
    rows = scale_plan(
        processes=[1024, 8192], profile=measured_profile(), stores=[store], prefixes=32
    )
    for r in rows:
        assert r.time_s < (10 if r.processes == 1024 else 60), r
    fixed = scale_plan(
        processes=[1024, 8192],
        profile=measured_profile(),
        stores=[store],
        prefixes=32,
        write_budget=False,
    )
    for new, old in zip(rows, fixed, strict=True):
        assert new.cluster_writes <= old.cluster_writes
    if store == "gcs":  # before: 156k writes a step at 8,192 processes; now 33k
        old_save, new_save = fixed[2], rows[2]
        assert (old_save.processes, old_save.phase) == (8192, "save")
        assert old_save.time_s > 120 and new_save.cluster_writes < old_save.cluster_writes / 4


def test_cli_compares_the_budget_with_the_fixed_count(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--processes", "8192", "--stores", "gcs"]
    assert cli.main(argv) == 0
    budget = capsys.readouterr().out
    assert cli.main([*argv, "--packs", "fixed"]) == 0
    fixed = capsys.readouterr().out
    plan = {
        budgeted: scale_plan(
            processes=[8192],
            profile=measured_profile(),
            stores=["gcs"],
            prefixes=32,
            write_budget=budgeted,
        )[0]
        for budgeted in (True, False)
    }  # the save row's writes, as the table prints them
    assert plan[True].cluster_writes < plan[False].cluster_writes / 4
    assert "under each store's write rate" in budget
    assert f"{plan[True].cluster_writes:,.0f} /" in budget
    assert "without the store's write budget" in fixed
    assert f"{plan[False].cluster_writes:,.0f} /" in fixed


@contextlib.contextmanager
def _counting_uploads(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts pack uploads at once (``peak``) on local roots."""
    original = LocalStorage.start_write
    seen = {"now": 0, "peak": 0}
    lock = threading.Lock()

    def start_write(self: LocalStorage, key: str, pieces: list[bytes]) -> Callable[[], None]:
        pack = "/packs/" in key
        with lock:
            seen["now"] += pack
            seen["peak"] = max(seen["peak"], seen["now"])
        try:
            wait = original(self, key, pieces)  # type: ignore[arg-type]
            wait()
            return wait
        finally:
            with lock:
                seen["now"] -= pack

    monkeypatch.setattr(LocalStorage, "start_write", start_write)
    yield seen


def test_a_save_under_a_tight_budget_writes_fewer_larger_packs_and_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store absorbing one write a second: the save merges its packs up to the memory
    bound (17 caps each), uploads one at a time, and restores bit-exactly; the commit,
    ``verify`` and the restore take the packs from the manifest."""
    from jaxckpt import _pools
    from jaxckpt.formats import _packed, writers
    from jaxckpt.tools import _copy

    rng = np.random.default_rng(7)
    state = {
        f"l{i:02d}": jnp.asarray(rng.standard_normal(8192, dtype=np.float32)) for i in range(48)
    }
    cap = 64 << 10  # 48 leaves of 32 KiB: 24 packs at this cap without a budget
    monkeypatch.setattr(_packed, "MIN_PACK_BYTES", 1)
    monkeypatch.setattr(writers, "store_writes_per_s", lambda uri, prefixes: 1.0)
    limits: list[int] = []
    borrow = _pools.borrow
    monkeypatch.setattr(
        _packed.pools,
        "borrow",
        lambda name, n: (limits.append(n) if name in ("pack", "copy") else 0, borrow(name, n))[1],
    )
    root = str(tmp_path / "root")
    with (
        _counting_uploads(monkeypatch) as uploads,
        jaxckpt.CheckpointManager(root, layout="packed", max_object_bytes=cap) as mgr,
    ):
        assert mgr.save(1, state)
    protocol = CommitProtocol(open_storage(root))
    (part,) = protocol.read_manifest(protocol.require_marker(1))
    stored = sum(part.packs.values())
    expected = pack_count(stored, min_pack_bytes=1, max_object_bytes=cap, writes_per_s=1.0)
    assert len(part.packs) == expected == 2, dict(part.packs)
    assert cap < max(part.packs.values()) <= 17 * cap
    assert limits == [1]  # ~786 KB packs: one in flight holds what 17 of 64 KiB would
    assert uploads["peak"] == 1
    reader = jaxckpt.CheckpointManager(root, read_only=True)
    assert_tree_bitexact(reader.restore(target=state), state)
    report = reader.verify(1)
    assert report.ok, report.problems
    # cp holds fewer large packs at once: here one, at a 1 MiB bound
    monkeypatch.setattr(_copy, "COPY_BYTES_IN_FLIGHT", 1 << 20)
    limits.clear()
    other = str(tmp_path / "other")
    assert cli.main(["cp", f"{root}:1", other]) == 0
    assert limits == [1, 16]  # the packs, then the manifest part
    assert_tree_bitexact(jaxckpt.CheckpointManager(other).restore(target=state), state)


def test_a_local_tiers_packs_are_sized_for_the_durable_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Promotion copies a local tier's packs unchanged, so the local tier's writer takes
    the durable root's write rate: a durable store absorbing one write a second gets the
    merged packs, not the local disk's count."""
    from jaxckpt.formats import _packed, writers

    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    asked: list[str] = []

    def rate(uri: str, prefixes: int) -> float | None:
        asked.append(uri)
        return 1.0 if uri == durable else None

    monkeypatch.setattr(_packed, "MIN_PACK_BYTES", 1)
    monkeypatch.setattr(writers, "store_writes_per_s", rate)
    rng = np.random.default_rng(8)
    state = {f"l{i:02d}": rng.standard_normal(8192).astype(np.float32) for i in range(48)}
    cap = 64 << 10  # 24 packs at this cap without a budget
    with jaxckpt.CheckpointManager(
        durable, layout="packed", max_object_bytes=cap, local_root=local
    ) as mgr:
        assert mgr.save(1, state)
    assert set(asked) == {durable}
    protocol = CommitProtocol(open_storage(durable))
    (part,) = protocol.read_manifest(protocol.require_marker(1))  # promoted as written
    assert len(part.packs) == 2, dict(part.packs)
    restored = jaxckpt.CheckpointManager(durable, read_only=True).restore(target=state)
    assert_tree_bitexact(restored, state)
