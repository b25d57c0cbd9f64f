"""``_agree``: the primary's decisions reach every process, and every wait is bounded.

The processes of a job are threads here, each with its own ``jax.process_index()``,
sharing an in-memory key-value store that blocks like the coordination service's
(``blocking_key_value_get`` waits until the key exists or the timeout passes).
``tests/test_multihost.py`` runs the same code across real JAX processes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import pytest
from jax._src import distributed

from jaxckpt._agree import Agreement
from jaxckpt.errors import CheckpointError


class FakeKV:
    """The coordination service's key-value calls that ``Agreement`` uses."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.timeouts_ms: list[int] = []
        self._cv = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self._cv:
            assert key not in self.values, f"{key} written twice"
            self.values[key] = value
            self._cv.notify_all()

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


class Job:
    """``n`` processes as threads: ``run(fn)`` calls ``fn(process_index)`` on each."""

    def __init__(self, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = n
        self.kv = FakeKV()
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
    assert "process 1: no decision 'step' from the primary within 0.3s" in str(error)
    assert 0.3 <= time.monotonic() - started < 10
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
        assert isinstance(results[i], CheckpointError)
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


def test_close_keeps_the_keys_when_a_process_never_closes(
    job: Callable[[int], Job], caplog: pytest.LogCaptureFixture
) -> None:
    j = job(2)
    j.run(lambda i: Agreement("root").agree("step", 7))
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        (result,) = j.run(lambda i: Agreement("root", timeout_s=0.3).close(), only={0}).values()
    assert result is None  # bounded, and not an error: the keys are only left behind
    assert "agreement keys jaxckpt/root/ kept: a process did not close" in caplog.text
    assert "jaxckpt/root/step/0" in j.kv.values
    assert Agreement("x", timeout_s=2.5).timeout_s == 2.5
