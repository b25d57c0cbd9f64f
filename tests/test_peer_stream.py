"""A ``put`` streams to disk as it arrives: the listener's memory does not follow the frame.

A real listener in a child process takes an authenticated 128 MiB frame with its
peak RSS growing by a few MiB (it held every piece before: +128 MiB); the file
lands intact. A frame cut or failing its MAC half-way leaves no file under its
key and no temp file; while a frame streams in, its temp file is hidden from the
replica listing, and one left by a crash is removed by ``Peers.collect``.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import harness
import numpy as np
import pytest
from triggers import HANG_S

from jaxckpt import PeerError
from jaxckpt.records import TEMP_GRACE_S, is_stale_temp_key, is_temp_key, replica_holdings
from jaxckpt.storage import open_storage
from jaxckpt.tiers import _wire
from jaxckpt.tiers._peerclient import connect
from jaxckpt.tiers._peers import Peers
from jaxckpt.tiers._transport import PeerServer, new_secret
from jaxckpt.tiers._wire import Session

pytestmark = pytest.mark.timeout(300)
IO_S = 60.0  # a member's socket timeout and the listener's idle bound: only a hang reaches them
KEY = "replicas/000000000001/0/a/x.bin"
FRAME_BYTES = 128 << 20

CHILD = """
import sys
from jaxckpt.tiers._transport import PeerServer
from jaxckpt.storage import open_storage
server = PeerServer(open_storage(sys.argv[1]), bytes.fromhex(sys.argv[2]), timeout_s=60.0)
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
print(server.address, flush=True)
for _ in sys.stdin:
    print(peak(), flush=True)
"""


def test_a_128_mib_put_streams_to_disk_with_flat_memory(tmp_path):
    secret = new_secret()
    data = np.random.default_rng(0).integers(0, 256, FRAME_BYTES, dtype=np.uint8).tobytes()
    with subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "root"), secret.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            address = child.stdout.readline().strip()

            def peak() -> int:
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write("peak\n")
                child.stdin.flush()
                return int(child.stdout.readline())

            before = peak()
            with connect(address, secret, timeout_s=60.0) as peer:
                peer.put(KEY, data)
            grew = peak() - before
        finally:
            child.kill()
    assert grew < 24 << 20, f"the listener's peak RSS grew by {grew >> 20} MiB"
    landed = tmp_path / "root" / KEY
    assert hashlib.sha256(landed.read_bytes()).digest() == hashlib.sha256(data).digest()
    assert os.listdir(landed.parent) == ["x.bin"]  # no temp file left


@pytest.fixture
def served(tmp_path):
    storage = open_storage(str(tmp_path / "root"))
    secret = new_secret()
    server = PeerServer(storage, secret, timeout_s=IO_S)
    yield storage, secret, server
    server.close()


def frame(session: Session, header: dict[str, object], payload: bytes) -> list[bytes]:
    """The frame ``session`` sends next, as its writes: header with tag, payload, payload
    tag (a payload over ``ONE_WRITE_BYTES``; a smaller frame is one write)."""
    parts: list[bytes] = []
    session.send(types.SimpleNamespace(sendall=parts.append), header, payload)  # type: ignore[arg-type]
    return parts


def cut_put(
    address: str,
    secret: bytes,
    size: int,
    head: bytes,
    tail: bytes = b"",
    *,
    until: Callable[[], bool],
    what: str,
) -> None:
    """A ``put`` whose header claims ``size`` bytes; ``head`` (then ``tail``) is all that
    is sent before the connection closes, once ``until`` holds (the listener took it)."""
    with connect(address, secret, timeout_s=IO_S) as peer:
        header = frame(peer._session, {"op": "put", "key": KEY}, b"\0" * size)[0]
        peer._sock.sendall(header + head + tail)
        harness.wait_until(until, what=what, timeout_s=HANG_S)


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_frame_cut_half_way_leaves_no_file(served, tmp_path):
    storage, secret, server = served
    cut_put(
        server.address,
        secret,
        8 << 20,
        b"a" * (3 << 20),
        until=lambda: any(is_temp_key(k) for k in storage.list("replicas/")),
        what="the frame's temp file",
    )
    harness.wait_until(
        lambda: files_under(tmp_path / "root") == [], what="the temp file removed", timeout_s=HANG_S
    )
    with connect(server.address, secret, timeout_s=IO_S) as peer:  # the listener goes on
        peer.put(KEY, b"whole")
        assert peer.get(KEY) == b"whole"


def test_a_payload_that_fails_its_mac_is_never_placed(served, tmp_path):
    _, secret, server = served
    size = 2 << 20
    cut_put(  # a wrong payload tag
        server.address,
        secret,
        size,
        b"b" * size,
        tail=b"\0" * 32,
        until=lambda: server.refused == 1,
        what="the frame refused",
    )
    harness.wait_until(
        lambda: files_under(tmp_path / "root") == [], what="the temp file removed", timeout_s=HANG_S
    )


def test_a_streaming_temp_file_is_no_replica_and_collect_removes_a_stale_one(served, tmp_path):
    storage, secret, server = served
    index = "replicas/000000000001/0/a.json"
    with connect(server.address, secret, timeout_s=IO_S) as peer:
        session, sock = peer._session, peer._sock
        header, payload, tag = frame(session, {"op": "put", "key": index}, b"c" * (4 << 20))
        sock.sendall(header + payload[: 2 << 20])  # half the payload: the temp file exists
        harness.wait_until(
            lambda: any(is_temp_key(k) for k in storage.list("replicas/")),
            what="the temp file",
            timeout_s=HANG_S,
        )
        keys = storage.list("replicas/")
        assert replica_holdings(keys) == []  # not taken for a replica's index
        (temp,) = keys
        assert not is_stale_temp_key(temp, time.time())  # a live write's: kept
        assert is_stale_temp_key(temp, time.time() + TEMP_GRACE_S + 1)
        sock.sendall(payload[2 << 20 :] + tag)
        assert session.recv(sock, 1 << 20) is not None
    assert storage.list("replicas/") == [index]
    # A crashed receipt's temp file, stamped long ago: collect removes it, nothing else.
    stale = f"replicas/000000000001/0/.x.bin.{int(time.time() - TEMP_GRACE_S - 5)}-{'ab' * 16}.tmp"
    storage.write(stale, b"cut")
    peers = Peers.__new__(Peers)
    peers._local = types.SimpleNamespace(storage=storage, visible=lambda: [1])  # type: ignore[assignment]
    assert peers.collect() == []
    assert storage.list("replicas/") == [index]


def test_a_put_over_the_bound_is_refused_before_its_payload(tmp_path):
    storage = open_storage(str(tmp_path / "root"))
    secret = new_secret()
    server = PeerServer(storage, secret, timeout_s=IO_S, max_bytes=1 << 20)
    try:
        with (
            connect(server.address, secret, timeout_s=IO_S) as peer,
            pytest.raises(PeerError),
        ):
            peer.put(KEY, b"d" * ((1 << 20) + 1))
        assert files_under(tmp_path / "root") == []
    finally:
        server.close()


def test_a_small_frame_is_one_write_and_both_ends_send_without_delay(served, monkeypatch):
    """A frame's tag written on its own waited, under Nagle's algorithm, for the peer's
    delayed acknowledgement (~40 ms a frame, most of a small step's replication): a small
    frame goes out in one write, the same bytes as written in pieces, and both ends of a
    connection turn Nagle off (a large frame's pieces go out at once too)."""
    nonces = (b"s" * 32, b"c" * 32)
    one = frame(Session(b"k", *nonces, server=False), {"op": "put", "key": KEY}, b"x" * 100)
    monkeypatch.setattr(_wire, "ONE_WRITE_BYTES", 0)
    pieces = frame(Session(b"k", *nonces, server=False), {"op": "put", "key": KEY}, b"x" * 100)
    assert len(one) == 1 and len(pieces) == 3 and one[0] == b"".join(pieces)
    monkeypatch.undo()
    _, secret, server = served
    with connect(server.address, secret, timeout_s=10.0) as peer:
        peer.put(KEY, b"small")
        assert peer.get(KEY) == b"small"
        assert peer._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        with server._lock:
            accepted = list(server._conns)
        assert accepted
        assert all(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for c in accepted)
