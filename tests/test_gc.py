"""``_gc``: what lies under a root besides committed steps, and what collection removes.

``is_live`` is the one decision that protects a writer's attempt; it is
checked as a table at the grace boundary. ``scan`` and ``collect`` run on a
local root whose records are written here directly (attempt ids carry their
epoch and start time, pending records their start), so each case is exactly
what a crashed, fenced or live writer leaves.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from jaxckpt.commit import CommitProtocol, list_attempt
from jaxckpt.commit._gc import Attempt, collect, is_live, scan
from jaxckpt.records import (
    DATA,
    SPREAD_SLOTS,
    TEMP_GRACE_S,
    CommitMarker,
    FileDigest,
    StepLocation,
    json_record,
    latest_hint_key,
    manifest_name,
    marker_key,
    new_attempt,
    pack_name,
)
from jaxckpt.storage import open_storage

GRACE_S = 3600.0
PER_PROCESS = [
    *(pack_name(p, k) for p in range(2) for k in range(3)),
    *(manifest_name(p) for p in range(2)),
]
NOW = 1_800_000_000.0


# -- the live-attempt decision ------------------------------------------------------------


def attempt(epoch: int, age: float, *, operation: str = "save", started: float | None = None):
    loc = StepLocation(4, new_attempt(epoch, now=NOW - age))
    return Attempt(location=loc, kind="partial", operation=operation, started=started)


@pytest.mark.parametrize(
    ("a", "live"),
    [
        pytest.param(attempt(2, 0.0), True, id="newest-epoch-just-started"),
        pytest.param(attempt(2, GRACE_S - 1), True, id="newest-epoch-inside-grace"),
        pytest.param(attempt(2, GRACE_S), False, id="newest-epoch-at-grace"),
        pytest.param(attempt(2, GRACE_S + 1), False, id="newest-epoch-past-grace"),
        pytest.param(attempt(1, 0.0), False, id="fenced-epoch-just-started"),
        pytest.param(attempt(3, 0.0), True, id="an-epoch-newer-than-the-listing"),
        pytest.param(attempt(2, 0.0, operation="delete"), False, id="an-interrupted-delete"),
        pytest.param(attempt(2, GRACE_S * 2, started=NOW - 10), True, id="pending-record-time"),
        pytest.param(attempt(2, 0.0, started=NOW - GRACE_S), False, id="pending-record-at-grace"),
        pytest.param(
            Attempt(location=StepLocation(4), kind="orphaned"), False, id="format-1-no-time"
        ),
    ],
)
def test_only_the_newest_epochs_attempts_inside_the_grace_period_are_live(
    a: Attempt, live: bool
) -> None:
    assert is_live(a, current_epoch=2, grace_s=GRACE_S, now=NOW) is live


def test_an_attempts_age_comes_from_its_pending_record_else_its_id() -> None:
    assert attempt(1, 50.0).age(NOW) == 50.0
    assert attempt(1, 50.0, started=NOW - 7).age(NOW) == 7.0
    assert Attempt(location=StepLocation(4), kind="orphaned").age(NOW) is None


# -- scanning and collecting a root ---------------------------------------------------------


class Root:
    """A local root with a writer of epoch 1; records written as a writer would write them."""

    def __init__(self, path: Path) -> None:
        self.storage = open_storage(str(path))
        self.protocol = CommitProtocol(self.storage)
        self.protocol.ensure_root(create=True)
        self.protocol.take_epoch()

    def attempt(
        self,
        step: int,
        *,
        age: float = 0.0,
        epoch: int | None = None,
        pending: bool = True,
        data: bool = True,
    ) -> StepLocation:
        started = time.time() - age
        loc = StepLocation(step, new_attempt(epoch or self.protocol.write_epoch(), now=started))
        if pending:
            record = json_record(operation="save", started=started, step=step, attempt=loc.attempt)
            self.storage.write(loc.pending_key, record)
            self.backdate(loc.pending_key, started)  # gc reads ages off the storage's clock
        if data:  # records and plain arrays under the attempt, 2 processes' packs and parts
            self.storage.write(loc.tree_key, b"{}")  # under hashed prefixes (format 4)
            self.storage.write(loc.array_prefix("w") + "c/0", b"data")
            for name in PER_PROCESS:
                self.storage.write(loc.key(name), b"data")
        return loc

    def backdate(self, key: str, when: float) -> None:
        """Makes ``key`` as old by the storage's clock (its mtime) as ``when`` says."""
        os.utime(os.path.join(self.storage.uri, key), (when, when))

    def commit(self, loc: StepLocation, *, keep_pending: bool = False) -> CommitMarker:
        """The marker, then (unless ``keep_pending``: killed just after it) no pending record."""
        marker = CommitMarker(
            step=loc.step,
            time=time.time(),
            num_processes=1,
            files={
                "tree.json": FileDigest.of(b"{}"),
                **{manifest_name(p): FileDigest.of(b"data") for p in range(2)},
            },
            nbytes=4,
            attempt=loc.attempt,
            epoch=loc.epoch,
        )
        self.storage.write(marker.key, marker.to_bytes(), exclusive=True)
        if not keep_pending:
            self.storage.delete(loc.pending_key)
        return marker

    def takeover(self) -> None:
        """A new writer opens the root: a new epoch, knowing the steps visible now."""
        self.protocol.take_epoch()

    def has(self, loc: StepLocation) -> bool:
        return bool(list_attempt(self.storage, loc))

    def has_pending(self, loc: StepLocation) -> bool:
        return self.storage.read(loc.pending_key) is not None


@pytest.fixture
def root(tmp_path: Path) -> Root:
    return Root(tmp_path)


def test_scan_classifies_partial_orphaned_hidden_damaged_and_stale(root: Root) -> None:
    committed = root.attempt(1)
    root.commit(committed, keep_pending=True)  # its pending record is left behind: stale
    partial = root.attempt(2)
    orphan = root.attempt(3, pending=False)
    zombie = root.attempt(4)
    damaged = root.attempt(5, pending=False)
    root.commit(damaged)
    root.takeover()  # epoch 2 knows steps 1 and 5, not step 4
    root.commit(zombie)  # epoch 1 commits after the takeover: hidden
    path = Path(root.storage.uri) / marker_key(5, 1)
    path.write_bytes(path.read_bytes()[:-3])  # the damaged marker of a visible step

    quick = scan(root.protocol, full=False)
    assert sorted(quick.committed) == [1]
    assert [m.step for m in quick.hidden] == [4]
    assert quick.stale_pending == [committed.pending_key]
    assert [(a.location, a.kind) for a in quick.attempts] == [(partial, "partial")]
    assert quick.damaged == {}  # a quick scan reads only markers of steps with pending records

    full = scan(root.protocol, full=True)
    assert sorted(full.committed) == [1] and sorted(full.damaged) == [5]
    kinds = {a.location: a.kind for a in full.attempts}
    assert kinds == {partial: "partial", orphan: "orphaned", damaged: "damaged"}
    assert full.named == {committed}


def test_collect_at_the_grace_boundary_keeps_only_the_live_writers_attempts(root: Root) -> None:
    fenced_young = root.attempt(1, age=0.0)
    root.takeover()
    live = root.attempt(2, age=GRACE_S - 60)
    stale = root.attempt(3, age=GRACE_S + 60)
    orphan_young = root.attempt(4, age=0.0, pending=False)
    orphan_old = root.attempt(5, age=GRACE_S + 60, pending=False)

    removed = collect(root.protocol, scan(root.protocol, full=True), grace_s=GRACE_S)
    assert set(removed) == {fenced_young, stale, orphan_old}
    for loc in (fenced_young, stale, orphan_old):
        assert not root.has(loc) and not root.has_pending(loc), loc
    assert root.has(live) and root.has_pending(live)
    assert root.has(orphan_young)
    # Grace 0: nothing is live any more (an operator's `gc --grace 0`).
    removed = collect(root.protocol, scan(root.protocol, full=True), grace_s=0.0)
    assert set(removed) == {live, orphan_young}


def test_a_quick_scan_collects_partial_attempts_but_never_sees_orphans(root: Root) -> None:
    partial = root.attempt(1, age=GRACE_S + 60)
    orphan = root.attempt(2, age=GRACE_S + 60, pending=False)
    assert collect(root.protocol, scan(root.protocol, full=False), grace_s=GRACE_S) == [partial]
    assert root.has(orphan)


def test_hidden_steps_are_retracted_and_stale_pending_records_dropped(root: Root) -> None:
    committed = root.attempt(1)
    root.commit(committed, keep_pending=True)
    zombie = root.attempt(2)
    root.takeover()
    hidden = root.commit(zombie)
    removed = collect(root.protocol, scan(root.protocol, full=False), grace_s=GRACE_S)
    assert removed == [zombie]
    assert root.storage.read(hidden.key) is None and not root.has(zombie)
    assert not root.has_pending(zombie)
    assert not root.has_pending(committed) and root.has(committed)  # only its record went
    assert sorted(root.protocol.committed()) == [1]


def test_a_damaged_marker_and_its_data_are_kept_unless_forced(root: Root) -> None:
    loc = root.attempt(1, age=GRACE_S + 60, pending=False)
    marker = root.commit(loc)
    path = Path(root.storage.uri) / marker.key
    path.write_bytes(b"{" + path.read_bytes()[1:-1])
    assert collect(root.protocol, scan(root.protocol, full=True), grace_s=0.0) == []
    assert root.has(loc) and path.exists()
    assert collect(root.protocol, scan(root.protocol, full=True), grace_s=0.0, force=True) == [loc]
    assert not root.has(loc) and not path.exists()


def test_an_attempt_committed_after_the_scan_is_kept(root: Root) -> None:
    loc = root.attempt(1, age=GRACE_S + 60)
    found = scan(root.protocol, full=False)
    root.commit(loc)  # the writer's marker landed between the scan and the removal
    assert collect(root.protocol, found, grace_s=GRACE_S) == []
    assert root.has(loc) and sorted(root.protocol.committed()) == [1]


def test_stale_temp_files_and_fenced_hints_are_removed_fresh_ones_kept(root: Root) -> None:
    now = int(time.time())
    fresh = f"commits/.{marker_key(1, 1)[8:]}.{now}-ab.tmp"
    old = f"commits/.{marker_key(2, 1)[8:]}.{now - int(TEMP_GRACE_S) - 5}-cd.tmp"
    for key in (fresh, old, latest_hint_key(1)):
        root.storage.write(key, b"x")
    root.backdate(old, now - TEMP_GRACE_S - 5)
    root.takeover()
    root.storage.write(latest_hint_key(2), b"x")
    found = scan(root.protocol, full=False)
    assert sorted(found.temp_keys) == sorted([old, latest_hint_key(1)])
    collect(root.protocol, found, grace_s=GRACE_S)
    keys = set(root.storage.list("commits/"))
    assert fresh in keys and latest_hint_key(2) in keys
    assert old not in keys and latest_hint_key(1) not in keys


def test_a_hidden_step_whose_writer_died_before_dropping_its_record_goes_whole(
    root: Root,
) -> None:
    zombie = root.attempt(1)
    root.takeover()
    hidden = root.commit(zombie, keep_pending=True)  # killed at marker_written
    removed = collect(root.protocol, scan(root.protocol, full=False), grace_s=GRACE_S)
    assert set(removed) == {zombie}
    assert root.storage.read(hidden.key) is None
    assert not root.has(zombie) and not root.has_pending(zombie)
    assert scan(root.protocol, full=True).attempts == []


def test_a_young_temp_file_is_kept_unless_the_grace_is_shorter(root: Root) -> None:
    """A create-only write's temp file (a kill inside the write) younger than TEMP_GRACE_S may be
    a live writer's; a grace shorter than that (``gc --grace 0``: nobody writes) covers it too."""
    young = f"commits/.000000000058.e1.json.{int(time.time())}-{'a' * 32}.tmp"
    old = f"commits/.000000000059.e1.json.{int(time.time()) - 700}-{'b' * 32}.tmp"
    for key in (young, old):
        root.storage.write(key, b"partial")
    root.backdate(old, time.time() - 700)
    assert scan(root.protocol, full=True).temp_keys == [old]
    assert sorted(scan(root.protocol, full=True, temp_grace_s=0.0).temp_keys) == [young, old]
    collect(root.protocol, scan(root.protocol, full=True, temp_grace_s=0.0), grace_s=0.0)
    assert [k for k in root.storage.list("commits/") if k.endswith(".tmp")] == []


def test_a_killed_attempts_objects_under_hashed_prefixes_are_all_collected(root: Root) -> None:
    """A partial attempt's packs and parts lie under several hashed prefixes that other
    steps share: collection finds them from its pending record alone, removes them and
    their directories, and leaves every other step's objects in the same prefixes."""
    committed = root.attempt(1)
    root.commit(committed)
    killed = root.attempt(2, age=GRACE_S + 60)
    keys = list_attempt(root.storage, killed)
    hashed = {k.split("/")[1] for k in keys if k.startswith(DATA)}
    assert len(hashed) > 1 and len(keys) == 2 + len(PER_PROCESS)
    kept = list_attempt(root.storage, committed)
    assert collect(root.protocol, scan(root.protocol, full=False), grace_s=GRACE_S) == [killed]
    assert not root.has(killed) and not root.has_pending(killed)
    assert list_attempt(root.storage, committed) == kept
    left = {str(d.relative_to(root.storage.uri)) for d in Path(root.storage.uri).rglob("*")}
    assert not any(f"2.{killed.attempt}" in d for d in left), left  # no empty directories
    orphan = root.attempt(3, age=GRACE_S + 60, pending=False)
    for key in [orphan.tree_key, orphan.array_prefix("w") + "c/0"]:
        root.storage.delete(key)  # only its hashed objects are left: a full scan finds them
    assert collect(root.protocol, scan(root.protocol, full=True), grace_s=GRACE_S) == [orphan]
    assert not root.has(orphan) and list_attempt(root.storage, committed) == kept


def test_deleting_a_committed_step_removes_every_object_and_lists_only_its_prefixes(
    root: Root,
) -> None:
    loc = root.attempt(1)
    marker = root.commit(loc)
    other = root.attempt(2)
    root.commit(other)
    assert marker.location.sealed  # committed: no writer refills it
    assert len(marker.location.buckets()) == SPREAD_SLOTS  # 32 prefixes, whatever N
    root.protocol.delete(1)
    assert list_attempt(root.storage, StepLocation(1, loc.attempt)) == []  # every prefix
    assert not root.has_pending(loc) and root.has(other)
    assert sorted(root.protocol.committed()) == [2]
