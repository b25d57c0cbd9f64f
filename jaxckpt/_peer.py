"""The peer transport: an authenticated TCP listener per process, and its client.

Bulk bytes between the job's processes (replicas of local parts, fetches of
them after a node is lost) go over TCP, never through the coordination
service's key-value store, which only carries each listener's address and
the job's secret (see ``_peertier``).

A connection starts with a mutual challenge-response over a per-job secret
(HMAC-SHA256 of both sides' random nonces): the server proves nothing and
serves nothing until the client has proved it knows the secret, and the
client sends nothing until the server has proved it too. Then the client
sends requests, one at a time, each a *frame*: a 4-byte big-endian header
length, a JSON header (at most ``MAX_HEADER_BYTES``), and ``size`` payload
bytes (at most the server's ``max_bytes``) whose CRC32C the header carries
and the receiver checks. Requests: ``put`` (write a key), ``get`` (read
one), ``list`` (the keys under a prefix) and ``delete`` (a prefix), each on
keys under the one prefix the server serves (``replicas/``). Every socket
operation has a timeout, so a dead or stalled peer is an error, never a hang.
Imports neither jax nor numpy.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from jaxckpt._records import crc32c
from jaxckpt.errors import CheckpointError, PeerAuthError, PeerError
from jaxckpt.storage import Storage

log = logging.getLogger("jaxckpt")

HELLO = b"JAXCKPT-PEER-1\n"
NONCE_BYTES = 32
DIGEST_BYTES = 32
MAX_HEADER_BYTES = 64 << 10
DEFAULT_MAX_BYTES = 4 << 30
"""The largest payload a server accepts (a file of a part: a chunk, a pack, a record)."""


def new_secret() -> bytes:
    """A fresh per-job secret."""
    return secrets.token_bytes(32)


def _proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    """Sends one frame: the header (with the payload's size and CRC32C) and the payload."""
    header = {**header, "size": len(payload), "crc32c": crc32c(payload) if payload else 0}
    raw = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(raw)) + raw)
    if payload:
        sock.sendall(payload)


def recv_frame(sock: socket.socket, max_bytes: int) -> tuple[dict[str, Any], bytes]:
    """Receives one frame; checks its lengths against the bounds and its payload's CRC32C.

    Raises:
      PeerError: a length over the bounds, a malformed header or a CRC32C mismatch.
      OSError: the connection failed or timed out.
    """
    (length,) = struct.unpack(">I", _recv_exact(sock, 4))
    if length > MAX_HEADER_BYTES:
        raise PeerError(f"frame header of {length} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(bytes(_recv_exact(sock, length)))
        size, expected = int(header["size"]), int(header["crc32c"])
    except (ValueError, KeyError, TypeError) as e:
        raise PeerError(f"malformed frame header: {e}") from e
    if not 0 <= size <= max_bytes:
        raise PeerError(f"frame payload of {size} bytes exceeds the bound of {max_bytes}")
    payload = bytes(_recv_exact(sock, size)) if size else b""
    if size and crc32c(payload) != expected:
        raise PeerError(f"payload of {header.get('op')} {header.get('key')!r} fails its CRC32C")
    return header, payload


class PeerServer:
    """A threaded TCP listener serving keys under ``prefix`` of ``storage`` to the job.

    Args:
      storage: the process's own local root.
      secret: the job's secret; a client that cannot prove it is refused (logged).
      host: the address to bind (the port is chosen by the system).
      timeout_s: the bound of every socket operation.
      prefix: the only keys served (written, read, listed, deleted).
      max_bytes: the largest payload accepted.
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
    ) -> None:
        self._storage = storage
        self._secret = secret
        self._timeout_s = timeout_s
        self._prefix = prefix
        self._max_bytes = max_bytes
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.2)  # the accept loop looks at ``_closed`` this often
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self.refused = 0
        """Connections refused for a failed authentication."""
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
        while not self._closed.is_set():
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(self._timeout_s)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._handle, args=(conn, addr), name="jaxckpt-peer-conn", daemon=True
            ).start()

    def _handle(self, conn: socket.socket, addr: Any) -> None:
        try:
            with conn:
                if not self._authenticate(conn, addr):
                    return
                while not self._closed.is_set():
                    try:
                        header, payload = recv_frame(conn, self._max_bytes)
                    except ConnectionError:
                        return  # the client is done
                    reply, data = self._answer(header, payload)
                    send_frame(conn, reply, data)
        except OSError as e:  # PeerError too
            if not self._closed.is_set():
                log.warning("peer connection from %s failed: %s", addr, e)
        finally:
            with self._lock:
                self._conns.discard(conn)

    def _authenticate(self, conn: socket.socket, addr: Any) -> bool:
        nonce = secrets.token_bytes(NONCE_BYTES)
        conn.sendall(HELLO + nonce)
        theirs = bytes(_recv_exact(conn, NONCE_BYTES + DIGEST_BYTES))
        client_nonce, proof = theirs[:NONCE_BYTES], theirs[NONCE_BYTES:]
        if not hmac.compare_digest(proof, _proof(self._secret, b"client", nonce, client_nonce)):
            self.refused += 1
            log.warning(
                "refused a peer connection from %s: it does not know the job's secret", addr
            )
            return False
        conn.sendall(_proof(self._secret, b"server", client_nonce, nonce))
        return True

    def _answer(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        op, key = header.get("op"), header.get("key")
        if not isinstance(key, str) or not self._allowed(key):
            return {"error": f"key {key!r} is not under {self._prefix}"}, b""
        try:
            if op == "put":
                self._storage.write(key, payload)
                return {"ok": True}, b""
            if op == "get":
                data = self._storage.read(key)
                return ({"ok": data is not None}, data or b"")
            if op == "list":
                return {"ok": True, "keys": self._storage.list(key)}, b""
            if op == "delete":
                self._storage.delete_prefix(key)
                return {"ok": True}, b""
        except CheckpointError as e:
            return {"error": str(e)}, b""
        return {"error": f"unknown request {op!r}"}, b""

    def _allowed(self, key: str) -> bool:
        parts = key.split("/")
        unsafe = any(p in (".", "..") for p in parts) or "" in parts[:-1]
        return key.startswith(self._prefix) and not unsafe


class PeerClient:
    """One authenticated connection to a peer's :class:`PeerServer` (see :func:`connect`)."""

    def __init__(self, sock: socket.socket, peer: str, max_bytes: int) -> None:
        self._sock = sock
        self.peer = peer
        self._max_bytes = max_bytes

    def _call(self, header: dict[str, Any], payload: bytes = b"") -> tuple[dict[str, Any], bytes]:
        what = f"{header['op']} {header['key']!r} on {self.peer}"
        try:
            send_frame(self._sock, header, payload)
            reply, data = recv_frame(self._sock, self._max_bytes)
        except PeerError as e:
            raise PeerError(f"{what}: {e}") from e
        except TimeoutError as e:
            raise PeerError(f"{what}: no answer within the timeout ({e})") from e
        except OSError as e:
            raise PeerError(f"{what} failed: {e}") from e
        if "error" in reply:
            raise PeerError(f"{what} refused: {reply['error']}")
        return reply, data

    def put(self, key: str, data: bytes) -> None:
        """Writes ``data`` as ``key`` on the peer (checked there against its CRC32C)."""
        self._call({"op": "put", "key": key}, data)

    def get(self, key: str) -> bytes | None:
        """The peer's ``key`` (checked against the CRC32C it sent), or None if absent."""
        reply, data = self._call({"op": "get", "key": key})
        return data if reply.get("ok") else None

    def list(self, prefix: str) -> list[str]:
        """The peer's keys under ``prefix``."""
        return [str(k) for k in self._call({"op": "list", "key": prefix})[0]["keys"]]

    def delete_prefix(self, prefix: str) -> None:
        """Deletes the peer's keys under ``prefix``."""
        self._call({"op": "delete", "key": prefix})


@contextmanager
def connect(
    address: str, secret: bytes, *, timeout_s: float, max_bytes: int = DEFAULT_MAX_BYTES
) -> Iterator[PeerClient]:
    """An authenticated connection to the :class:`PeerServer` at ``address`` (``host:port``).

    Raises:
      PeerAuthError: the peer refused our proof, or could not prove it knows the secret.
      PeerError: it could not be reached, or did not answer within ``timeout_s``.
    """
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except OSError as e:
        raise PeerError(f"cannot reach the peer at {address} within {timeout_s:g}s: {e}") from e
    with sock:
        sock.settimeout(timeout_s)
        try:
            hello = bytes(_recv_exact(sock, len(HELLO) + NONCE_BYTES))
            if not hello.startswith(HELLO):
                raise PeerAuthError(f"{address} is not a jaxckpt peer listener")
            nonce = secrets.token_bytes(NONCE_BYTES)
            server_nonce = hello[len(HELLO) :]
            sock.sendall(nonce + _proof(secret, b"client", server_nonce, nonce))
            try:
                proof = bytes(_recv_exact(sock, DIGEST_BYTES))
            except ConnectionError as e:
                raise PeerAuthError(
                    f"the peer at {address} refused the connection: this process does not "
                    "hold the job's secret"
                ) from e
            if not hmac.compare_digest(proof, _proof(secret, b"server", nonce, server_nonce)):
                raise PeerAuthError(f"the peer at {address} does not know the job's secret")
        except PeerError:
            raise
        except TimeoutError as e:
            raise PeerError(f"the peer at {address} did not answer within {timeout_s:g}s") from e
        except OSError as e:
            raise PeerError(f"the connection to the peer at {address} failed: {e}") from e
        yield PeerClient(sock, address, max_bytes)
