"""Decisions made once and shared with every host, and failures every host learns of.

Uses the JAX distributed coordination service's key-value store and barriers,
whose waits take a timeout, so a dead process makes the others fail instead of
hang. With one process this is the identity.

Costs per process are constant in the number of processes N: an :meth:`agree`
is one set (the primary) or one blocking get; a :meth:`gather`,
:meth:`reports` or :meth:`settle` is a set, a barrier and one directory read
(``key_value_dir_get``). Only :meth:`gather` returns O(N) values, and only
the callers that need every value use it (peers, local tiers); :meth:`reports`
and :meth:`settle` read only what processes reported (failures, usually none).

Keys are scoped by *operation* (:meth:`operation`): one public collective call
of the manager, such as the save of step 5 or the third restore. Inside it a
counter numbers the agreements, and it starts again at the next operation, so
processes that failed at different points of one operation meet again at the
next. The primary deletes an operation's keys at the first barrier after it
(every process has then read them), and the rest at :meth:`close`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import jax

from jaxckpt import errors
from jaxckpt.errors import CheckpointError

log = logging.getLogger("jaxckpt")


class AgreementTimeoutError(CheckpointError, TimeoutError):
    """Not every process reached an agreement within its timeout.

    A process failed, stalled or died before it: its own log says why. A save
    that meets it raises ``SaveTimeoutError``.
    """


_TOLD_MS = 1000
"""How long a process that reported a failure waits for the others at the barrier: if
they are not all there by then, the barrier fails for every process, and each reads the
reports (a process arriving later fails at once)."""

_opened: dict[str, int] = {}
_opened_lock = threading.Lock()


class Agreement:
    """Shares the primary's decisions for one manager; keys are namespaced by root."""

    @classmethod
    def for_root(cls, root: str, *, primary: int, timeout_s: float) -> Agreement:
        """The agreement of the n-th manager of ``root`` in this process (its keys are
        the same on every host, which opens its managers in the same order)."""
        with _opened_lock:
            n = _opened[root] = _opened.get(root, -1) + 1
        return cls(f"{zlib.crc32(root.encode()):08x}.{n}", primary=primary, timeout_s=timeout_s)

    def __init__(self, namespace: str, *, primary: int = 0, timeout_s: float = 300.0) -> None:
        self._namespace = namespace
        self._primary = primary
        self._timeout_s = timeout_s
        self._op = "open"  # the manager's open, until its first operation
        self._depth = 0
        self._counter = itertools.count()
        self._runs: dict[str, int] = {}
        self._stale: list[str] = []  # operations whose keys every process has read

    @contextlib.contextmanager
    def operation(self, kind: str, key: object = None) -> Iterator[None]:
        """Scopes the agreements inside to one collective operation of every process.

        ``kind`` and ``key`` (e.g. ``"save"``, the step) name it; the n-th
        operation of that name on this manager has the same keys on every host
        (every host makes the same collective calls in the same order). Nested
        operations stay in the outer one.
        """
        if self._depth:
            yield
            return
        self._stale.append(f"{self._base}{self._op}/")  # the operation before is over
        name = kind if key is None else f"{kind}-{key}"
        n = self._runs[name] = self._runs.get(name, -1) + 1
        self._op, self._counter, self._depth = f"{name}.{n}", itertools.count(), 1
        try:
            yield
        finally:
            self._depth = 0

    def detached(self) -> Agreement:
        """An agreement for another thread's part of the current operation (a save's
        background write): its keys stay the same whatever this one does meanwhile.
        Hand it to :meth:`forget` once every process is past it."""
        return Agreement(
            f"{self._namespace}/{self._op}-bg", primary=self._primary, timeout_s=self._timeout_s
        )

    def forget(self, detached: Agreement) -> None:
        """``detached``'s keys go at the next barrier (every process is past it)."""
        self._stale.append(detached._base)

    def agree(self, name: str, value: Any) -> Any:
        """Returns the primary's ``value`` on every process (JSON-serialisable).

        Every process must call ``agree`` in the same order with the same ``name``.

        Raises:
          CheckpointError: the primary did not publish within the timeout.
        """
        if jax.process_count() == 1:
            return value
        client = self._client()
        key = self._key(name)
        if jax.process_index() == self._primary:
            client.key_value_set(key, json.dumps(value))
            return value
        try:
            raw = client.blocking_key_value_get(key, self._timeout_ms)
        except Exception as e:
            raise CheckpointError(
                f"process {jax.process_index()}: no decision {name!r} from the primary "
                f"(process {self._primary}) within {self._timeout_s:g}s: {e}"
            ) from e
        return json.loads(raw)

    def gather(self, name: str, value: Any) -> list[Any]:
        """Every process's ``value`` (JSON-serialisable), by process index: a set, a
        barrier and one directory read. For values every process needs (O(N) bytes).

        Also a barrier. Every process must call ``gather`` in the same order.

        Raises:
          CheckpointError: some process did not arrive within the timeout.
        """
        if jax.process_count() == 1:
            return [value]
        found = self._exchange(name, value)
        missing = [p for p in range(jax.process_count()) if p not in found]
        if missing:  # every process sets its key before the barrier
            raise CheckpointError(f"no {name!r} from processes {missing} after the barrier")
        return [found[p] for p in range(jax.process_count())]

    def reports(self, name: str, report: Any) -> dict[int, Any]:
        """The non-None ``report`` of every process that has one, by process index.

        Only processes with a report write a key, and the directory read returns
        only those: a set (if any), a barrier and one read per process, whatever N.
        Also a barrier. Every process must call it in the same order.

        Raises:
          CheckpointError: some process did not arrive within the timeout.
        """
        if jax.process_count() == 1:
            return {} if report is None else {0: report}
        return self._exchange(name, report, reporting=True)

    def any_true(self, name: str, flag: bool) -> bool:
        """True on every process when ``flag`` is true on any process (collective)."""
        return bool(self.reports(name, True if flag else None))

    def settle(
        self, name: str, error: BaseException | None, *, what: str, share: Any = None
    ) -> dict[int, Any]:
        """Raises on every process when any process failed (``error``); a barrier.

        Every process raises an error of the failing process's class (when it is a
        ``CheckpointError``; its own error otherwise) naming that process and its
        message: the failing process names itself. ``what`` says what failed.

        ``share``: a small value (JSON) each process sends the primary with its arrival
        (e.g. a summary of what it wrote); the primary alone reads them all, with one
        directory read more, and gets them by process index. Others get ``{}``.

        Raises:
          CheckpointError: some process failed, or did not arrive within the timeout.
        """
        if jax.process_count() == 1:
            if error is not None:
                raise error
            return {} if share is None else {0: share}
        report = None if error is None else [type(error).__name__, str(error)]
        shared: dict[int, Any] = {}
        try:
            failed = self._exchange(name, report, reporting=True, share=share, shared=shared)
        except CheckpointError as e:
            if error is not None:
                raise error from e
            raise type(e)(f"{what}: {e}") from e
        if error is not None and not isinstance(error, CheckpointError):
            raise error  # not ours (a bug, an interrupt): as it is
        if failed:
            raise failure(failed, what, first=jax.process_index()) from error
        return shared

    @property
    def primary(self) -> int:
        """The process whose decisions are shared."""
        return self._primary

    @property
    def timeout_s(self) -> float:
        """How long any wait of this agreement lasts at most."""
        return self._timeout_s

    def close(self) -> None:
        """Removes every key this agreement wrote, once every process is done with them.

        Each process says it is closing (after its last agreement, so it reads no
        more keys), then reads who has: the last to say so sees every process and
        deletes the namespace. Two calls per process whatever N, and nobody waits; a
        process that never closes leaves the keys in place, never a hang.
        """
        if jax.process_count() == 1:
            return
        client = self._client()
        client.key_value_set(f"{self._base}closed/{jax.process_index()}", "1")
        closed = client.key_value_dir_get(f"{self._base}closed/")
        if len(closed) == jax.process_count():  # this process closed last (or after it)
            with contextlib.suppress(Exception):  # two that see every key both delete
                client.key_value_delete(self._base)

    # -- the coordination service --------------------------------------------

    def _exchange(
        self,
        name: str,
        value: Any,
        *,
        reporting: bool = False,
        share: Any = None,
        shared: dict[int, Any] | None = None,
    ) -> dict[int, Any]:
        """Sets ``value`` (None: only that this process arrived), meets every process at a
        barrier and reads the values set; returns them by process index.

        ``reporting``: values are reports (failures). A process with one has told it
        before the barrier, so it waits there briefly; a barrier that fails (it left,
        or a process never came) still returns the reports set, if any. Else a barrier
        that times out names the processes that never arrived.
        ``share``: carried by the arrival key; the primary reads every process's into
        ``shared`` after the barrier (see :meth:`settle`).
        """
        client = self._client()
        base = self._key(name)
        me = jax.process_index()
        if value is not None:
            client.key_value_set(f"{base}/v/{me}", json.dumps(value))
        else:
            client.key_value_set(f"{base}/a/{me}", "" if share is None else json.dumps(share))
        told = reporting and value is not None
        try:
            client.wait_at_barrier(
                base, min(self._timeout_ms, _TOLD_MS) if told else self._timeout_ms
            )
        except Exception as e:
            keys = client.key_value_dir_get(base + "/")
            found = {_index(k): json.loads(raw) for k, raw in keys if f"{base}/v/" in k}
            if reporting and found:  # the barrier failed because a process failed
                return found
            missing = sorted(set(range(jax.process_count())) - {_index(k) for k, _ in keys})
            raise AgreementTimeoutError(
                f"process {me}: no {name!r} from processes {missing} within "
                f"{self._timeout_s:g}s (failed, stalled or died: see their logs): {e}"
            ) from e
        self._forget_stale(client)
        found = {_index(k): json.loads(raw) for k, raw in client.key_value_dir_get(f"{base}/v/")}
        if shared is not None and share is not None and me == self._primary and not found:
            arrived = client.key_value_dir_get(f"{base}/a/")
            shared.update({_index(k): json.loads(raw) for k, raw in arrived if raw})
        return found

    def _forget_stale(self, client: Any) -> None:
        """The primary deletes the keys of finished operations: every process has
        passed a barrier after them, so none reads them any more."""
        stale, self._stale = self._stale, []
        if jax.process_index() != self._primary:
            return
        for prefix in stale:
            with contextlib.suppress(Exception):  # close() removes what is left
                client.key_value_delete(prefix)

    @property
    def _base(self) -> str:
        return f"jaxckpt/{self._namespace}/"

    def _key(self, name: str) -> str:
        return f"{self._base}{self._op}/{name}.{next(self._counter)}"

    @property
    def _timeout_ms(self) -> int:
        return int(self._timeout_s * 1000)

    def _client(self) -> Any:
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise CheckpointError("multi-process jaxckpt needs jax.distributed.initialize()")
        return client


def _index(key: str) -> int:
    """The process index that ends a key."""
    return int(key.rstrip("/").rsplit("/", 1)[-1])


def failure(failed: dict[int, Any], what: str, *, first: int | None = None) -> CheckpointError:
    """The error a process raises for the ``[class name, message]`` failures of processes
    (by index), naming ``first`` (if it failed; else the lowest)."""
    first = first if first in failed else min(failed)
    kind, message = failed[first]
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        cls, message = CheckpointError, f"{kind}: {message}"
    others = sorted(set(failed) - {first})
    also = f" (and on processes {others})" if others else ""
    return cls(f"{what} failed on process {first}{also}: {message}")
