"""The peer transport: an authenticated TCP listener per process (its client is
:mod:`jaxckpt.tiers._peerclient`).

Bulk bytes between the job's processes (replicas of local parts, fetches of
them after a node is lost) go over TCP, never through the coordination
service's key-value store, which only carries each listener's address and
the job's secret (see ``_peertier``).

A connection starts with a mutual challenge-response over a per-job secret
(HMAC-SHA256 of both sides' random nonces): the server proves nothing and
serves nothing until the client has proved it knows the secret, and the
client sends nothing until the server has proved it too. The whole handshake
must finish within ``handshake_timeout_s``, and at most ``max_handshakes``
connections may be in it at once: a new connection evicts the oldest one
still authenticating, so connections that never authenticate cannot pile up,
and cannot lock members out either (a member's handshake takes one round trip;
an outsider's idle connections are the oldest, and a member whose handshake
is evicted all the same retries with a back-off, see ``_peerclient``).
Then the client sends requests, one at a time, each a frame of a
:class:`~jaxckpt.tiers._wire.Session`: a JSON header and a payload, each with
an HMAC keyed from the handshake, so a frame that the authenticated peer did
not send is refused and the connection closed. Requests:
``put`` (write a key), ``get`` (read one), ``list`` (the keys under a prefix)
and ``delete`` (a prefix), each on a safe key under the one prefix the server
serves (``replicas/``); any other key is a refused request, never a failed
connection. A ``put`` to a local root is written to a hidden temp file beside
its key as it arrives and renamed to the key once its MAC is checked, so the
listener's memory does not grow with the frame's size. Every socket operation
has a timeout, so a dead or stalled peer is an error, never a hang; an
``accept()`` that fails (no file descriptors left) is logged and retried with a
back-off, never the end of the listener.
Imports neither jax nor numpy.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import Any
from uuid import uuid4

from jaxckpt.errors import PeerAuthError
from jaxckpt.storage import LocalStorage, Storage, fsync_dir, makedirs_durable
from jaxckpt.tiers._wire import (
    DIGEST_BYTES,
    HELLO,
    NONCE_BYTES,
    Closed,
    Session,
    no_delay,
    proof,
    recv_exact,
)

log = logging.getLogger("jaxckpt")

DEFAULT_MAX_BYTES = 4 << 30
"""The largest payload a server accepts by default (a file of a part: a chunk, a pack, a record)."""
HANDSHAKE_TIMEOUT_S = 10.0
"""The longest a connection may take to authenticate (at most the server's ``timeout_s``)."""
MAX_HANDSHAKES = 64
"""Connections that may be authenticating at once; a new one evicts the oldest."""
MAX_KEY_CHARS = 1024
_ACCEPT_BACKOFF_S = (0.05, 2.0)
_FATAL_ACCEPT = (errno.EBADF, errno.EINVAL, errno.ENOTSOCK)


def new_secret() -> bytes:
    """A fresh per-job secret."""
    return secrets.token_bytes(32)


def key_refusal(key: object, prefix: str) -> str | None:
    """Why ``key`` may not be served under ``prefix``, or None for a safe key.

    >>> key_refusal("replicas/1/0/a.json", "replicas/") is None
    True
    >>> key_refusal("replicas/../tier.json", "replicas/")
    "key 'replicas/../tier.json' is refused: it has a '.' or '..' segment"
    """
    if not isinstance(key, str):
        return f"key {key!r} is refused: not a string"
    if len(key) > MAX_KEY_CHARS:
        return f"key {key[:64]!r}... is refused: longer than {MAX_KEY_CHARS} characters"
    if not key.startswith(prefix):
        return f"key {key!r} is refused: it is not under {prefix}"
    if any(ord(c) < 0x20 or c in "\x7f\\" for c in key):
        return f"key {key!r} is refused: it holds a control character or a backslash"
    parts = key.split("/")
    if any(p in (".", "..") for p in parts):
        return f"key {key!r} is refused: it has a '.' or '..' segment"
    if "" in parts[:-1]:
        return f"key {key!r} is refused: it has an empty segment"
    return None


class PeerServer:
    """A threaded TCP listener serving keys under ``prefix`` of ``storage`` to the job.

    Args:
      storage: the process's own local root.
      secret: the job's secret; a client that cannot prove it is refused (logged).
      host: the address to bind (the port is chosen by the system).
      timeout_s: the bound of every socket operation.
      prefix: the only keys served (written, read, listed, deleted).
      max_bytes: the largest payload accepted.
      handshake_timeout_s: the bound of the whole handshake (default
        ``HANDSHAKE_TIMEOUT_S``, at most ``timeout_s``).
      max_handshakes: connections that may be authenticating at once (a new one
        evicts the oldest).
    """

    def __init__(
        self,
        storage: Storage,
        secret: bytes,
        *,
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
        prefix: str = "replicas/",
        max_bytes: int = DEFAULT_MAX_BYTES,
        handshake_timeout_s: float | None = None,
        max_handshakes: int = MAX_HANDSHAKES,
    ) -> None:
        self._storage = storage
        self._root = storage.uri if isinstance(storage, LocalStorage) else None
        self._secret = secret
        self._timeout_s = timeout_s
        self._handshake_s = min(handshake_timeout_s or HANDSHAKE_TIMEOUT_S, timeout_s)
        self._prefix = prefix
        self._max_bytes = max_bytes
        self._max_handshakes = max_handshakes
        self._pending: dict[socket.socket, None] = {}  # authenticating, oldest first
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.2)  # the accept loop looks at ``_closed`` this often
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self.refused = 0
        """Connections refused for a failed authentication or a frame that fails its MAC."""
        self.evicted = 0
        """Handshakes cut to make room: ``max_handshakes`` were authenticating."""
        self.accept_errors = 0
        """``accept()`` calls that failed (no file descriptors left, ...)."""
        self.full: str | None = None
        """Why ``put`` requests are refused now (the own tier is full), else None."""
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(
            target=self._serve, name="jaxckpt-peer-listener", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stops accepting, closes every open connection and the listener. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=5)
        self._sock.close()
        with self._lock:
            conns, self._conns = set(self._conns), set()
        for conn in conns:
            with suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _serve(self) -> None:
        backoff, failing_since = 0.0, None
        while not self._closed.is_set():
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._closed.is_set() or e.errno in _FATAL_ACCEPT:
                    if not self._closed.is_set():
                        log.error("peer listener %s stopped: %s", self.address, e)
                    return
                self.accept_errors += 1
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning(
                        "peer listener %s cannot accept connections (%s); backing off and retrying",
                        self.address,
                        e,
                    )
                low, high = _ACCEPT_BACKOFF_S
                backoff = min(max(2 * backoff, low), high)
                self._closed.wait(backoff)
                continue
            if failing_since is not None:
                log.warning(
                    "peer listener %s accepts connections again (after %d failed accepts in %.1fs)",
                    self.address,
                    self.accept_errors,
                    time.monotonic() - failing_since,
                )
                backoff, failing_since = 0.0, None
            no_delay(conn)
            self._start(conn, addr)

    def _start(self, conn: socket.socket, addr: Any) -> None:
        oldest = None
        with self._lock:
            if len(self._pending) >= self._max_handshakes:
                oldest = next(iter(self._pending))
                del self._pending[oldest]
                self.evicted += 1
            self._pending[conn] = None
            self._conns.add(conn)
        if oldest is not None:  # its thread's read ends; the thread closes it
            with suppress(OSError):
                oldest.shutdown(socket.SHUT_RDWR)
            if self.evicted == 1 or self.evicted % 1000 == 0:
                log.warning(
                    "peer listener %s: %d handshakes evicted (more than %d connections "
                    "authenticating at once)",
                    self.address,
                    self.evicted,
                    self._max_handshakes,
                )
        try:
            threading.Thread(
                target=self._handle, args=(conn, addr), name="jaxckpt-peer-conn", daemon=True
            ).start()
        except RuntimeError as e:  # no thread could be started: this connection only
            log.warning("peer listener %s: connection from %s closed: %s", self.address, addr, e)
            with self._lock:
                self._pending.pop(conn, None)
                self._conns.discard(conn)
            conn.close()

    def _handle(self, conn: socket.socket, addr: Any) -> None:
        try:
            self._converse(conn, addr)
        except PeerAuthError as e:
            self.refused += 1
            log.warning("refused a frame from %s and closed its connection: %s", addr, e)
        except TimeoutError:
            if not self._closed.is_set():
                log.warning("peer connection from %s timed out; closed", addr)
        except Exception as e:  # OSError, PeerError, anything: this connection ends, logged
            if not self._closed.is_set():
                log.warning("peer connection from %s failed: %s: %s", addr, type(e).__name__, e)
        finally:  # closed after the refusal is counted and logged
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _converse(self, conn: socket.socket, addr: Any) -> None:
        try:
            session = self._authenticate(conn, addr)
        finally:
            with self._lock:
                evicted = conn not in self._pending  # cut to make room: its socket is shut
                self._pending.pop(conn, None)
        if session is None or evicted:
            return
        conn.settimeout(self._timeout_s)
        while not self._closed.is_set():
            header = session.recv_header(conn, self._max_bytes)
            if header is None:
                return  # the client is done
            reply, data = self._take(session, conn, header)
            session.send(conn, reply, data)

    def _take(
        self, session: Session, conn: socket.socket, header: dict[str, Any]
    ) -> tuple[dict[str, Any], bytes]:
        """Receives the payload of the request ``header`` and answers it: a ``put`` to a
        local root streams to a file, any other payload is held (a refused one dropped)."""
        key = header.get("key")
        refused = key_refusal(key, self._prefix) is not None
        if header.get("op") == "put" and (full := self.full) is not None:
            session.recv_payload(conn, header, _drop)  # the room goes to this node's own saves
            return {"error": f"put {key!r} refused: {full}"}, b""
        if header.get("op") == "put" and not refused and self._root is not None:
            assert isinstance(key, str)
            return _put_streamed(self._root, key, session, conn, header)
        pieces: list[bytes] = []
        session.recv_payload(conn, header, _drop if refused else pieces.append)
        return self._answer(header, pieces)

    def _authenticate(self, conn: socket.socket, addr: Any) -> Session | None:
        deadline = time.monotonic() + self._handshake_s
        conn.settimeout(self._handshake_s)
        nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            conn.sendall(HELLO + nonce)
            theirs = recv_exact(conn, NONCE_BYTES + DIGEST_BYTES, deadline=deadline)
        except TimeoutError:
            log.warning(
                "peer connection from %s closed: no handshake within %gs", addr, self._handshake_s
            )
            return None
        except Closed:
            return None
        client_nonce, their_proof = theirs[:NONCE_BYTES], theirs[NONCE_BYTES:]
        if not hmac.compare_digest(
            their_proof, proof(self._secret, b"client", nonce, client_nonce)
        ):
            self.refused += 1
            log.warning(
                "refused a peer connection from %s: it does not know the job's secret", addr
            )
            return None
        conn.sendall(proof(self._secret, b"server", client_nonce, nonce))
        return Session(self._secret, nonce, client_nonce, server=True)

    def _answer(
        self, header: dict[str, Any], payload: Sequence[bytes]
    ) -> tuple[dict[str, Any], bytes]:
        op, key = header.get("op"), header.get("key")
        refusal = key_refusal(key, self._prefix)
        if refusal is not None:
            return {"error": refusal}, b""
        assert isinstance(key, str)
        try:
            if op == "put":
                self._storage.start_write(key, payload)()
                return {"ok": True}, b""
            if op == "get":
                data = self._storage.read(key)
                return ({"ok": data is not None}, data or b"")
            if op == "list":
                return {"ok": True, "keys": self._storage.list(key)}, b""
            if op == "delete":
                self._storage.delete_prefix(key)
                return {"ok": True}, b""
        except Exception as e:  # a failed request is an answer; the connection goes on
            return {"error": f"{op} {key!r} failed: {type(e).__name__}: {e}"}, b""
        return {"error": f"unknown request {op!r}"}, b""


def _drop(piece: bytes) -> None:
    """The payload of a refused request: received (to stay in step) and dropped."""


def _put_streamed(
    root: str, key: str, session: Session, conn: socket.socket, header: dict[str, Any]
) -> tuple[dict[str, Any], bytes]:
    """Receives a ``put``'s payload into a hidden temp file beside ``key`` under ``root``
    as it arrives, then, its MAC checked, fsyncs it and renames it to ``key``.

    Memory stays at one piece whatever the frame's size. The temp file is named like
    a create-only write's (``.<name>.<time>-<hex>.tmp``): no reader takes it for a
    replica (a replica is the files its index names), it is removed when the frame
    fails, and one a crash left is removed by ``Peers.collect`` once stale.

    Raises:
      PeerAuthError, OSError: the frame failed (the connection ends; no file is placed).
    """
    path = os.path.join(root, *key.split("/"))
    directory, name = os.path.split(path)
    sink = _FileSink(os.path.join(directory, f".{name}.{int(time.time())}-{uuid4().hex}.tmp"))
    try:
        session.recv_payload(conn, header, sink.write)
    except BaseException:
        sink.discard()
        raise
    sink.place(path)
    if sink.error is not None:
        return {"error": f"put {key!r} failed: {type(sink.error).__name__}: {sink.error}"}, b""
    return {"ok": True}, b""


class _FileSink:
    """The temp file a streamed ``put`` is written to; a failed write is kept in ``error``
    (the rest of the payload is still received, so the connection stays in step)."""

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.error: OSError | None = None
        self._fd: int | None = None
        try:
            makedirs_durable(os.path.dirname(tmp))
            self._fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            self.error = e

    def write(self, piece: bytes) -> None:
        if self._fd is None:
            return
        view = memoryview(piece)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            self.error = e
            self.discard()

    def place(self, path: str) -> None:
        """Fsyncs the temp file and renames it to ``path`` (durably); a failure is kept
        in ``error`` and the temp file removed."""
        if self._fd is None:
            return
        try:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            os.replace(self.tmp, path)
            fsync_dir(os.path.dirname(path))
        except OSError as e:
            self.error = e
            self.discard()

    def discard(self) -> None:
        if self._fd is not None:
            with suppress(OSError):
                os.close(self._fd)
            self._fd = None
        with suppress(OSError):
            os.unlink(self.tmp)
