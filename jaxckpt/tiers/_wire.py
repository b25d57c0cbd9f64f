"""The peer transport's wire format: the handshake's proofs and a session's framed messages.

A connection opens with a mutual challenge-response over the job's secret
(:func:`proof` of both sides' random nonces, see ``_peer``). Both sides then
derive a :class:`Session` from the secret and the two nonces: one key per
direction, so every frame is bound to this connection and its direction, and a
sequence number per direction, so no frame can be replayed, reordered or dropped
unnoticed. A *frame* is::

    length (4 bytes, big-endian) | header (JSON, at most MAX_HEADER_BYTES)
    | HMAC-SHA256(key, "h" | seq | length | header)
    | payload (header["size"] bytes) | HMAC-SHA256(key, "p" | seq | payload)

The header's tag is checked before its size is believed: a frame that did not
come from the peer that made the handshake (an on-path relay injecting a
``put``) is refused before a byte of its payload is read. The payload is
received in pieces of at most ``PIECE_BYTES`` and handed on as they arrive
(:meth:`Session.recv_payload`; the listener streams a ``put`` to a file), so
memory never follows a size a header claims, and the payload is bounded by the
receiver's ``max_bytes``. The transport authenticates and protects the
integrity of what it carries; it does not encrypt it.
Imports neither jax nor numpy.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxckpt.errors import PeerAuthError, PeerError

HELLO = b"JAXCKPT-PEER-2\n"
NONCE_BYTES = 32
DIGEST_BYTES = 32
MAX_HEADER_BYTES = 64 << 10
PIECE_BYTES = 1 << 20
"""The largest piece a payload is received in (memory grows with what arrives)."""
ONE_WRITE_BYTES = 256 << 10
"""A frame whose payload is at most this is sent in one write (one copy, one segment
train): with the tag written on its own, Nagle's algorithm held it until the peer's
delayed acknowledgement, ~40 ms per frame on Linux."""


def no_delay(sock: socket.socket) -> None:
    """Turns Nagle's algorithm off on ``sock``: a frame's last small write (its tag) is
    sent at once, not after the peer's delayed acknowledgement of the frame before it.
    Every request waits for its answer, so nothing is gained by holding small writes."""
    with contextlib.suppress(OSError):  # not TCP (a test's socketpair): nothing to turn off
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    """The handshake's proof that the side ``role`` knows ``secret``."""
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


class Closed(ConnectionError):
    """The other side closed the connection (before a frame began: it is done)."""


def recv_exact(sock: socket.socket, n: int, *, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes (``n`` at most ``PIECE_BYTES`` or a small record).

    ``deadline`` (a ``time.monotonic()`` instant) bounds the whole read, not
    each ``recv``: a peer that trickles one byte at a time is cut at it.

    Raises:
      Closed: the connection closed first.
      TimeoutError: the socket's timeout or the deadline passed.
      OSError: the connection failed.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {n} bytes before the deadline")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise Closed(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _key(secret: bytes, direction: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(
        secret, b"jaxckpt-peer-session " + direction + server_nonce + client_nonce, hashlib.sha256
    ).digest()


class Session:
    """The framing of one authenticated connection (see the module docstring).

    Args:
      secret: the job's secret.
      server_nonce, client_nonce: the handshake's nonces.
      server: whether this is the listener's side.
    """

    def __init__(
        self, secret: bytes, server_nonce: bytes, client_nonce: bytes, *, server: bool
    ) -> None:
        to_server = _key(secret, b"c2s", server_nonce, client_nonce)
        to_client = _key(secret, b"s2c", server_nonce, client_nonce)
        self._send_key, self._recv_key = (
            (to_client, to_server) if server else (to_server, to_client)
        )
        self._sent = 0
        self._received = 0

    def send(
        self, sock: socket.socket, header: dict[str, Any], payload: bytes | Sequence[bytes] = b""
    ) -> None:
        """Sends one frame: ``header`` (its ``size`` added) and ``payload`` (or its pieces)."""
        pieces = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload
        size = sum(len(p) for p in pieces)
        raw = json.dumps({**header, "size": size}, separators=(",", ":")).encode()
        length = struct.pack(">I", len(raw))
        seq = self._sent.to_bytes(8, "big")
        self._sent += 1
        tag = hmac.new(self._send_key, b"h" + seq + length + raw, hashlib.sha256).digest()
        mac = hmac.new(self._send_key, b"p" + seq, hashlib.sha256)
        if size <= ONE_WRITE_BYTES:
            for piece in pieces:
                mac.update(piece)
            sock.sendall(b"".join([length, raw, tag, *pieces, mac.digest()]))
            return
        sock.sendall(length + raw + tag)
        for piece in pieces:
            if len(piece):
                mac.update(piece)
                sock.sendall(piece)
        sock.sendall(mac.digest())

    def recv(
        self, sock: socket.socket, max_bytes: int
    ) -> tuple[dict[str, Any], list[bytes]] | None:
        """Receives one frame: its header and its payload's pieces; None if the other side
        closed the connection before a frame began.

        Raises:
          PeerAuthError: a tag does not match (not from this session's peer, or altered).
          PeerError: a length over the bounds or a malformed header.
          OSError: the connection failed or timed out.
        """
        header = self.recv_header(sock, max_bytes)
        if header is None:
            return None
        pieces: list[bytes] = []
        self.recv_payload(sock, header, pieces.append)
        return header, pieces

    def recv_header(self, sock: socket.socket, max_bytes: int) -> dict[str, Any] | None:
        """Receives one frame's header (its tag checked, its ``size`` at most ``max_bytes``);
        None if the other side closed the connection before a frame began. The payload
        must be received next, by :meth:`recv_payload`.

        Raises:
          PeerAuthError: the tag does not match (not from this session's peer, or altered).
          PeerError: a length over the bounds or a malformed header.
          OSError: the connection failed or timed out.
        """
        try:
            length_bytes = recv_exact(sock, 4)
        except Closed:
            return None
        (length,) = struct.unpack(">I", length_bytes)
        if length > MAX_HEADER_BYTES:
            raise PeerError(f"frame header of {length} bytes exceeds {MAX_HEADER_BYTES}")
        raw = recv_exact(sock, length)
        tag = recv_exact(sock, DIGEST_BYTES)
        seq = self._received.to_bytes(8, "big")
        self._received += 1
        want = hmac.new(self._recv_key, b"h" + seq + length_bytes + raw, hashlib.sha256).digest()
        if not hmac.compare_digest(tag, want):
            raise PeerAuthError(
                f"frame {int.from_bytes(seq, 'big')} fails its MAC: it was not sent by the "
                "process that made this connection's handshake, or was altered on the way"
            )
        header = _header(raw)
        size = header["size"]
        if size > max_bytes:
            raise PeerError(f"frame payload of {size} bytes exceeds the bound of {max_bytes}")
        return header

    def recv_payload(
        self, sock: socket.socket, header: dict[str, Any], write: Callable[[bytes], object]
    ) -> None:
        """Receives the payload of the frame whose header was just received, handing each
        piece (at most ``PIECE_BYTES``) to ``write`` as it arrives; returns once the
        payload's tag is checked. What ``write`` took is not authentic until then.

        Raises:
          PeerAuthError: the payload's tag does not match.
          OSError: the connection failed or timed out (or ``write`` failed).
        """
        seq = (self._received - 1).to_bytes(8, "big")
        mac = hmac.new(self._recv_key, b"p" + seq, hashlib.sha256)
        left = header["size"]
        while left:
            piece = recv_exact(sock, min(left, PIECE_BYTES))
            mac.update(piece)
            write(piece)
            left -= len(piece)
        if not hmac.compare_digest(recv_exact(sock, DIGEST_BYTES), mac.digest()):
            what = f"{header.get('op', 'reply')} {header.get('key', '')!r}".strip()
            raise PeerAuthError(f"the payload of {what} fails its MAC")


def _header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise PeerError(f"malformed frame header: {e}") from e
    size = header.get("size") if isinstance(header, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise PeerError(f"malformed frame header: {raw[:200]!r}")
    return header


def joined(pieces: Sequence[bytes]) -> bytes:
    """A payload's pieces as one bytes object."""
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)
