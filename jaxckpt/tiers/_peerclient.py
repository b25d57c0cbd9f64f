"""The client of the peer transport: one authenticated connection to a peer's
:class:`~jaxckpt.tiers._transport.PeerServer` (the protocol is described there).

The client sends nothing until the server has proved it knows the job's secret; every
socket operation has a timeout, so a dead or stalled peer is a :class:`PeerError`,
never a hang. Imports neither jax nor numpy.
"""

from __future__ import annotations

import hmac
import itertools
import random
import secrets
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from jaxckpt.errors import PeerAuthError, PeerError
from jaxckpt.tiers._transport import DEFAULT_MAX_BYTES
from jaxckpt.tiers._wire import (
    DIGEST_BYTES,
    HELLO,
    NONCE_BYTES,
    Closed,
    Session,
    joined,
    no_delay,
    proof,
    recv_exact,
)

__all__ = ["PeerClient", "connect"]


class PeerClient:
    """One authenticated connection to a peer's :class:`PeerServer` (see :func:`connect`)."""

    def __init__(self, sock: socket.socket, session: Session, peer: str, max_bytes: int) -> None:
        self._sock = sock
        self._session = session
        self.peer = peer
        self._max_bytes = max_bytes

    def _call(self, header: dict[str, Any], payload: bytes = b"") -> tuple[dict[str, Any], bytes]:
        what = f"{header['op']} {header['key']!r} on {self.peer}"
        try:
            self._session.send(self._sock, header, payload)
            frame = self._session.recv(self._sock, self._max_bytes)
            if frame is None:
                raise Closed("the peer closed the connection")
        except PeerError as e:
            raise type(e)(f"{what}: {e}") from e
        except TimeoutError as e:
            raise PeerError(f"{what}: no answer within the timeout ({e})") from e
        except OSError as e:
            raise PeerError(f"{what} failed: {e}") from e
        reply, pieces = frame
        if "error" in reply:
            raise PeerError(f"{what} refused: {reply['error']}")
        return reply, joined(pieces) if pieces else b""

    def put(self, key: str, data: bytes) -> None:
        """Writes ``data`` as ``key`` on the peer (its MAC checked there)."""
        self._call({"op": "put", "key": key}, data)

    def get(self, key: str) -> bytes | None:
        """The peer's ``key`` (its MAC checked here), or None if absent."""
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
    deadline = time.monotonic() + timeout_s
    for attempt in itertools.count():
        left = deadline - time.monotonic()
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(left, 0.001))
        except OSError as e:
            raise PeerError(f"cannot reach the peer at {address} within {timeout_s:g}s: {e}") from e
        no_delay(sock)
        try:
            session = _handshake(sock, address, secret, timeout_s, deadline)
            break
        except _ClosedBeforeHello as e:
            sock.close()
            # The listener evicted this handshake (too many connections authenticating,
            # e.g. outsiders holding them): try again after a jittered back-off.
            pause = random.uniform(0.5, 1.0) * min(_RETRY_S[0] * 2**attempt, _RETRY_S[1])
            if time.monotonic() + pause >= deadline:
                raise PeerError(f"{e} ({attempt + 1} tries within {timeout_s:g}s)") from e
            time.sleep(pause)
        except BaseException:
            sock.close()
            raise
    with sock:
        sock.settimeout(timeout_s)
        yield PeerClient(sock, session, address, max_bytes)


_RETRY_S = (0.05, 1.0)
"""The first and the longest back-off before connecting again after an evicted handshake."""


class _ClosedBeforeHello(PeerError):
    """The listener closed the connection before its hello (it evicted the handshake)."""


def _handshake(
    sock: socket.socket, address: str, secret: bytes, timeout_s: float, deadline: float
) -> Session:
    try:
        try:
            hello = recv_exact(sock, len(HELLO) + NONCE_BYTES, deadline=deadline)
        except (Closed, ConnectionResetError) as e:
            raise _ClosedBeforeHello(
                f"the peer at {address} closed the connection before its hello: {e}"
            ) from e
        if not hello.startswith(HELLO):
            raise PeerAuthError(f"{address} is not a jaxckpt peer listener of this version")
        nonce = secrets.token_bytes(NONCE_BYTES)
        server_nonce = hello[len(HELLO) :]
        sock.sendall(nonce + proof(secret, b"client", server_nonce, nonce))
        try:
            their_proof = recv_exact(sock, DIGEST_BYTES, deadline=deadline)
        except ConnectionError as e:
            raise PeerAuthError(
                f"the peer at {address} refused the connection: this process does not "
                "hold the job's secret"
            ) from e
        if not hmac.compare_digest(their_proof, proof(secret, b"server", nonce, server_nonce)):
            raise PeerAuthError(f"the peer at {address} does not know the job's secret")
    except PeerError:
        raise
    except TimeoutError as e:
        raise PeerError(f"the peer at {address} did not answer within {timeout_s:g}s") from e
    except OSError as e:
        raise PeerError(f"the connection to the peer at {address} failed: {e}") from e
    return Session(secret, server_nonce, nonce, server=False)
