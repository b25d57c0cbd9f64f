"""The peer listener under hostile or broken clients, over real loopback sockets.

A listener in a child process whose file descriptors run out keeps accepting
once the pressure ends; a handshake trickled one byte at a time is cut at the
handshake deadline; a frame claiming a huge payload allocates nothing for it;
a frame injected by an on-path relay after a member's handshake is refused;
a bad key is a refused request on a connection that goes on.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import harness
import pytest
from triggers import HANG_S

from jaxckpt import PeerError
from jaxckpt.storage import open_storage
from jaxckpt.tiers._peerclient import PeerClient, connect
from jaxckpt.tiers._transport import PeerServer, new_secret
from jaxckpt.tiers._wire import DIGEST_BYTES, HELLO, NONCE_BYTES, recv_exact

pytestmark = pytest.mark.timeout(300)
KEY = "replicas/000000000001/0/a/x.bin"
IO_S = 60.0
"""A member's socket timeout and a listener's idle bound: upper bounds only a hang reaches."""


@pytest.fixture
def served(tmp_path):
    storage = open_storage(str(tmp_path / "root"))
    secret = new_secret()
    server = PeerServer(storage, secret, timeout_s=IO_S, handshake_timeout_s=IO_S)
    yield storage, secret, server
    server.close()


def conn_threads() -> int:
    return sum(t.name == "jaxckpt-peer-conn" for t in threading.enumerate())


CHILD = """
import logging, os, resource, sys
from jaxckpt.tiers._transport import PeerServer
from jaxckpt.storage import open_storage
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
server = PeerServer(open_storage(sys.argv[1]), bytes.fromhex(sys.argv[2]), timeout_s=60.0,
                    handshake_timeout_s=60.0)
spare = len(os.listdir("/proc/self/fd")) + 6
resource.setrlimit(resource.RLIMIT_NOFILE, (spare, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(server.address, flush=True)
sys.stdin.read()
print("ACCEPT ERRORS", server.accept_errors, flush=True)
"""


def test_the_listener_keeps_accepting_after_its_file_descriptors_ran_out(tmp_path):
    """The child's fd limit is its open fds + 6: 40 idle connections exhaust it (accept()
    raises EMFILE); once they are gone, a member connects, writes and reads."""
    secret = new_secret()
    stderr = tmp_path / "child.err"
    with (
        stderr.open("w") as err,
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path / "root"), secret.hex()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        ) as child,
    ):
        assert child.stdin is not None and child.stdout is not None
        try:
            address = child.stdout.readline().strip()
            host, _, port = address.rpartition(":")
            idle = [socket.create_connection((host, int(port)), timeout=IO_S) for _ in range(40)]
            harness.wait_until(
                lambda: "cannot accept connections" in stderr.read_text(),
                what="the listener's accept() failing",
                timeout_s=HANG_S,
            )
            for sock in idle:
                sock.close()
            with connect(address, secret, timeout_s=IO_S) as peer:
                peer.put(KEY, b"after the pressure")
                assert peer.get(KEY) == b"after the pressure"
            child.stdin.close()
            out = child.stdout.read()
            assert child.wait(timeout=HANG_S) == 0
        finally:
            if child.poll() is None:
                child.kill()
    errors = int(out.split("ACCEPT ERRORS")[1])
    assert errors >= 1, out
    assert "accepts connections again" in stderr.read_text()
    assert "Traceback" not in stderr.read_text()


def test_a_handshake_trickled_byte_by_byte_is_cut_at_the_deadline(served):
    """One byte every 0.3 s at most: each recv succeeds within the 30 s socket timeout, but
    the 1 s handshake deadline bounds them all together: the server cuts the connection
    before the reply it waits for is complete (a load that slows the trickle only sends
    fewer bytes before the cut)."""
    storage, secret, _ = served
    server = PeerServer(storage, secret, timeout_s=30.0, handshake_timeout_s=1.0)
    host, _, port = server.address.rpartition(":")
    reply = NONCE_BYTES + DIGEST_BYTES  # the client's nonce and proof
    with (
        contextlib.closing(server),
        socket.create_connection((host, int(port)), timeout=IO_S) as sock,
    ):
        assert recv_exact(sock, len(HELLO) + NONCE_BYTES).startswith(HELLO)
        sock.settimeout(0.3)
        closed = False
        sent = 0
        while not closed and sent < reply:
            try:
                sock.sendall(b"x")
                sent += 1
                closed = sock.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
    assert closed and sent < reply, sent  # cut by the deadline, not by a refused proof
    harness.wait_until(
        lambda: conn_threads() == 0, what="the connection's thread", timeout_s=HANG_S
    )


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def unread_bytes(local_port: int, remote_port: int) -> int | None:
    """Bytes a loopback TCP socket of this machine (``local_port`` to ``remote_port``) has
    received that its owner has not read yet (``/proc/net/tcp``'s rx_queue); None: no such
    socket."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, queues = fields[1], fields[2], fields[4]
        if (int(local.split(":")[1], 16), int(remote.split(":")[1], 16)) == (
            local_port,
            remote_port,
        ):
            return int(queues.split(":")[1], 16)
    return None


def forged_frame(key: bytes, seq: int, header: dict[str, object], payload: bytes) -> bytes:
    """A frame as ``Session.send`` writes it, keyed with ``key`` (right or wrong)."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    length = len(raw).to_bytes(4, "big")
    s = seq.to_bytes(8, "big")
    tag = hmac.new(key, b"h" + s + length + raw, hashlib.sha256).digest()
    return length + raw + tag + payload


def test_a_huge_declared_payload_allocates_nothing_for_it(served):
    """An authenticated frame claiming 512 MiB and sending 1 KiB: the listener holds
    what arrived, not the claim (it preallocated the claim before: +512 MiB RSS)."""
    _, secret, server = served
    with connect(server.address, secret, timeout_s=IO_S) as peer:
        session = peer._session
        before = rss_bytes()
        header = {"op": "put", "key": KEY, "size": 512 << 20}
        peer._sock.sendall(forged_frame(session._send_key, 0, header, b"y" * 1024))
        ends = (int(server.address.rpartition(":")[2]), peer._sock.getsockname()[1])
        harness.wait_until(  # the listener read what was sent (and waits for the rest)
            lambda: unread_bytes(*ends) == 0, what="the listener reading", timeout_s=HANG_S
        )
        assert rss_bytes() - before < 64 << 20
    harness.wait_until(
        lambda: conn_threads() == 0, what="the connection's thread", timeout_s=HANG_S
    )


def relay(target: str, inject: bytes) -> tuple[str, threading.Thread]:
    """An on-path relay: passes a client's handshake to ``target``, then sends ``inject``
    ahead of the client's own frames (it cannot key a frame: it does not hold the secret)."""
    listener = socket.create_server(("127.0.0.1", 0))
    host, _, port = target.rpartition(":")

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def run() -> None:
        client, _ = listener.accept()
        listener.close()
        upstream = socket.create_connection((host, int(port)), timeout=IO_S)
        threading.Thread(target=pump, args=(upstream, client), daemon=True).start()
        upstream.sendall(recv_exact(client, NONCE_BYTES + 32))  # the member's proof
        upstream.sendall(inject)
        pump(client, upstream)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return f"127.0.0.1:{listener.getsockname()[1]}", thread


def test_a_frame_injected_after_a_members_handshake_is_refused(served, caplog):
    storage, secret, server = served
    evil = {"op": "put", "key": "replicas/000000000001/0/evil", "size": 4}
    address, thread = relay(server.address, forged_frame(os.urandom(32), 0, evil, b"evil"))
    with (
        caplog.at_level(logging.WARNING, logger="jaxckpt"),
        connect(address, secret, timeout_s=IO_S) as peer,
        pytest.raises(PeerError),
    ):
        peer.put(KEY, b"the member's bytes")
    thread.join(timeout=HANG_S)
    assert server.refused == 1
    assert "fails its MAC" in caplog.text
    assert storage.list("replicas/") == []


def test_a_bad_key_is_a_refused_request_and_the_connection_goes_on(served, capfd, monkeypatch):
    storage, secret, server = served
    with connect(server.address, secret, timeout_s=IO_S) as peer:
        for key in ("replicas/a\x00b", "replicas/../tier.json", "replicas/a\\b", "/etc/x"):
            with pytest.raises(PeerError, match="is refused"):
                peer.put(key, b"bad")
            with pytest.raises(PeerError, match="is refused"):
                peer.get(key)
        with pytest.raises(PeerError, match="not a string"):
            PeerClient._call(peer, {"op": "get", "key": 7})  # type: ignore[dict-item]
        with monkeypatch.context() as m:  # a storage failure outside the error family
            m.setattr(storage, "read", lambda key: (_ for _ in ()).throw(ValueError("boom")))
            with pytest.raises(PeerError, match="ValueError: boom"):
                peer.get(KEY)
        peer.put(KEY, b"still served")  # the same connection, the same thread
        assert peer.get(KEY) == b"still served"
    assert storage.list("") == [KEY]
    assert "Traceback" not in capfd.readouterr().err


def test_connections_beyond_the_handshake_cap_evict_the_oldest_pending_one(tmp_path):
    storage = open_storage(str(tmp_path / "root"))
    secret = new_secret()
    server = PeerServer(storage, secret, timeout_s=IO_S, handshake_timeout_s=IO_S, max_handshakes=2)
    try:
        host, _, port = server.address.rpartition(":")
        idle = [socket.create_connection((host, int(port)), timeout=IO_S) for _ in range(5)]
        harness.wait_until(lambda: server.evicted == 3, what="3 evicted", timeout_s=HANG_S)
        harness.wait_until(lambda: conn_threads() <= 2, what="2 handshakes left", timeout_s=HANG_S)
        for sock in idle:
            sock.close()
        harness.wait_until(lambda: conn_threads() == 0, what="idle threads gone", timeout_s=HANG_S)
        with connect(server.address, secret, timeout_s=IO_S) as peer:  # room again
            peer.put(KEY, b"ok")
    finally:
        server.close()


def test_idle_outsiders_never_lock_a_member_out(tmp_path):
    """Outsiders without the secret hold every handshake slot and more (they send
    nothing, and the deadline is long): a member's connection evicts the oldest of
    them and authenticates, instead of being closed after 0 bytes."""
    storage = open_storage(str(tmp_path / "root"))
    secret = new_secret()
    server = PeerServer(
        storage, secret, timeout_s=HANG_S, handshake_timeout_s=HANG_S, max_handshakes=4
    )
    host, _, port = server.address.rpartition(":")
    idle = []
    try:
        for _ in range(10):
            idle.append(socket.create_connection((host, int(port)), timeout=IO_S))
            harness.wait_until(
                lambda: conn_threads() >= min(len(idle), 4), what="pending", timeout_s=HANG_S
            )
        for n in range(3):  # every member connection gets in while they stay
            with connect(server.address, secret, timeout_s=IO_S) as peer:
                peer.put(KEY, b"member %d" % n)
        assert storage.read(KEY) == b"member 2"
        assert server.evicted >= 6 and server.refused == 0
    finally:
        for sock in idle:
            sock.close()
        server.close()


class _DropFirst:
    """A loopback TCP proxy to ``target`` that closes its first ``drops`` connections
    at once (what a server does when it evicts a pending handshake)."""

    def __init__(self, target: str, drops: int) -> None:
        self._target, self.drops, self.accepted = target, drops, 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.accepted <= self.drops:
                conn.close()
                continue
            host, _, port = self._target.rpartition(":")
            upstream = socket.create_connection((host, int(port)))
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._sock.close()


def test_a_client_whose_connection_is_closed_before_the_hello_retries(served):
    storage, secret, server = served
    proxy = _DropFirst(server.address, drops=2)
    try:
        with connect(proxy.address, secret, timeout_s=IO_S) as peer:
            peer.put(KEY, b"after two drops")
        assert storage.read(KEY) == b"after two drops" and proxy.accepted == 3
        proxy.drops = 10**6  # closed every time: a PeerError within the timeout, no hang
        with (
            pytest.raises(PeerError, match="closed"),
            connect(proxy.address, secret, timeout_s=2.0),
        ):
            pass
    finally:
        proxy.close()
