"""Triggers on events, never on wall-clock guesses.

A test that races a signal, a timeout or another thread fires when the code under test has
reached the point it means to interrupt (a held call was entered, the main thread is inside
a given method), however busy the machine is. Every wait here is bounded by :data:`HANG_S`,
an upper bound only a hang reaches.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

HANG_S = 120.0  # only a hang waits this long, even on a loaded 2-core machine
SCRIPT_HANG_S = 600.0
"""The bound of a script run whole in a subprocess (a benchmark's tiny run took over 120 s
on a loaded 2-core machine); a test module running one sets a pytest timeout above it."""
POLL_S = 0.005


def wait_until(condition: Callable[[], bool], *, what: str, timeout_s: float = HANG_S) -> None:
    """Polls ``condition`` until it holds; fails naming ``what`` if a hang outlasts it."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s:.0f}s")
        time.sleep(POLL_S)


@contextmanager
def collection_off() -> Iterator[None]:
    """The garbage collector off inside the block (as it was after it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def current_frame(thread: threading.Thread) -> Any:
    """The frame ``thread`` is executing now (None once it ended).

    With the garbage collector off meanwhile: on CPython 3.11 a collection that starts
    inside ``sys._current_frames()`` (which holds the interpreter's thread-list lock)
    can wait for that lock itself, and every thread of the process hangs (gh-106883).
    """
    with collection_off():
        return sys._current_frames().get(thread.ident or 0)


def api_call_of_main_thread() -> str | None:
    """The ``CheckpointManager`` method the main thread is inside, outermost first (the call
    the test made, not one it makes itself: ``save`` calls ``wait``), e.g. ``"wait"``."""
    frame = current_frame(threading.main_thread())
    outermost = None
    while frame is not None:
        code = frame.f_code
        if code.co_qualname.startswith("CheckpointManager.") and (
            f"{os.sep}jaxckpt{os.sep}" in code.co_filename
        ):
            outermost = code.co_qualname.removeprefix("CheckpointManager.")
        frame = frame.f_back
    return outermost


def main_thread_in(method: str) -> Callable[[], bool]:
    """A condition: the main thread is inside ``CheckpointManager.<method>`` as its API call."""
    return lambda: api_call_of_main_thread() == method


class Interrupter:
    """Sends a process-directed SIGINT (as a terminal's Ctrl-C) once ``condition`` holds.

    Use as a context manager: leaving the block joins the sending thread; :attr:`sent` is
    set once the signal was sent. ``elsewhere``: the signal goes to the sending thread
    itself, as the kernel may hand a Ctrl-C to any thread of the process.

    The garbage collector is off inside the block: CPython ignores an exception raised in a
    gc callback (JAX registers one), so a ``KeyboardInterrupt`` whose handler ran there
    would be lost, whatever the code under test does.
    """

    def __init__(
        self, condition: Callable[[], bool], *, what: str, elsewhere: bool = False
    ) -> None:
        self._elsewhere = elsewhere
        self._collection_off = collection_off()
        self.sent = threading.Event()
        self._cancelled = threading.Event()
        self._condition = condition
        self._what = what
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="interrupter", daemon=True)

    def _run(self) -> None:
        try:
            wait_until(lambda: self._cancelled.is_set() or self._condition(), what=self._what)
        except BaseException as e:  # reported by __exit__
            self._error = e
            return
        if self._cancelled.is_set():
            return
        self.sent.set()  # before the signal: the main thread may check it at once
        if self._elsewhere:
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        else:
            os.kill(os.getpid(), signal.SIGINT)

    def __enter__(self) -> Interrupter:
        self._collection_off.__enter__()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None:  # the block failed (e.g. did not raise): no signal after it
            self._cancelled.set()
        self._thread.join(HANG_S)
        self._collection_off.__exit__(None, None, None)
        if self._error is not None and exc[0] is None:
            raise self._error


class Hold:
    """Wraps a function so that every call announces itself and then holds until released.

    :attr:`entered` is set when the first call starts, :attr:`returned` counts the calls
    that went on (after :meth:`release`, or after :data:`HANG_S`, which only a hang reaches).
    """

    def __init__(self, function: Callable[..., Any]) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()
        self.returned = 0
        self._function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        self.released.wait(HANG_S)
        try:
            return self._function(*args, **kwargs)
        finally:
            self.returned += 1

    def release(self) -> None:
        self.released.set()

    def as_method(self) -> Callable[..., Any]:
        """This hold as a plain function, to patch a method with (``self`` is passed on)."""

        def held(*args: Any, **kwargs: Any) -> Any:
            return self(*args, **kwargs)

        return held
