"""The process's background threads: named, bounded thread pools shared by every call.

A call that needs a few threads for a moment (a commit's reads, a listing's two
requests, a restore's chunk reads) borrows them from the pool of its name
instead of starting and joining a ``ThreadPoolExecutor`` of its own:

>>> with borrow("doctest", 2) as pool:
...     sorted(pool.map(abs, [-2, 1, -3]))
[1, 2, 3]

:func:`detached` runs one call on a daemon thread of its own, for a request to a store
that may not answer (a health record, a lookup a save can do without): the caller waits
as long as it chooses, and interpreter exit does not wait at all.

A :class:`Lease` runs at most ``limit`` of its tasks at once and, like an
executor used as a context manager, waits for them when the ``with`` block
ends; the threads themselves stay for the next call. Each name's pool is
created on first use, with as many threads as the leases open on it at once
have asked for together (a larger need replaces it by a larger one; the old one
finishes what it was given, then its threads exit): one lease never waits for
another's tasks, so a read that hangs on one root (an outage) does not hold up
a listing of another. Tasks of one name must not wait for tasks of the same
name (that could take every thread); waiting across names is fine as long as
the names do not form a circle.

After ``fork`` the child starts without pools (the parent's threads are not
in it) and creates its own on first use. At interpreter exit every pool is
shut down (``concurrent.futures`` joins the threads of the pools still busy).

:func:`result` waits for a future in slices of :data:`POLL_S`, so that a Ctrl-C reaches a
main thread that waits for a pool's task at once.

:func:`lower_thread_priority` lowers a background thread's CPU priority (the save's writer,
the promoter) below the training's.

This module imports nothing of jaxckpt, so every layer may use it.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any, ParamSpec, TypeVar

_P = ParamSpec("_P")
_T = TypeVar("_T")

_lock = threading.Lock()
_pools: dict[str, ThreadPoolExecutor] = {}
_sizes: dict[str, int] = {}
_leased: dict[str, int] = {}  # per name, the limits of the open leases together


def pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The process's pool ``name``, with at least ``workers`` threads.

    Args:
      name: what the threads do; they are named ``jaxckpt-NAME_N``.
      workers: the threads the caller needs at once (at least 1).
    """
    if workers < 1:
        raise ValueError(f"a pool needs at least one worker, got {workers}")
    with _lock:
        current = _pools.get(name)
        if current is not None and _sizes[name] >= workers:
            return current
        _pools[name] = ThreadPoolExecutor(workers, thread_name_prefix=f"jaxckpt-{name}")
        _sizes[name] = workers
    if current is not None:
        current.shutdown(wait=False)  # runs what it was given, then its threads exit
    return _pools[name]


class Lease(Executor):
    """At most ``limit`` tasks at once on the pool ``name``; see :func:`borrow`."""

    def __init__(self, name: str, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a lease needs a limit of at least 1, got {limit}")
        self._name = name
        self._limit = limit
        with _lock:
            _leased[name] = self._workers = _leased.get(name, 0) + limit
        self._free = limit
        self._queue: deque[tuple[Future[Any], Callable[[], Any]]] = deque()
        self._futures: list[Future[Any]] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        outer: Future[_T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(
                    f"cannot submit to the lease of pool {self._name!r} after it ended"
                )
            self._futures.append(outer)
            start = self._free > 0
            if start:
                self._free -= 1
            else:
                self._queue.append((outer, lambda: fn(*args, **kwargs)))
        if start:
            self._start(outer, lambda: fn(*args, **kwargs))
        return outer

    def _start(self, outer: Future[Any], call: Callable[[], Any]) -> None:
        def run() -> None:
            if not outer.set_running_or_notify_cancel():
                return
            try:
                result = call()
            except BaseException as e:
                outer.set_exception(e)
            else:
                outer.set_result(result)

        try:
            inner = pool(self._name, self._workers).submit(run)
        except RuntimeError as e:  # the interpreter is exiting: pools take no new work
            if outer.set_running_or_notify_cancel():
                outer.set_exception(e)
            self._next()
            return
        inner.add_done_callback(lambda _: self._next())

    def _next(self) -> None:
        with self._lock:
            if not self._queue:
                self._free += 1
                return
            outer, call = self._queue.popleft()
        self._start(outer, call)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Takes no more tasks; cancels queued ones if asked, and waits for the rest."""
        with self._lock:
            closing, self._closed = not self._closed, True
            futures = list(self._futures)
            queued = [outer for outer, _ in self._queue] if cancel_futures else []
        for outer in queued:
            outer.cancel()
        if closing:  # its threads are free for other leases once its tasks end
            with _lock:
                _leased[self._name] -= self._limit
        if wait:
            wait_for(futures)


def borrow(name: str, limit: int) -> Lease:
    """A lease of at most ``limit`` threads of the process's pool ``name``.

    Use it where a ``ThreadPoolExecutor(limit)`` would be created for one
    call: ``with borrow("commit", 16) as pool: pool.submit(...)``.
    """
    return Lease(name, limit)


def detached(name: str, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
    """Runs ``fn`` on a new daemon thread ``jaxckpt-NAME``; its result (or exception) comes
    in the future. Unlike a pool's thread, interpreter exit does not wait for it: use it for
    what a process may abandon at exit (a request retried while its store does not answer).
    """
    future: Future[_T] = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:
            future.set_exception(e)
        else:
            future.set_result(result)

    threading.Thread(target=run, name=f"jaxckpt-{name}", daemon=True).start()
    return future


POLL_S = 0.1
"""The slice :func:`result` waits in."""


def result(future: Future[_T]) -> _T:
    """``future.result()``, waited for in slices of :data:`POLL_S`.

    A process-directed SIGINT may be taken by any thread; CPython then runs the handler
    on the main thread at its next bytecode, which a main thread blocked in a lock without
    a timeout never reaches: a Ctrl-C would wait for the task. Here it waits at most a slice.
    """
    while not future.done():
        wait_for([future], timeout=POLL_S)
    return future.result()


def shutdown_all() -> None:
    """Shuts every pool down (queued work is cancelled); later calls create new ones."""
    with _lock:
        pools = list(_pools.values())
        _pools.clear()
        _sizes.clear()
        _leased.clear()
    for executor in pools:
        executor.shutdown(wait=False, cancel_futures=True)


def _forget_after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    _pools.clear()
    _sizes.clear()
    _leased.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(shutdown_all)


def lower_thread_priority(nice: int, what: str = "the save thread") -> None:
    """Raises the calling thread's nice value to ``nice`` (Linux: per thread; never lowers it).

    Threads it starts inherit the value. Elsewhere, or without permission, logs (naming
    ``what``) and goes on.
    """
    if nice <= 0:
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (AttributeError, OSError) as e:
        logging.getLogger("jaxckpt").warning(
            "could not lower %s's priority to nice %d: %s", what, nice, e
        )
