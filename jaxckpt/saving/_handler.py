"""The Orbax extension points: a handler, its args and a step path.

``orbax.checkpoint.AsyncCheckpointer`` drives a save: it calls
:meth:`StepPath.create` on the primary host (:meth:`SaveSession.begin`, which has
nothing left to do), then :meth:`ZarrHandler.async_save` on every host (the
blocking host snapshot; the returned future runs :meth:`SaveSession.write` on
Orbax's background thread: this process's chunks, its manifest part and the
agreed commit, marker included), waits for that future, and calls
:meth:`StepPath.finalize` on the primary host (:meth:`SaveSession.commit`, which
ends the session). Orbax's collectives in the blocking phase are the manager's
agreements (:mod:`jaxckpt.saving._meet`: deadline-bounded, they carry failures); its
barriers after the write and the commit are no-ops (``_already_met``: the session's
agreements met every host there already); its metadata store is a no-op,
and its tmp-directory-and-rename commit is not used: the final path is never
renamed. What Orbax still provides: the blocking/background split, the
background thread and ``wait_until_finished``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.path import atomicity_types

from jaxckpt._options import CheckpointOptions
from jaxckpt._pools import lower_thread_priority
from jaxckpt.formats import HostArray, snapshot_array
from jaxckpt.records import SavedLeaf
from jaxckpt.saving._meet import Meetings, meeting_checkpointer


class SessionHooks(Protocol):
    """What Orbax's handler and step path call on the save session (``SaveSession``):
    begin, write (and commit, agreed) and end a step. A layout's writer of a step's
    chunks is :class:`jaxckpt.formats.StepWriter`, another thing."""

    def begin(self, step: int) -> None: ...

    def write(
        self, step: int, leaves: Sequence[SavedLeaf], arrays: Sequence[HostArray]
    ) -> None: ...

    def commit(self, step: int) -> None: ...


@dataclasses.dataclass
class SaveArgs(ocp.args.CheckpointArgs):
    """Orbax args for one save: the step, its described leaves and their values."""

    step: int
    leaves: Sequence[SavedLeaf]
    values: Sequence[Any]


class ZarrHandler(ocp.AsyncCheckpointHandler):
    """Saves a described pytree as zarr v3 arrays, one writer per chunk."""

    def __init__(
        self,
        session: SessionHooks,
        *,
        primary_host: int = 0,
        per_host: bool = False,
        writer_nice: int = 0,
    ) -> None:
        self._session = session
        self._primary_host = primary_host
        self._per_host = per_host  # a local tier: every host keeps every index it addresses
        self._executor = ThreadPoolExecutor(
            1,
            thread_name_prefix="jaxckpt-write",
            initializer=lower_thread_priority,
            initargs=(writer_nice,),
        )

    async def async_save(self, directory: epath.Path, args: SaveArgs) -> list[Future[None]]:
        primary = jax.process_index() == self._primary_host
        arrays = [
            snapshot_array(leaf, value, primary=primary, every_index=self._per_host)
            for leaf, value in zip(args.leaves, args.values, strict=True)
            if leaf.kind != "value"
        ]
        return [self._executor.submit(self._session.write, args.step, args.leaves, arrays)]

    def save(self, directory: epath.Path, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("jaxckpt saves only through AsyncCheckpointer")

    def restore(self, directory: epath.Path, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("restore through jaxckpt.CheckpointManager.restore")

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self) -> None:
        self._executor.shutdown(wait=True)


@dataclasses.dataclass
class RestoreArgs(ocp.args.CheckpointArgs):
    """Orbax requires restore args for a handler; restores go through the manager."""


ocp.args.register_with_handler(ZarrHandler, for_save=True)(SaveArgs)
ocp.args.register_with_handler(ZarrHandler, for_restore=True)(RestoreArgs)


class NoopMetadataStore:
    """Orbax's metadata store, switched off: jaxckpt keeps its own records."""

    def is_blocking_writer(self) -> bool:
        return True

    def write(self, file_path: Any, metadata: Any) -> None:
        pass

    def read(self, file_path: Any) -> None:
        return None

    def update(self, file_path: Any, **kwargs: Any) -> None:
        pass

    def wait_until_finished(self) -> None:
        pass

    def close(self) -> None:
        pass


_PLACEHOLDER = "jaxckpt-orbax-placeholder"


class _OwnSaveFailures(logging.Filter):
    """Shortens Orbax's log of a failed background save of a jaxckpt step to one line,
    and drops its INFO lines that name the placeholder (a path that does not exist).

    Orbax logs the failure with its traceback (22-44 lines) and stores the
    exception, which jaxckpt re-raises as ``SaveFailedError``; the record then
    says, on one line, which step failed and why. Records of other checkpointers
    (whose directory is not jaxckpt's placeholder) pass unchanged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if _PLACEHOLDER in record.getMessage() and record.levelno < logging.WARNING:
            return False  # Orbax's INFO lines about a save name the placeholder, no real path
        if "Handler Commit operations" not in text or _PLACEHOLDER not in text:
            return True
        error = record.exc_info[1] if record.exc_info else None
        step = text.rstrip("/").rsplit("/", 1)[-1]
        why = f": {type(error).__name__}: {error}" if error is not None else ""
        line = f"jaxckpt: background save of step {step} failed{why}"
        record.msg = " ".join(line.split())  # one line, whatever the exception says
        record.args = None
        record.exc_info = record.exc_text = None
        return True


_FILTER = _OwnSaveFailures()


def install_log_filter() -> None:
    """Installs the filter on Orbax's (absl's) logger, once per process."""
    from jaxckpt.saving._orbaxlog import quiet_orbax_info

    quiet_orbax_info()  # Orbax's six INFO lines per save: jaxckpt logs one
    logger = logging.getLogger("absl")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)


def orbax_step_path(step: int) -> epath.Path:
    """The directory handed to Orbax for ``step``: a placeholder it never touches.

    Orbax only needs a path whose name is the step (barrier keys use it): the
    handler writes through jaxckpt's storage, :class:`StepPath` commits through
    the marker protocol, the metadata store is a no-op and file validations are
    skipped. A local placeholder, rather than the root's URI, guarantees that no
    Orbax or etils code path can open a ``gs://``/``s3://`` URL with its own
    client (which would ignore jaxckpt's endpoint and credentials settings).
    """
    return epath.Path(tempfile.gettempdir()) / _PLACEHOLDER / str(step)


def step_path_class(session: SessionHooks) -> type[atomicity_types.TemporaryPath]:
    """A TemporaryPath bound to ``session``: create = begin, finalize = commit (the end)."""

    class StepPath(atomicity_types.TemporaryPath):
        def __init__(self, final_path: epath.Path) -> None:
            self._final = final_path
            self._step = int(final_path.name)

        @classmethod
        async def validate(cls, temporary_path: epath.Path) -> None:
            pass

        @classmethod
        async def validate_final(cls, final_path: epath.Path) -> None:
            pass

        @classmethod
        def from_temporary(cls, temporary_path: epath.Path, **kwargs: Any) -> StepPath:
            return cls(temporary_path)

        @classmethod
        def from_final(cls, final_path: epath.Path, **kwargs: Any) -> StepPath:
            return cls(final_path)

        def get(self) -> epath.Path:
            return self._final

        def get_final(self) -> epath.Path:
            return self._final

        async def create(self) -> epath.Path:
            session.begin(self._step)
            return self._final

        async def finalize(self, *args: Any, **kwargs: Any) -> None:
            session.commit(self._step)

    return StepPath


def _already_met(*, key: str, timeout_ms: int) -> None:
    """Orbax's barriers after the write and after the commit: the session's ``write``
    already met every process after both (its agreements, which carry failures)."""


def make_checkpointer(
    session: SessionHooks,
    options: CheckpointOptions,
    *,
    per_host: bool = False,
    meetings: Meetings | None = None,
) -> ocp.AsyncCheckpointer:
    """An AsyncCheckpointer wired to jaxckpt's handler and commit protocol.

    Closing the checkpointer closes the handler (and its writer thread).

    ``options.primary_host`` creates and commits each step (Orbax's primary host) and
    writes the numpy leaves, as it writes the tree record in the manager; the save's
    bound is ``options.save_timeout_s``, its writer's nice ``options.writer_nice``.
    ``per_host``: saves to a local tier (see :func:`~jaxckpt.formats._tsio.snapshot_array`).
    ``meetings``: Orbax's barriers after its first become these (see ``_meet``).
    """
    install_log_filter()
    timeout_s, primary_host = options.save_timeout_s, options.primary_host
    writer_nice = options.writer_nice
    checkpointer = ocp.AsyncCheckpointer if meetings is None else meeting_checkpointer(meetings)
    # Orbax's bound on the background save is a backstop: the save's own waits end by
    # its deadline (see Agreement.detached) with an error naming who never came.
    backstop_s = math.ceil(timeout_s + min(5.0, max(1.0, 0.1 * timeout_s)))
    return checkpointer(
        ZarrHandler(session, primary_host=primary_host, per_host=per_host, writer_nice=writer_nice),
        timeout_secs=backstop_s,
        async_options=ocp.options.AsyncOptions(
            timeout_secs=backstop_s,
            create_directories_asynchronously=False,
            barrier_sync_fn=_already_met,
        ),
        file_options=ocp.options.FileOptions(skip_sync_file_validations=True),
        checkpoint_metadata_store=NoopMetadataStore(),
        temporary_path_class=step_path_class(session),
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=primary_host),
    )
