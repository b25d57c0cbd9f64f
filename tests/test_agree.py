"""``_agree``: the primary's decisions reach every process, and every wait is bounded.

The processes of a job are threads here, each with its own ``jax.process_index()``,
sharing an in-memory key-value store that blocks like the coordination service's
(``blocking_key_value_get`` waits until the key exists or the timeout passes).
``tests/test_multihost.py`` runs the same code across real JAX processes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import pytest
from jax._src import distributed

from jaxckpt.commit._agree import Agreement, AgreementTimeoutError, processes
from jaxckpt.errors import CheckpointError, StepAlreadyExistsError, StorageError


class FakeKV:
    """The coordination service's key-value calls that ``Agreement`` uses."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.values: dict[str, str] = {}
        self.arrived: dict[str, int] = {}
        self.deadlines: dict[str, float] = {}
        self.failed: set[str] = set()
        self.dir_gets = 0
        self.timeouts_ms: list[int] = []
        self._cv = threading.Condition()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self._cv:
            if key in self.values and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
            self.values[key] = value
            self._cv.notify_all()

    def key_value_increment(self, key: str, increment: int) -> int:
        with self._cv:
            self.values[key] = str(int(self.values.get(key, "0")) + increment)
            self._cv.notify_all()
            return int(self.values[key])

    def key_value_try_get(self, key: str) -> str:
        with self._cv:
            if key not in self.values:
                raise RuntimeError(f"NOT_FOUND: Config key {key} not found.")
            return self.values[key]

    def wait_for(self, what: Callable[[dict[str, str]], bool]) -> None:
        """Waits until ``what`` holds of the stored values (a test's trigger)."""
        with self._cv:
            assert self._cv.wait_for(lambda: what(self.values), timeout=30), "never happened"

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        self.timeouts_ms.append(timeout_ms)
        with self._cv:
            if not self._cv.wait_for(lambda: key in self.values, timeout=timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]

    def key_value_delete(self, key: str) -> None:
        with self._cv:
            for k in [k for k in self.values if k.startswith(key)]:
                del self.values[k]

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        self.dir_gets += 1
        with self._cv:
            return sorted((k, v) for k, v in self.values.items() if k.startswith(prefix))

    def wait_at_barrier(self, barrier_id: str, timeout_ms: int) -> None:
        """Returns once ``n`` callers arrived. Like the service's: the first caller's
        timeout sets the deadline for every caller (a later caller's is ignored), and a
        barrier that timed out fails for every caller, those waiting and those arriving
        later."""
        self.timeouts_ms.append(timeout_ms)
        with self._cv:
            self.arrived[barrier_id] = self.arrived.get(barrier_id, 0) + 1
            deadline = self.deadlines.setdefault(barrier_id, time.monotonic() + timeout_ms / 1000)
            self._cv.notify_all()
            done = self._cv.wait_for(
                lambda: barrier_id in self.failed or self.arrived[barrier_id] >= self.n,
                timeout=max(deadline - time.monotonic(), 0),
            )
            if not done:
                self.failed.add(barrier_id)
                self._cv.notify_all()
            if barrier_id in self.failed:
                raise RuntimeError(f"DEADLINE_EXCEEDED: barrier {barrier_id}")


class Job:
    """``n`` processes as threads: ``run(fn)`` calls ``fn(process_index)`` on each."""

    def __init__(self, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = n
        self.kv = FakeKV(n)
        self._local = threading.local()
        monkeypatch.setattr(jax, "process_count", lambda: n)
        monkeypatch.setattr(jax, "process_index", lambda: self._local.index)
        monkeypatch.setattr(distributed.global_state, "client", self.kv)

    def run(self, fn: Callable[[int], Any], *, only: set[int] | None = None) -> dict[int, Any]:
        """Each process's result, or the exception it raised."""
        results: dict[int, Any] = {}

        def body(i: int) -> None:
            self._local.index = i
            try:
                results[i] = fn(i)
            except Exception as e:
                results[i] = e

        threads = [
            threading.Thread(target=body, args=(i,))
            for i in range(self.n)
            if only is None or i in only
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
            assert not t.is_alive(), "a process of the fake job hangs"
        return results


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], Job]]:
    yield lambda n: Job(n, monkeypatch)


def test_one_process_needs_no_coordination_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distributed.global_state, "client", None)
    a = Agreement("root")
    assert a.agree("step", 5) == 5
    assert a.gather("bytes", 3) == [3]
    assert a.any_true("corrupt", False) is False and a.any_true("corrupt", True) is True
    a.close()


def test_several_processes_without_jax_distributed_are_refused(job: Callable[[int], Job]) -> None:
    j = job(2)
    distributed.global_state.client = None
    results = j.run(lambda i: Agreement("root").agree("step", i))
    for error in results.values():
        assert isinstance(error, CheckpointError)
        assert "needs jax.distributed.initialize()" in str(error)


def test_every_process_gets_the_primarys_decisions_in_call_order(
    job: Callable[[int], Job],
) -> None:
    j = job(3)

    def decide(i: int) -> list[Any]:
        a = Agreement("root", primary=1)
        return [a.agree("step", 10 + i), a.agree("attempt", f"e1-{i}"), a.agree("step", 20 + i)]

    assert j.run(decide) == {i: [11, "e1-1", 21] for i in range(3)}


def test_namespaces_keep_two_managers_decisions_apart(job: Callable[[int], Job]) -> None:
    j = job(2)

    def decide(i: int) -> tuple[Any, Any]:
        return Agreement("a").agree("step", f"a{i}"), Agreement("b").agree("step", f"b{i}")

    assert j.run(decide) == {0: ("a0", "b0"), 1: ("a0", "b0")}


def test_a_primary_that_never_decides_times_a_process_out_naming_it(
    job: Callable[[int], Job],
) -> None:
    j = job(2)
    started = time.monotonic()
    (error,) = j.run(lambda i: Agreement("root", timeout_s=0.3).agree("step", i), only={1}).values()
    assert isinstance(error, CheckpointError)
    assert "process 1: no decision 'step' from the primary (process 0) within 0.3s" in str(error)
    assert time.monotonic() - started >= 0.3  # it waited its timeout (a hang fails the join)
    assert j.kv.timeouts_ms == [300]


def test_gather_returns_every_processs_value_by_index(job: Callable[[int], Job]) -> None:
    j = job(3)
    results = j.run(lambda i: Agreement("root").gather("crc", {"p": i}))
    assert results == {i: [{"p": 0}, {"p": 1}, {"p": 2}] for i in range(3)}


def test_any_true_is_true_everywhere_when_one_process_says_so(job: Callable[[int], Job]) -> None:
    j = job(3)
    assert j.run(lambda i: Agreement("root").any_true("corrupt", i == 2)) == dict.fromkeys(
        range(3), True
    )
    assert j.run(lambda i: Agreement("other").any_true("corrupt", False)) == dict.fromkeys(
        range(3), False
    )


def test_a_process_that_never_arrives_times_the_gather_out_naming_it(
    job: Callable[[int], Job],
) -> None:
    j = job(3)
    results = j.run(lambda i: Agreement("root", timeout_s=0.3).gather("crc", i), only={0, 1})
    for i in (0, 1):
        assert isinstance(results[i], AgreementTimeoutError)
        assert f"process {i}: no 'crc' from process 2 within 0.3s" in str(results[i])
    assert set(j.kv.timeouts_ms) == {300}


def test_close_removes_every_key_once_every_process_closed(job: Callable[[int], Job]) -> None:
    j = job(2)

    def use_and_close(i: int) -> None:
        a = Agreement("root")
        a.agree("step", i)
        a.gather("crc", i)
        a.close()

    j.run(use_and_close)
    assert j.kv.values == {}


def test_close_keeps_the_keys_until_the_last_process_closes(job: Callable[[int], Job]) -> None:
    j = job(2)
    j.run(lambda i: Agreement("root").agree("step", 7))
    (result,) = j.run(lambda i: Agreement("root", timeout_s=0.3).close(), only={0}).values()
    assert result is None  # no wait and no error: process 1 has not closed yet
    assert "jaxckpt/root/open/step.0" in j.kv.values
    j.run(lambda i: Agreement("root", timeout_s=0.3).close(), only={1})  # the last to close
    assert j.kv.values == {}
    assert Agreement("x", timeout_s=2.5).timeout_s == 2.5


def test_reports_read_only_what_processes_reported(job: Callable[[int], Job]) -> None:
    j = job(4)
    results = j.run(lambda i: Agreement("root").reports("failed", "disk" if i == 2 else None))
    assert results == {key: {2: "disk"} for key in range(4)}
    assert len([k for k in j.kv.values if "/v/" in k]) == 1  # only the reporter's value


def test_settle_raises_the_failing_processs_error_on_every_process_naming_it(
    job: Callable[[int], Job],
) -> None:
    j = job(3)

    def save(i: int) -> None:
        error = StorageError("PUT s3://b/r/x: 403 Forbidden") if i == 1 else None
        Agreement("root").settle("checks", error, what="save of step 5")

    results = j.run(save)
    for i in range(3):  # the failing process names itself too
        assert isinstance(results[i], StorageError)
        assert str(results[i]) == (
            "save of step 5 failed on process 1: PUT s3://b/r/x: 403 Forbidden"
        )
    settled = j.run(lambda i: Agreement("ok").settle("checks", None, what="x"))
    assert settled == {i: {} for i in range(3)}  # nothing shared: nothing handed over


def test_settle_hands_the_primary_what_each_process_shared_with_one_read_more(
    job: Callable[[int], Job],
) -> None:
    """A save's "written" settle carries each process's part summary to the primary: when
    nobody reported, the others read nothing, the primary one directory read, whatever N."""
    j = job(4)
    results = j.run(
        lambda i: Agreement("root", primary=1).settle("written", None, what="x", share=[i, 2 * i])
    )
    assert results == {0: {}, 1: {p: [p, 2 * p] for p in range(4)}, 2: {}, 3: {}}
    assert j.kv.dir_gets == 1
    failing = j.run(  # a failure is still raised everywhere; nothing is handed over
        lambda i: Agreement("f").settle(
            "written", StorageError("no") if i == 3 else None, what="x", share=[i]
        )
    )
    assert all(isinstance(r, StorageError) for r in failing.values()), failing


def test_settle_names_every_failing_process(job: Callable[[int], Job]) -> None:
    """Every report made before a process reads them is named (a report ends the meeting at
    once, so one made after that is named only by its own process): here process 2
    reports, then process 1, then process 0 arrives."""
    j = job(3)

    def save(i: int) -> None:
        if i < 2:  # after process 2's report (and process 0 after process 1's)
            j.kv.wait_for(lambda kv: sum("/v/" in k for k in kv) == 2 - i)
        error = StepAlreadyExistsError(f"step 5 exists ({i})") if i else None
        Agreement("root").settle("checks", error, what="save of step 5")

    error = j.run(save)[0]
    assert isinstance(error, StepAlreadyExistsError)
    assert str(error) == "save of step 5 failed on process 1 (and on process 2): step 5 exists (1)"


def test_operations_meet_again_after_processes_failed_at_different_points(
    job: Callable[[int], Job],
) -> None:
    """A per-process counter would leave process 1 one agreement behind for good."""
    j = job(2)

    def run(i: int) -> list[Any]:
        a = Agreement("root", timeout_s=60.0)  # only a hang reaches it
        with contextlib.suppress(CheckpointError), a.operation("save", 1):
            a.agree("attempt", "a1")
            if i == 0:  # process 1 failed before this agreement
                a.agree("tree", "t1")
        with a.operation("save", 2):
            return [a.agree("attempt", f"a2-{i}"), a.gather("written", i)]

    assert j.run(run) == {key: ["a2-0", [0, 1]] for key in range(2)}


def test_finished_operations_keys_are_deleted_at_the_next_barrier(
    job: Callable[[int], Job],
) -> None:
    j = job(2)

    def run(i: int) -> None:
        a = Agreement("root")
        with a.operation("save", 1):
            a.agree("attempt", "a1")
        with a.operation("save", 2):
            a.settle("checks", None, what="save of step 2")
            a.agree("attempt", "a2")

    j.run(run)
    assert sorted(j.kv.values) == [  # save 1's keys went at save 2's barrier
        "jaxckpt/root/save-2.0/attempt.1",
        "jaxckpt/root/save-2.0/checks.0/a/0",
        "jaxckpt/root/save-2.0/checks.0/a/1",
        "jaxckpt/root/save-2.0/checks.0/count",
        "jaxckpt/root/save-2.0/checks.0/outcome",
    ]


def test_coordination_calls_per_process_do_not_grow_with_processes(
    job: Callable[[int], Job],
) -> None:
    """A gather is a set, a barrier and one directory read whatever the count of processes."""
    for n in (2, 8):
        j = job(n)
        j.run(lambda i: Agreement("root").gather("crc", i))
        assert j.kv.dir_gets == n  # one each
        assert len(j.kv.timeouts_ms) == n  # one barrier each, no per-process gets


def test_a_failure_reaches_a_process_that_arrives_after_the_failing_one_left(
    job: Callable[[int], Job],
) -> None:
    """The failing process waits briefly; the barrier then fails for everyone, and each
    process reads the reports: a slow process, arriving once the others have left, raises
    the named failure at once (a wait for its own 60 s timeout fails ``Job.run``'s join)."""
    j = job(3)
    others_left = threading.Barrier(3)  # processes 0 and 1 returned; process 2 starts

    def save(i: int) -> None:
        if i == 2:
            others_left.wait(timeout=60)  # still writing when process 1 gives up waiting
        error = StorageError("PUT x: 403 Forbidden") if i == 1 else None
        try:
            Agreement("root", timeout_s=60).settle("written", error, what="save of step 5")
        finally:
            if i != 2:
                others_left.wait(timeout=60)

    results = j.run(save)
    for i in range(3):
        assert isinstance(results[i], StorageError), results
        assert "save of step 5 failed on process 1: PUT x: 403 Forbidden" in str(results[i])


def test_a_failure_reaches_processes_that_arrived_first_at_once(
    job: Callable[[int], Job],
) -> None:
    """The failing process arrives last, when the others already wait with their 60 s
    timeout (the coordination service's barrier keeps the first arrival's deadline, so a
    short wait of the failing process alone would not end theirs): every process raises
    the failure at once (a wait for the timeout fails ``Job.run``'s join)."""
    j = job(3)

    def save(i: int) -> None:
        if i == 1:  # processes 0 and 2 are counted: they wait for the outcome
            j.kv.wait_for(lambda kv: kv.get("jaxckpt/root/open/written.0/count") == "2")
        error = StorageError("PUT x: 403 Forbidden") if i == 1 else None
        Agreement("root", timeout_s=60).settle("written", error, what="save of step 5")

    results = j.run(save)
    for i in range(3):
        assert isinstance(results[i], StorageError), results
        assert str(results[i]) == "save of step 5 failed on process 1: PUT x: 403 Forbidden"
    assert j.kv.values["jaxckpt/root/open/written.0/outcome"] == "told"


def test_a_late_process_meets_the_outcome_the_others_timed_out_with(
    job: Callable[[int], Job],
) -> None:
    """A meeting that timed out for the processes waiting stays failed for a process that
    arrives afterwards, though it completes the count: the first outcome written holds."""
    j = job(2)
    first = j.run(
        lambda i: Agreement("root", timeout_s=0.2).settle("checks", None, what="save"), only={0}
    )
    assert isinstance(first[0], AgreementTimeoutError), first
    assert "save: process 0: no 'checks' from process 1 within 0.2s" in str(first[0])
    late = j.run(
        lambda i: Agreement("root", timeout_s=0.2).settle("checks", None, what="save"), only={1}
    )
    assert isinstance(late[1], AgreementTimeoutError), late
    assert j.kv.values["jaxckpt/root/open/checks.0/outcome"] == "late"


def test_a_detached_agreement_waits_no_longer_than_its_deadline(
    job: Callable[[int], Job],
) -> None:
    """A save's background agreements end by the save's deadline (``within_s``), not
    their own timeout, so their error, naming who never came, is the one raised."""
    j = job(3)
    results = j.run(
        lambda i: (
            Agreement("root", timeout_s=60.0)
            .detached(within_s=0.3)
            .settle("written", None, what="save of step 2")
        ),
        only={0, 1},
    )
    for i in (0, 1):
        assert isinstance(results[i], AgreementTimeoutError), results
        assert "no 'written' from process 2 within" in str(results[i])
    assert all(0 < ms <= 300 for ms in j.kv.timeouts_ms), j.kv.timeouts_ms


def test_processes_are_named_briefly() -> None:
    assert processes([3]) == "process 3"
    assert processes([1, 3]) == "processes 1, 3"
    assert processes(list(range(10)), most=3) == "10 processes (0, 1, 2, ...)"
