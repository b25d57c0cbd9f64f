"""``_keys``: every storage key jaxckpt builds, and its parser, round-trip and sort.

Pure string functions: no storage, no jax. The format-1 keys are checked too,
since roots written before writer epochs are still read.
"""

from __future__ import annotations

import pytest

from jaxckpt.records import _keys as L


def test_attempt_ids_carry_their_epoch_and_start_time_and_never_repeat() -> None:
    ids = {L.new_attempt(7, now=1_700_000_000.9) for _ in range(50)}
    assert len(ids) == 50
    for attempt in ids:
        assert attempt.startswith("e7-1700000000-")
        assert L.parse_attempt(attempt) == (7, 1_700_000_000.0)


@pytest.mark.parametrize(
    "text", ["", "e1-2", "e1-2-", "x1-2-ab", "e1-2-AB", "e-2-ab", "e1-2-ab/", "1-2-ab"]
)
def test_parse_attempt_refuses_what_is_not_an_attempt_id(text: str) -> None:
    assert L.parse_attempt(text) is None


@pytest.mark.parametrize(("step", "epoch"), [(0, 1), (7, 1), (123, 45), (10**12 - 1, 3)])
def test_marker_keys_round_trip(step: int, epoch: int) -> None:
    key = L.marker_key(step, epoch)
    assert key.startswith(L.COMMITS) and key.endswith(f".e{epoch}.json")
    assert L.parse_marker_key(key) == L.MarkerRef(step=step, epoch=epoch, key=key)


def test_format_1_marker_keys_parse_as_epoch_0() -> None:
    key = L.marker_key(42, None)
    assert key == "commits/42.json"
    assert L.parse_marker_key(key) == L.MarkerRef(step=42, epoch=0, key=key)


def test_marker_keys_sort_by_step_as_a_listing_returns_them() -> None:
    steps = [1, 9, 10, 99, 100, 12_345, 999_999_999]
    keys = [L.marker_key(s, e) for s, e in zip(steps, [3, 1, 2, 1, 5, 1, 2], strict=True)]
    assert [L.parse_marker_key(k).step for k in sorted(keys)] == steps  # type: ignore[union-attr]


def test_marker_refs_order_by_step_then_epoch() -> None:
    refs = [L.parse_marker_key(L.marker_key(s, e)) for s, e in [(2, 1), (1, 3), (2, 0), (1, 1)]]
    assert [(r.step, r.epoch) for r in sorted(refs)] == [(1, 1), (1, 3), (2, 0), (2, 1)]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "key",
    [
        "commits/latest.e3",
        "commits/.000000000001.e1.json.1700000000-ab.tmp",
        "commits/1.e2.json",  # a format-2 key always has 12 digits
        "commits/000000000001.e.json",
        "commits/000000000001.e1.json.tmp",
        "pending/000000000001.e1.json",
        "000000000001.e1.json",
        "commits/",
    ],
)
def test_parse_marker_key_refuses_other_keys(key: str) -> None:
    assert L.parse_marker_key(key) is None


def test_latest_hint_keys_are_not_markers() -> None:
    key = L.latest_hint_key(4)
    assert key == "commits/latest.e4" and L.is_latest_hint(key)
    assert not L.is_latest_hint(L.marker_key(4, 4))


def test_a_step_location_names_every_key_of_its_attempt() -> None:
    attempt = L.new_attempt(3, now=100)
    loc = L.StepLocation(5, attempt)
    assert loc.prefix == f"attempts/5/{attempt}/"
    assert loc.tree_key == loc.prefix + "tree.json"
    assert loc.array_prefix("params.w") == loc.prefix + "arrays/params.w/"
    hashed = f"data/{L.spread_bucket(5, attempt, 2)}/5.{attempt}/"
    assert loc.key(L.manifest_name(2)) == hashed + "manifest/2.json"  # slot 2 % 32
    assert loc.key(L.held_manifest_name(34)) == hashed + "manifest/34.held.json"  # 34 % 32
    assert loc.key(L.pack_name(2, 32)) == hashed + "packs/2.32.bin"  # slot (2 + 32) % 32
    assert loc.key(L.pack_name(1, 3)) == (
        f"data/{L.spread_bucket(5, attempt, 4)}/5.{attempt}/packs/1.3.bin"
    )
    assert loc.pending_key == f"pending/5/{attempt}.json"
    assert loc.epoch == 3
    assert str(loc) == f"step 5 (attempt {attempt})"


def test_a_format_1_location_lives_under_steps() -> None:
    loc = L.StepLocation(5)
    assert loc.prefix == "steps/5/" and loc.pending_key == "pending/5.json"
    assert loc.epoch == 0 and str(loc) == "step 5"


def test_pending_keys_round_trip_in_both_formats() -> None:
    for loc in (L.StepLocation(9, L.new_attempt(2)), L.StepLocation(9)):
        assert L.parse_pending_key(loc.pending_key) == loc


@pytest.mark.parametrize(
    "key",
    [
        "pending/9/not-an-attempt.json",
        "pending/x/e1-2-ab.json",
        "pending/9/e1-2-ab",
        "other/9.json",
    ],
)
def test_parse_pending_key_refuses_other_keys(key: str) -> None:
    assert L.parse_pending_key(key) is None


def test_every_data_key_of_an_attempt_parses_to_that_attempt() -> None:
    loc = L.StepLocation(12, L.new_attempt(1))
    keys = [
        loc.tree_key,
        loc.key(L.manifest_name(0)),
        loc.key(L.held_manifest_name(1)),
        loc.array_prefix("w") + "c/0/1",
        loc.key(L.pack_name(0, 0)),
        loc.key(L.pack_name(7, 123)),
        loc.key("zarr.json"),
    ]
    assert {L.parse_data_key(k) for k in keys} == {loc}
    assert [loc.name_of(k) for k in keys[1:]] == [
        "manifest/0.json",
        "manifest/1.held.json",
        "arrays/w/c/0/1",
        "packs/0.0.bin",
        "packs/7.123.bin",
        "zarr.json",
    ]
    other = L.StepLocation(12, L.new_attempt(1))
    assert all(other.name_of(k) is None for k in keys)
    assert L.parse_data_key("steps/3/arrays/w/c/0") == L.StepLocation(3)


@pytest.mark.parametrize(
    "key",
    [
        "attempts/x/e1-2-ab/tree.json",
        "attempts/3/junk/tree.json",
        "attempts/3",
        "steps/x/t",
        "data/0g/3.e1-2-ab/packs/0.0.bin",
        "data/00/3/e1-2-ab/packs/0.0.bin",
        "data/00/x.e1-2-ab/packs/0.0.bin",
        "data/00/3.junk/packs/0.0.bin",
    ],
)
def test_parse_data_key_refuses_keys_outside_any_attempt(key: str) -> None:
    assert L.parse_data_key(key) is None


def test_manifest_names_tell_held_parts_from_ordinary_ones() -> None:
    assert L.is_manifest_name(L.manifest_name(3)) and not L.is_held_manifest_name(
        L.manifest_name(3)
    )
    assert L.is_manifest_name(L.held_manifest_name(3))
    assert L.is_held_manifest_name(L.held_manifest_name(3))
    assert not L.is_manifest_name("tree.json")


def test_epoch_and_promote_keys_round_trip() -> None:
    for n in (1, 2, 10, 12345):
        assert L.parse_epoch_key(L.epoch_key(n)) == n
        assert L.parse_promote_key(L.promote_key(n)) == n
    assert sorted(L.promote_key(s) for s in (10, 9, 100)) == [
        L.promote_key(9),
        L.promote_key(10),
        L.promote_key(100),
    ]
    for key in ("writers/x.json", "writers/1.json.tmp", "writers/.1.json.5-ab.tmp", "1.json"):
        assert L.parse_epoch_key(key) is None
    assert L.parse_promote_key("promote/latest.json") is None


def test_temp_files_are_stale_only_after_the_grace_period() -> None:
    now = 1_700_000_000.0
    young = f"commits/.000000000001.e1.json.{int(now - L.TEMP_GRACE_S) + 1}-ab.tmp"
    old = f"commits/.000000000001.e1.json.{int(now - L.TEMP_GRACE_S)}-ab.tmp"
    assert L.is_temp_key(young) and L.is_temp_key(old)
    assert not L.is_stale_temp_key(young, now)
    assert L.is_stale_temp_key(old, now)
    assert L.is_stale_temp_key("commits/.unstamped", now)  # no time: never a live write's
    assert not L.is_stale_temp_key(L.marker_key(1, 1), now)


@pytest.mark.parametrize(
    ("nbytes", "packs"),
    [
        (0, 0),
        (-1, 0),
        (1, 1),
        (L.MIN_PACK_BYTES, 1),
        (L.MIN_PACK_BYTES + 1, 2),
        (3 * L.MIN_PACK_BYTES, 3),
        (3 * L.MIN_PACK_BYTES + 1, 4),
        ((L.MAX_PACKS - 1) * L.MIN_PACK_BYTES + 1, L.MAX_PACKS),
        (1000 * L.MIN_PACK_BYTES, L.MAX_PACKS),
    ],
)
def test_pack_count_grows_with_the_bytes_up_to_max_packs(nbytes: int, packs: int) -> None:
    assert L.pack_count(nbytes) == packs


def test_format_4_spreads_packs_and_parts_over_hashed_prefixes_every_step_reuses() -> None:
    """The hash comes first, from names a reader knows; the tree and the plain arrays stay
    under the attempt (a zarr hierarchy), and a step's objects use many prefixes."""
    buckets_of = {}
    for step in (1, 2):
        loc = L.StepLocation(step, f"e1-1700000000-00000000000{step}")  # fixed: deterministic
        keys = [loc.key(L.pack_name(p, k)) for p in range(8) for k in range(16)]
        keys += [loc.key(L.manifest_name(p)) for p in range(8)]
        assert all(k.startswith(L.DATA) and k.split("/")[2].startswith(f"{step}.") for k in keys)
        buckets_of[step] = {k.split("/")[1] for k in keys}
        assert all(len(b) == 2 and int(b, 16) < L.SPREAD_BUCKETS for b in buckets_of[step])
        # 136 objects in slots (p + k) % 32 for p < 8, k < 16: 23 slots, 23 distinct prefixes
        assert len(buckets_of[step]) == 23
        assert buckets_of[step] <= set(loc.buckets())  # a lister finds them, whatever N
        assert len(loc.buckets()) == L.SPREAD_SLOTS
        assert set(loc.buckets(names=[L.pack_name(3, 5)])) == {keys[3 * 16 + 5].split("/")[1]}
        # the packs every process uploads at once (its k-th) fill every slot evenly
        firsts = [L.spread_slot(L.pack_name(p, 0)) for p in range(64)]
        assert sorted(firsts) == sorted(list(range(L.SPREAD_SLOTS)) * 2)
        assert loc.tree_key.startswith(L.ATTEMPTS) and loc.key("zarr.json") == loc.prefix + (
            "zarr.json"
        )
        assert loc.buckets() == sorted(
            {L.spread_bucket(step, str(loc.attempt), s) for s in range(L.SPREAD_SLOTS)}
        )
    # every step's 32 prefixes are one of 8 fixed sets (8 apart): prefixes steps reuse
    fixed = {frozenset(f"{b:02x}" for b in range(r, L.SPREAD_BUCKETS, 8)) for r in range(8)}
    attempts = [f"e1-1700000000-{i:012x}" for i in range(40)]
    assert {frozenset(L.StepLocation(s, a).buckets()) for s, a in enumerate(attempts)} == fixed


@pytest.mark.parametrize(("version", "spread"), [(2, False), (3, False), (4, True)])
def test_a_markers_version_decides_its_keys(version: int, spread: bool) -> None:
    attempt = L.new_attempt(2)
    loc = L.StepLocation.committed(9, attempt, version)
    assert loc.sealed and loc.is_spread is spread
    key = loc.key(L.pack_name(3, 1))
    assert key == (
        f"data/{L.spread_bucket(9, attempt, 4)}/9.{attempt}/packs/3.1.bin"
        if spread
        else f"attempts/9/{attempt}/packs/3.1.bin"
    )
    assert loc.name_of(key) == "packs/3.1.bin" and loc.buckets() == (
        sorted({L.spread_bucket(9, attempt, s) for s in range(L.SPREAD_SLOTS)}) if spread else []
    )
    assert L.StepLocation.committed(9, None, 1).key("packs/0.0.bin") == ("steps/9/packs/0.0.bin")


def test_the_hashed_prefix_function_never_changes() -> None:
    """Stored format-4 steps are read by recomputing their keys: the hash is pinned."""
    attempt = "e1-1733000000-0123456789ab"
    got = [L.spread_bucket(7, attempt, s) for s in (0, 1, 15, 31)]
    assert got == PINNED_BUCKETS
    assert L.spread_bucket(10**12, "e9-1-ab", 0) == PINNED_WIDE


PINNED_BUCKETS = ["2e", "36", "a6", "26"]
PINNED_WIDE = "72"
