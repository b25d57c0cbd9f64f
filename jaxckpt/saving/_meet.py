"""Orbax's barriers in a save's blocking phase, as agreements that carry failures.

Orbax's ``AsyncCheckpointer.save`` meets every process at collectives without a
deadline (gloo all-gathers) between pieces of local work: a process that failed
between two of them (its file descriptors ran out as Orbax created its event
loop) raised, and every other process waited in the next collective for ever.

Here Orbax's first one (``save_start``, before any local work) is the save's own
``checks`` settle just before it, and the one after the snapshots is a meeting of the
manager's :class:`~jaxckpt.commit._agree.Agreement`:
coordination-service barriers with the save's deadline that carry failures. A
process that fails locally anywhere inside Orbax's save *tells* its failure at
its next meeting, which is the meeting the others wait at (the agreement's keys
count meetings, and every process has met as often), so every process raises
at once, naming the failing one. A failure that a meeting raised was met by
every process already and is not told again.

Orbax's barrier before the handler (after ``create_temporary_path``) is no meeting:
the handler's background write waits until ``save`` has returned (``Inflight.release``),
so a failure anywhere before the meeting after the snapshots, on any process, is met
there before any process writes anything (and no write competes with the blocking
phase for the interpreter).
"""

from __future__ import annotations

import contextlib
from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint._src.futures import synchronization
from orbax.checkpoint._src.multihost import multihost

from jaxckpt.commit import Agreement
from jaxckpt.errors import CheckpointError, SaveFailedError

__all__ = ["Meetings", "meeting_checkpointer"]

MEETING = "orbax"
"""The name of every meeting (the agreement's counter tells them apart)."""


class Meetings:
    """The meetings of one manager's saves (see the module docstring)."""

    def __init__(self, agreement: Agreement) -> None:
        self._agreement = agreement
        self._what = "save"
        self._met_failure = False

    def begin(self, what: str) -> None:
        """A save starts (``what`` names it in messages): no failure met yet."""
        self._what, self._met_failure = what, False

    def meet(self, error: BaseException | None = None) -> None:
        """Meets every process (a barrier with the save's deadline), telling ``error``.

        Raises:
          CheckpointError: some process failed (named; ``SaveFailedError`` unless its
            error was a more specific ``CheckpointError``), or did not arrive in time.
        """
        try:
            self._agreement.settle(MEETING, error, what=self._what)
        except CheckpointError as e:
            self._met_failure = True
            if type(e) is CheckpointError:  # another process's OSError, ...: a failed save
                raise SaveFailedError(str(e)) from e
            raise
        except BaseException:
            self._met_failure = True
            raise

    def tell(self, error: BaseException) -> None:
        """After ``error`` inside Orbax's save on this process: tells the others, who
        wait at this process's next meeting (unless a meeting raised it: they know)."""
        if self._met_failure:
            return
        self._met_failure = True
        with contextlib.suppress(Exception):  # the caller raises its own error
            self._agreement.settle(MEETING, error, what=self._what)


def meeting_checkpointer(meetings: Meetings) -> type[ocp.AsyncCheckpointer]:
    """An ``AsyncCheckpointer`` whose barriers after ``save_start`` are ``meetings``."""

    class MeetingCheckpointer(ocp.AsyncCheckpointer):
        def synchronize_next_awaitable_signal_operation_id(self) -> None:
            # Orbax meets after this increment; the meeting after the snapshots (before
            # any background work, which is what uses the id) does it here.
            synchronization.OperationIdGenerator.next_operation_id()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # Orbax's first barrier (``save_start``: a gloo all-gather of the devices, with
            # no deadline) comes right after the save's "checks", which every process met
            # with its failures: a barrier of this process alone is skipped.
            self._active_processes = {multihost.process_index()}

        async def create_temporary_path(self, temporary_path: Any) -> None:
            # No meeting: the background write waits for the end of ``save`` (see the
            # module docstring). The primary's create only checks the step (``save`` began
            # the attempt, agreed): a failure there is told at the next meeting.
            if multihost.is_primary_host(self._primary_host):
                await temporary_path.create()

        async def _save(self, tmpdir: Any, *args: Any, **kwargs: Any) -> Any:
            ops = await super()._save(tmpdir, *args, **kwargs)
            meetings.meet()  # every process took its snapshots: none failed before writing
            return ops

    return MeetingCheckpointer
