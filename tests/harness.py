"""Child processes for the tests that pause, kill and outlive writers.

The crash, multi-host, tier, writer and training tests all run real processes
and stop them at a named point of the protocol. ``jaxckpt/commit/_phases.py`` is how a
child announces those points: with ``JAXCKPT_PAUSE_AT=<phase>[,...]`` it prints
``JAXCKPT_PHASE <phase> <step>`` to stderr and pauses; with
``JAXCKPT_RESUME_DIR`` it also creates ``<dir>/<phase>-<step>.reached`` and
goes on once ``<dir>/<phase>-<step>.resume`` exists; ``JAXCKPT_TRACE=1`` prints
``JAXCKPT_TRACE <phase> <step>`` at every phase. This module is the one place
that builds that environment, spawns a child with its output read line by
line, waits for a phase (by its stderr line or by its ``.reached`` file),
SIGKILLs, and bounds how long a survivor may take to exit.

Every wait has a timeout; a child that exits (or goes past the phase) first
raises :class:`PhaseNotReachedError`, a timeout fails the test with the
child's output.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

PAUSE_AT = "JAXCKPT_PAUSE_AT"
PAUSE_S = "JAXCKPT_PAUSE_S"
RESUME_DIR = "JAXCKPT_RESUME_DIR"
TRACE = "JAXCKPT_TRACE"

POLL_S = 0.05


class PhaseNotReachedError(AssertionError):
    """A child exited, went past, or timed out before it reached the awaited point."""


def phase_line(phase: str, step: int) -> str:
    """The stderr line a child prints when it pauses at ``phase`` of ``step``."""
    return f"JAXCKPT_PHASE {phase} {step}"


def reached_file(resume_dir: Path, phase: str, step: int) -> Path:
    """The file a resumable pause creates on reaching ``phase`` of ``step``."""
    return resume_dir / f"{phase}-{step}.reached"


def resume(resume_dir: Path, phase: str, step: int) -> None:
    """Lets a child paused (or about to pause) at ``phase`` of ``step`` go on."""
    (resume_dir / f"{phase}-{step}.resume").touch()


def child_env(
    *,
    inherit_jaxckpt: bool = False,
    pause_at: str | Sequence[str] | None = None,
    resume_dir: Path | None = None,
    pause_s: float | None = None,
    trace: bool = False,
    base: Mapping[str, str] | None = None,
    **extra: str,
) -> dict[str, str]:
    """This process's environment for a child, with the phase hooks set as asked.

    Args:
      inherit_jaxckpt: keep this process's own ``JAXCKPT_*`` variables (off: a
        child pauses only where its test says).
      pause_at: a phase or phases to pause at (``JAXCKPT_PAUSE_AT``).
      resume_dir: makes the pauses resumable (``JAXCKPT_RESUME_DIR``).
      pause_s: the longest pause (``JAXCKPT_PAUSE_S``).
      trace: print every phase (``JAXCKPT_TRACE=1``).
      base: the environment to start from (default ``os.environ``).
      **extra: further variables, set last.
    """
    source = os.environ if base is None else base
    env = {k: v for k, v in source.items() if inherit_jaxckpt or not k.startswith("JAXCKPT_")}
    if pause_at is not None:
        env[PAUSE_AT] = pause_at if isinstance(pause_at, str) else ",".join(pause_at)
    if resume_dir is not None:
        env[RESUME_DIR] = str(resume_dir)
    if pause_s is not None:
        env[PAUSE_S] = f"{pause_s:g}"
    if trace:
        env[TRACE] = "1"
    env.update(extra)
    return env


def wait_until(
    condition: Callable[[], object],
    *,
    what: str,
    timeout_s: float,
    gone: Callable[[], object] | None = None,
    report: Callable[[], str] = lambda: "",
    poll_s: float = POLL_S,
) -> None:
    """Polls ``condition`` until it holds.

    Raises:
      PhaseNotReachedError: ``gone()`` held first (the child exited or went past).
      pytest.fail: ``timeout_s`` passed first.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if gone is not None and gone():
            raise PhaseNotReachedError(f"gone before {what}\n{report()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout_s:.0f}s\n{report()}")
        time.sleep(poll_s)


def kill(proc: subprocess.Popen[Any], timeout_s: float = 30.0) -> int:
    """SIGKILLs ``proc`` unless it already exited; returns its exit status."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    return proc.wait(timeout=timeout_s)


def kill_and_outlive(
    target: subprocess.Popen[Any],
    survivor: subprocess.Popen[Any],
    timeout_s: float,
    hang: str,
    report: Callable[[], str] = lambda: "",
) -> None:
    """SIGKILLs ``target``; ``survivor`` must exit within ``timeout_s``, else the test fails."""
    target.send_signal(signal.SIGKILL)
    try:
        survivor.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{hang}\n{report()}")


class Child:
    """A child process whose stdout and stderr lines are read as they come.

    Two daemon threads drain the pipes (so a chatty child never blocks), and
    every line is kept: ``stdout`` and ``stderr`` hold them in order, ``lines``
    both, tagged. Waits consume lines in arrival order, so each ``expect``
    looks only at lines newer than the one the previous wait matched.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdout: bool = True,
        timeout_s: float = 60.0,
        exit_timeout_s: float | None = None,
    ) -> None:
        """Starts ``argv``.

        Args:
          argv: the command.
          env: its environment (default: :func:`child_env` ()).
          stdout: capture stdout (else it goes to ``/dev/null``).
          timeout_s: the default bound of every wait for a line or a phase.
          exit_timeout_s: the bound of :meth:`finish`'s wait for the exit and of
            reading the rest of the output (default ``timeout_s``).
        """
        self.argv = list(argv)
        self.timeout_s = timeout_s
        self.exit_timeout_s = timeout_s if exit_timeout_s is None else exit_timeout_s
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE if stdout else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(child_env() if env is None else env),
        )
        self.lines: list[str] = []
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._queue: queue.Queue[tuple[str, str | None]] = queue.Queue()
        streams = [("err", self.proc.stderr)]
        if stdout:
            streams.insert(0, ("out", self.proc.stdout))
        self._readers = [
            threading.Thread(target=self._read, args=(name, stream), daemon=True)
            for name, stream in streams
        ]
        self._open_streams = len(self._readers)
        for t in self._readers:
            t.start()

    def _read(self, name: str, stream: Any) -> None:
        for line in stream:
            self._queue.put((name, line.rstrip("\n")))
        self._queue.put((name, None))

    def _next(self, deadline: float) -> str | None:
        name, line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        if line is None:
            self._open_streams -= 1
        else:
            self.lines.append(f"[{name}] {line}")
            (self.stdout if name == "out" else self.stderr).append(line)
        return line

    def _await(self, matches: Callable[[str], re.Match[str] | None], what: str, timeout: float):
        deadline = time.monotonic() + timeout
        while self._open_streams:
            try:
                line = self._next(deadline)
            except queue.Empty:
                break
            match = matches(line) if line is not None else None
            if match:
                return match
        message = (
            f"no line {what} within {timeout:.0f}s (exit code {self.proc.poll()}); "
            f"child output:\n{self.transcript()}"
        )
        self.kill()
        raise PhaseNotReachedError(message)

    def expect(self, pattern: str, *, timeout: float | None = None) -> re.Match[str]:
        """Waits for a new line (stdout or stderr) that matches ``pattern`` in full."""
        regex = re.compile(pattern)
        return self._await(regex.fullmatch, f"matching {pattern!r}", timeout or self.timeout_s)

    def search(self, pattern: str, *, timeout: float | None = None) -> re.Match[str]:
        """Waits for a new line (stdout or stderr) in which ``pattern`` occurs."""
        regex = re.compile(pattern)
        return self._await(regex.search, f"containing {pattern!r}", timeout or self.timeout_s)

    def wait_phase(self, phase: str, step: int, *, timeout: float | None = None) -> None:
        """Waits until the child announces that it paused at ``phase`` of ``step``."""
        self.search(re.escape(phase_line(phase, step)) + "$", timeout=timeout)

    def wait_reached(
        self, resume_dir: Path, phase: str, step: int, *, timeout: float | None = None
    ) -> None:
        """Waits until a resumable pause at ``phase`` of ``step`` created its file."""
        wait_until(
            reached_file(resume_dir, phase, step).exists,
            what=f"pause at {phase} of step {step}",
            timeout_s=timeout or self.timeout_s,
            gone=lambda: self.proc.poll() is not None,
            report=self.transcript,
        )

    def finish(self, timeout: float | None = None) -> int:
        """Waits for the child to exit by itself; returns its exit code."""
        try:
            self.proc.wait(timeout=timeout or self.exit_timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("the child did not exit:\n" + self.transcript()) from None
        self.kill()  # reads the rest of the output
        return int(self.proc.returncode)

    def kill(self) -> int:
        """SIGKILL (unless it exited), then read the rest of its output; its exit code."""
        kill(self.proc, self.exit_timeout_s)
        deadline = time.monotonic() + self.exit_timeout_s
        with contextlib.suppress(queue.Empty):
            while self._open_streams:
                self._next(deadline)
        for t in self._readers:
            t.join(timeout=self.exit_timeout_s)
            assert not t.is_alive(), "an output reader of the killed child did not finish"
        return int(self.proc.returncode)

    def transcript(self) -> str:
        """The command and the last 60 lines it printed."""
        return " ".join(self.argv) + "\n" + "\n".join(self.lines[-60:])


@contextlib.contextmanager
def running(argv: Sequence[str], **kwargs: Any) -> Iterator[Child]:
    """A :class:`Child` that is SIGKILLed (if still running) when the block exits."""
    proc = Child(argv, **kwargs)
    try:
        yield proc
    finally:
        proc.kill()
