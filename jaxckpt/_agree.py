"""Decisions made once, by the primary process, and shared with every host.

Uses the JAX distributed coordination service's key-value store, whose reads
take a timeout, so a dead primary makes the others fail instead of hang. With
one process this is the identity.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import zlib
from typing import Any

import jax

from jaxckpt.errors import CheckpointError

log = logging.getLogger("jaxckpt")


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
        self._counter = itertools.count()

    def agree(self, name: str, value: Any) -> Any:
        """Returns the primary's ``value`` on every process (JSON-serialisable).

        Every process must call ``agree`` in the same order with the same ``name``.

        Raises:
          CheckpointError: the primary did not publish within the timeout.
        """
        if jax.process_count() == 1:
            return value
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise CheckpointError("multi-process jaxckpt needs jax.distributed.initialize()")
        key = f"jaxckpt/{self._namespace}/{name}/{next(self._counter)}"
        if jax.process_index() == self._primary:
            client.key_value_set(key, json.dumps(value))
            return value
        try:
            raw = client.blocking_key_value_get(key, int(self._timeout_s * 1000))
        except Exception as e:
            raise CheckpointError(
                f"process {jax.process_index()}: no decision {name!r} from the primary "
                f"within {self._timeout_s:g}s: {e}"
            ) from e
        return json.loads(raw)

    def any_true(self, name: str, flag: bool) -> bool:
        """True on every process when ``flag`` is true on any process.

        Every process must call ``any_true`` in the same order with the same ``name``.

        Raises:
          CheckpointError: some process did not publish its flag within the timeout.
        """
        return any(self.gather(name, bool(flag)))

    def gather(self, name: str, value: Any) -> list[Any]:
        """Every process's ``value`` (JSON-serialisable), by process index.

        Also a barrier: it returns once every process has called it. Every
        process must call ``gather`` in the same order with the same ``name``.

        Raises:
          CheckpointError: some process did not publish within the timeout.
        """
        if jax.process_count() == 1:
            return [value]
        client = self._client()
        prefix = f"jaxckpt/{self._namespace}/{name}/{next(self._counter)}/"
        client.key_value_set(prefix + str(jax.process_index()), json.dumps(value))
        values = []
        for p in range(jax.process_count()):
            try:
                values.append(
                    json.loads(client.blocking_key_value_get(prefix + str(p), self._timeout_ms))
                )
            except Exception as e:
                raise CheckpointError(
                    f"process {jax.process_index()}: no {name!r} from process {p} "
                    f"within {self._timeout_s:g}s: {e}"
                ) from e
        return values

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

        Each process says it is closing (after its last ``agree``/``any_true``,
        so it reads no more keys); the primary waits for all of them, bounded
        by the timeout, then deletes the namespace. A process that never
        arrives leaves the keys in place (logged), never a hang.
        """
        if jax.process_count() == 1:
            return
        client = self._client()
        base = f"jaxckpt/{self._namespace}/"
        client.key_value_set(f"{base}closed/{jax.process_index()}", "1")
        if jax.process_index() != self._primary:
            return
        try:
            for p in range(jax.process_count()):
                client.blocking_key_value_get(f"{base}closed/{p}", self._timeout_ms)
        except Exception as e:
            log.warning("agreement keys %s kept: a process did not close (%s)", base, e)
            return
        client.key_value_delete(base)

    @property
    def _timeout_ms(self) -> int:
        return int(self._timeout_s * 1000)

    def _client(self) -> Any:
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise CheckpointError("multi-process jaxckpt needs jax.distributed.initialize()")
        return client
