"""The per-process pool registry (jaxckpt._pools)."""

from __future__ import annotations

import os
import threading
import time

import pytest
from triggers import HANG_S

from jaxckpt import _pools as pools


def test_a_lease_runs_at_most_its_limit_at_once() -> None:
    """Tasks meet in threes: each group runs at once (a limit under 3 breaks the barrier),
    and a fourth task running beside them would count while it waits for its group."""
    running = peak = 0
    lock = threading.Lock()
    meet = threading.Barrier(3, timeout=HANG_S)

    def task(_: int) -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        meet.wait()
        with lock:
            running -= 1

    with pools.borrow("test-limit", 3) as pool:
        list(pool.map(task, range(21)))
    assert peak == 3


def test_the_threads_outlive_a_lease_and_are_shared() -> None:
    names = set()
    for _ in range(5):
        with pools.borrow("test-shared", 2) as pool:
            names |= set(pool.map(lambda _: threading.current_thread().name, range(8)))
    assert len(names) <= 2 and all(n.startswith("jaxckpt-test-shared") for n in names)


def test_a_task_that_hangs_in_one_lease_does_not_hold_up_another() -> None:
    """Two leases of one name at once get a thread each: a listing of one root no longer
    queues behind a read of another root that hangs in its outage (the game day's
    training stalled for a storm's 60 s so)."""
    release = threading.Event()
    with pools.borrow("test-hang", 1) as hung:
        stuck = hung.submit(release.wait, HANG_S)
        with pools.borrow("test-hang", 1) as other:
            assert other.submit(lambda: 7).result(timeout=HANG_S) == 7
        assert not stuck.done()
        release.set()
    assert stuck.result() is True


def test_leaving_the_block_waits_for_every_task_even_after_an_error() -> None:
    done = []

    def slow() -> None:
        time.sleep(0.2)
        done.append(1)

    with pytest.raises(ZeroDivisionError), pools.borrow("test-wait", 2) as pool:
        pool.submit(slow)
        pool.submit(slow)
        pool.submit(slow)  # queued behind the limit
        raise ZeroDivisionError
    assert done == [1, 1, 1]
    with pytest.raises(RuntimeError, match="after it ended"):
        pool.submit(slow)


def test_a_task_error_reaches_its_future() -> None:
    with pools.borrow("test-error", 1) as pool:
        future = pool.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        future.result()


def test_a_larger_request_grows_the_pool() -> None:
    small = pools.pool("test-grow", 1)
    assert pools.pool("test-grow", 1) is small
    large = pools.pool("test-grow", 4)
    assert large is not small and pools.pool("test-grow", 2) is large
    with pools.borrow("test-grow", 4) as pool:
        barrier = threading.Barrier(4, timeout=HANG_S)
        list(pool.map(lambda _: barrier.wait(), range(4)))  # needs four threads at once


def test_a_forked_child_starts_its_own_pools() -> None:
    parent = pools.pool("test-fork", 1)
    parent.submit(lambda: None).result()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's threads are not here
        try:
            ok = pools.pool("test-fork", 1) is not parent
            ok = ok and pools.pool("test-fork", 1).submit(lambda: 7).result(timeout=10) == 7
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    os.close(read)
