"""``_fence``: writer epochs, the fence check, and the visibility rule.

The rule: a marker written by epoch E is visible only if its step is in the
``known`` set of every epoch newer than E. The decisions are pure functions of
the epoch records, so most tests build ``Epochs`` directly; taking an epoch is
tested on a local root, with a wrapper that makes another writer win a race.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from jaxckpt.commit import CommitProtocol
from jaxckpt.commit._fence import EpochReader, EpochRecord, Epochs
from jaxckpt.errors import StorageError, WriterFencedError
from jaxckpt.records import MarkerRef, epoch_key, marker_key
from jaxckpt.storage import PreconditionFailed, Storage, open_storage


def ref(step: int, epoch: int) -> MarkerRef:
    return MarkerRef(step=step, epoch=epoch, key=marker_key(step, epoch))


def epochs(**known: set[int] | None) -> Epochs:
    """``epochs(e1={...}, e2=None)``: epoch records by number with their ``known`` sets."""
    return Epochs(
        {
            int(name[1:]): EpochRecord(
                epoch=int(name[1:]), known=None if k is None else frozenset(k)
            )
            for name, k in known.items()
        }
    )


# -- the visibility rule --------------------------------------------------------------


def test_a_marker_is_visible_when_every_newer_epoch_knew_its_step() -> None:
    e = epochs(e1=set(), e2={5, 6}, e3={5, 6, 7})
    assert e.newest == 3
    assert e.visible(ref(5, 1)) and e.hidden_by(ref(5, 1)) is None
    assert e.visible(ref(7, 2))  # epoch 3 knew step 7 when it took over
    assert e.visible(ref(9, 3))  # the newest epoch's own markers


def test_a_zombie_marker_committed_after_the_takeover_is_hidden() -> None:
    e = epochs(e1=set(), e2={5, 6})
    assert not e.visible(ref(7, 1))
    assert e.hidden_by(ref(7, 1)) == 2


def test_the_first_newer_epoch_that_did_not_know_the_step_hides_it() -> None:
    e = epochs(e1=set(), e2={5}, e3={5}, e4={5, 7})
    assert not e.visible(ref(7, 1))
    assert e.hidden_by(ref(7, 1)) == 2
    assert e.visible(ref(7, 3))  # epoch 4 knew step 7; epochs 2 and 3 are not newer than 3
    assert not e.visible(ref(8, 3)) and e.hidden_by(ref(8, 3)) == 4


def test_an_unreadable_epoch_record_hides_nothing() -> None:
    e = epochs(e1=set(), e2=None)
    assert e.visible(ref(7, 1)) and e.hidden_by(ref(7, 1)) is None


def test_no_epochs_is_epoch_0_and_hides_nothing() -> None:
    e = Epochs({})
    assert e.newest == 0 and e.visible(ref(3, 0))


# -- epoch records ----------------------------------------------------------------------


def test_an_epoch_record_round_trips_and_resumes_from_its_newest_known_step() -> None:
    record = EpochRecord(
        epoch=4, time=12.5, owner="host:1", known=frozenset({2, 9, 4}), resumed_key="k"
    )
    back = EpochRecord.from_bytes(4, record.to_bytes(), "writers/4.json")
    assert back == record and back.resumed_from == 9
    assert EpochRecord(epoch=1, known=frozenset()).resumed_from is None


def test_a_missing_or_damaged_epoch_record_reads_as_unknown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert EpochRecord.from_bytes(3, None, "r/writers/3.json") == EpochRecord(epoch=3)
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        assert EpochRecord.from_bytes(3, b"{not json", "r/writers/3.json").known is None
        assert EpochRecord.from_bytes(3, b'{"format":"jaxckpt","version":2}', "r/w/3").known is None
    assert "unreadable writer record r/writers/3.json" in caplog.text
    assert "it hides no steps" in caplog.text


# -- taking an epoch ----------------------------------------------------------------------


class Recording:
    """A storage that counts reads and can make another writer win the next epochs."""

    def __init__(self, inner: Storage, *, stolen: int = 0) -> None:
        self._inner = inner
        self.reads: list[str] = []
        self.stolen = stolen  # this many exclusive epoch writes lose to "another writer"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def read(self, key: str) -> bytes | None:
        self.reads.append(key)
        return self._inner.read(key)

    def write(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        if exclusive and key.startswith("writers/") and self.stolen:
            self.stolen -= 1
            other = EpochRecord(epoch=int(key[8:-5]), owner="other", known=frozenset())
            self._inner.write(key, other.to_bytes(), exclusive=True)
        self._inner.write(key, data, exclusive=exclusive)


def test_epochs_are_taken_in_order_recording_the_visible_steps(tmp_path: Path) -> None:
    reader = EpochReader(open_storage(str(tmp_path)))
    first = reader.take(lambda e: {3: ref(3, 0), 5: ref(5, 0)})
    assert (first.epoch, first.known, first.resumed_key) == (1, {3, 5}, marker_key(5, 0))
    assert first.owner and first.time > 0
    second = EpochReader(open_storage(str(tmp_path))).take(lambda e: {})
    assert second.epoch == 2 and second.known == frozenset() and second.resumed_key is None
    assert reader.numbers() == [1, 2] and reader.newest() == 2
    assert reader.load().records[1] == first


def test_a_lost_race_for_an_epoch_takes_the_next_one_and_asks_again(tmp_path: Path) -> None:
    storage = Recording(open_storage(str(tmp_path)), stolen=2)
    asked: list[int] = []

    def visible(e: Epochs) -> dict[int, MarkerRef]:
        asked.append(e.newest)
        return {1: ref(1, 0)}

    record = EpochReader(storage).take(visible)  # type: ignore[arg-type]
    assert record.epoch == 3
    assert asked == [0, 1, 2]  # the visible steps are read again below each new epoch
    assert EpochReader(open_storage(str(tmp_path))).record(1).owner == "other"


def test_endless_contention_for_an_epoch_is_a_storage_error(tmp_path: Path) -> None:
    storage = Recording(open_storage(str(tmp_path)), stolen=10**6)
    with pytest.raises(StorageError, match=f"could not take a writer epoch under {tmp_path}"):
        EpochReader(storage).take(lambda e: {})  # type: ignore[arg-type]


def test_epoch_records_are_read_once_they_never_change(tmp_path: Path) -> None:
    EpochReader(open_storage(str(tmp_path))).take(lambda e: {})
    storage = Recording(open_storage(str(tmp_path)))
    reader = EpochReader(storage)  # type: ignore[arg-type]
    for _ in range(3):
        reader.load()
    assert storage.reads == [epoch_key(1)]


def test_an_epoch_is_created_only_once(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    EpochReader(storage).take(lambda e: {})
    with pytest.raises(PreconditionFailed):
        storage.write(epoch_key(1), b"{}", exclusive=True)


# -- the fence check ------------------------------------------------------------------------


def test_a_writer_is_fenced_once_a_newer_epoch_exists(tmp_path: Path) -> None:
    old = CommitProtocol(open_storage(str(tmp_path)))
    old.ensure_root(create=True)
    assert old.take_epoch().epoch == 1
    old.check_fence("commit step 3")  # still the newest writer
    new = CommitProtocol(open_storage(str(tmp_path)))
    assert new.take_epoch().epoch == 2
    with pytest.raises(WriterFencedError, match=r"cannot commit step 3: writer epoch 1 .* epoch 2"):
        old.check_fence("commit step 3")
    new.check_fence("commit step 3")
    # The check can use a listing the caller already took (a moment old: advisory).
    old.check_fence("commit step 3", epochs(e1=set()))
    with pytest.raises(WriterFencedError):
        old.check_fence("commit step 3", epochs(e1=set(), e2=set()))


def test_an_operator_without_an_epoch_is_never_fenced(tmp_path: Path) -> None:
    writer = CommitProtocol(open_storage(str(tmp_path)))
    writer.ensure_root(create=True)
    writer.take_epoch()
    operator = CommitProtocol(open_storage(str(tmp_path)))
    operator.check_fence("delete step 1")
    assert operator.epoch is None and operator.write_epoch() == 1
    writer.take_epoch()
    operator.check_fence("delete step 1")
    assert operator.write_epoch() == 2
