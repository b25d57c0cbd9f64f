"""Decisions made once and shared with every host, and failures every host learns of.

Uses the JAX distributed coordination service's key-value store and barriers,
whose waits take a timeout, so a dead process makes the others fail instead of
hang. With one process this is the identity.

Costs per process are constant in the number of processes N: an :meth:`agree`
is one set (the primary) or one blocking get; a :meth:`gather` is a set, a
barrier and one directory read (``key_value_dir_get``); a :meth:`reports` or
:meth:`settle` is three calls (an arrival, a count and its outcome: see
``Agreement._meet``), and a directory read only when a process reported. Only
:meth:`gather` returns O(N) values, and only the callers that need every value
use it (peers, local tiers); :meth:`reports` and :meth:`settle` read only what
processes reported (failures, usually none).

A report reaches every process at once, whatever the order in which they arrive:
a reporting meeting is not a barrier (the coordination service keeps a barrier's
first arrival's deadline, so a reporting process could not cut the others' wait
short) but one create-only outcome key that the first process to decide writes.

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
import time
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


_MET, _TOLD, _LATE = "met", "told", "late"
"""A reporting meeting's outcomes (see :meth:`Agreement._meet`): every process arrived
without a report; a process reported (it ends the meeting at once for everyone, whatever
the order of arrival); a process's wait timed out first."""

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

    def __init__(
        self,
        namespace: str,
        *,
        primary: int = 0,
        timeout_s: float = 300.0,
        deadline: float | None = None,
    ) -> None:
        self._namespace = namespace
        self._primary = primary
        self._timeout_s = timeout_s
        self._deadline = deadline  # time.monotonic(): no wait lasts past it
        self._op = "open"  # the manager's open, until its first operation
        self._depth = 0
        self._counter = itertools.count()
        self._runs: dict[str, int] = {}
        self._stale: list[str] = []  # operations whose keys every process has read
        self._keyed = True  # the current operation named a key (every process alike)

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
        if self._keyed:  # the operation before is over (one that agreed nothing left no keys)
            self._stale.append(f"{self._base}{self._op}/")
        self._keyed = False
        name = kind if key is None else f"{kind}-{key}"
        n = self._runs[name] = self._runs.get(name, -1) + 1
        self._op, self._counter, self._depth = f"{name}.{n}", itertools.count(), 1
        try:
            yield
        finally:
            self._depth = 0

    def detached(self, within_s: float | None = None) -> Agreement:
        """An agreement for another thread's part of the current operation (a save's
        background write): its keys stay the same whatever this one does meanwhile.
        Hand it to :meth:`forget` once every process is past it.

        ``within_s``: no wait of it lasts past this many seconds from now (a save's
        deadline, so that its own timeout, which names the processes that never
        came, fires before the bound of whoever waits for the whole save).
        """
        return Agreement(
            f"{self._namespace}/{self._op}-bg",
            primary=self._primary,
            timeout_s=self._timeout_s,
            deadline=None if within_s is None else time.monotonic() + within_s,
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
            raise CheckpointError(f"no {name!r} from {processes(missing)} after the barrier")
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
        """Sets ``value`` (None: only that this process arrived), meets every process and
        reads the values set; returns them by process index.

        ``reporting``: values are reports (failures), and the meeting is :meth:`_meet`'s,
        which a process with a report ends for every process at once; a meeting that
        failed (a report, or a process never came) still returns the reports set, if
        any. Else the meeting is a barrier. A meeting that timed out names the processes
        that never arrived.
        ``share``: carried by the arrival key; the primary reads every process's into
        ``shared`` after the meeting (see :meth:`settle`).
        """
        client = self._client()
        base = self._key(name)
        me = jax.process_index()
        if value is not None:
            client.key_value_set(f"{base}/v/{me}", json.dumps(value))
        else:
            client.key_value_set(f"{base}/a/{me}", "" if share is None else json.dumps(share))
        try:
            if reporting:
                met = self._meet(client, base, told=value is not None)
            else:
                client.wait_at_barrier(base, self._timeout_ms)
                met = True
        except Exception as e:
            keys = [(k, raw) for k, raw in client.key_value_dir_get(base + "/") if _arrival(k)]
            found = {_index(k): json.loads(raw) for k, raw in keys if f"{base}/v/" in k}
            if reporting and found:  # the meeting failed because a process failed
                return found
            missing = sorted(set(range(jax.process_count())) - {_index(k) for k, _ in keys})
            raise AgreementTimeoutError(
                f"process {me}: no {name!r} from {processes(missing)} within "
                f"{self._timeout_s:g}s (failed, stalled or died: see their logs): {e}"
            ) from e
        if not met:  # a process reported: every process reads the reports
            return {_index(k): json.loads(raw) for k, raw in client.key_value_dir_get(f"{base}/v/")}
        self._forget_stale(client)
        if reporting:  # every process arrived without a report
            found = {}
        else:
            found = {
                _index(k): json.loads(raw) for k, raw in client.key_value_dir_get(f"{base}/v/")
            }
        if shared is not None and share is not None and me == self._primary:
            arrived = client.key_value_dir_get(f"{base}/a/")
            shared.update({_index(k): json.loads(raw) for k, raw in arrived if raw})
        return found

    def _meet(self, client: Any, base: str, *, told: bool) -> bool:
        """Meets every process at ``base``; True when all arrived without a report.

        One key, written once (create-only), holds the meeting's outcome, and the first
        writer decides it for every process whatever the order of arrival: the process
        that completes the count of arrivals writes ``met``; a process with a report
        (it does not count itself) writes ``told`` and leaves at once; a process whose
        wait timed out writes ``late``. The others wait on that key, so a report reaches
        each of them as soon as it is made, and a process arriving after the outcome
        reads it at once. Three calls per process whatever N: the arrival key, then the
        count and the outcome (its write, or a wait on it); a report: the arrival key,
        the outcome and the read of the reports.

        Raises:
          Exception: the outcome is ``late`` (the caller names who never came).
        """
        outcome = f"{base}/outcome"
        if told:
            self._decide(client, outcome, _TOLD)
            return False
        if client.key_value_increment(f"{base}/count", 1) == jax.process_count():
            if self._decide(client, outcome, _MET):
                return True
            decided = client.key_value_try_get(outcome)  # a wait timed out just before
        else:
            try:
                decided = client.blocking_key_value_get(outcome, self._timeout_ms)
            except Exception as e:
                self._decide(client, outcome, _LATE)
                decided = client.key_value_try_get(outcome)  # ours, or one just before
                if decided == _LATE:
                    raise AgreementTimeoutError(str(e)) from e
        if decided == _LATE:
            raise AgreementTimeoutError(f"the meeting {base} timed out on another process")
        return decided == _MET

    @staticmethod
    def _decide(client: Any, outcome: str, value: str) -> bool:
        """Writes a meeting's outcome unless another process has: True if this one did."""
        try:
            client.key_value_set(outcome, value)
        except Exception:  # ALREADY_EXISTS: decided by another process first
            return False
        return True

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
        self._keyed = True
        return f"{self._base}{self._op}/{name}.{next(self._counter)}"

    @property
    def _timeout_ms(self) -> int:
        wait_s = self._timeout_s
        if self._deadline is not None:
            wait_s = min(wait_s, self._deadline - time.monotonic())
        return max(1, int(wait_s * 1000))

    def _client(self) -> Any:
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise CheckpointError("multi-process jaxckpt needs jax.distributed.initialize()")
        return client


def _arrival(key: str) -> bool:
    """Whether a key under a meeting is a process's arrival (not its count or outcome)."""
    return "/a/" in key or "/v/" in key


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
    also = f" (and on {processes(others)})" if others else ""
    return cls(f"{what} failed on process {first}{also}: {message}")


def processes(indices: list[int], *, most: int = 8) -> str:
    """``process 3``, ``processes 1, 3`` or, past ``most``, ``12 processes (1, 3, ...)``."""
    if len(indices) == 1:
        return f"process {indices[0]}"
    shown = ", ".join(map(str, indices[:most]))
    if len(indices) <= most:
        return f"processes {shown}"
    return f"{len(indices)} processes ({shown}, ...)"
