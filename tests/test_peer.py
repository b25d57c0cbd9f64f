"""The peer transport (jaxckpt.tiers._transport) over real loopback sockets."""

from __future__ import annotations

import logging
import socket

import pytest
from triggers import Hold

from jaxckpt import PeerAuthError, PeerError
from jaxckpt.storage import open_storage
from jaxckpt.tiers._peerclient import connect
from jaxckpt.tiers._transport import PeerServer, new_secret

IO_S = 60.0  # a member's socket timeout and the listener's idle bound: only a hang reaches them


@pytest.fixture
def served(tmp_path):
    storage = open_storage(str(tmp_path / "root"))
    secret = new_secret()
    server = PeerServer(storage, secret, timeout_s=IO_S)
    yield storage, secret, server
    server.close()


def test_put_get_list_delete_round_trip(served):
    storage, secret, server = served
    data = bytes(range(256)) * 4096  # 1 MiB
    with connect(server.address, secret, timeout_s=IO_S) as peer:
        peer.put("replicas/000000000001/0/a/b.bin", data)
        peer.put("replicas/000000000001/0/a.json", b"{}")
        assert peer.get("replicas/000000000001/0/a/b.bin") == data
        assert peer.get("replicas/000000000001/0/missing") is None
        assert sorted(peer.list("replicas/000000000001/")) == [
            "replicas/000000000001/0/a.json",
            "replicas/000000000001/0/a/b.bin",
        ]
        peer.delete_prefix("replicas/000000000001/")
        assert peer.list("replicas/") == []
    assert storage.list("replicas/") == []


def test_keys_outside_the_served_prefix_are_refused(served):
    storage, secret, server = served
    storage.write("jaxckpt.json", b"own")
    with connect(server.address, secret, timeout_s=IO_S) as peer:
        for key in ("jaxckpt.json", "replicas/../jaxckpt.json", "replicas//x", "attempts/1/x"):
            with pytest.raises(PeerError, match="is refused"):
                peer.get(key)
            with pytest.raises(PeerError, match="is refused"):
                peer.put(key, b"evil")
    assert storage.read("jaxckpt.json") == b"own"
    assert storage.list("attempts/") == []


def test_a_wrong_secret_is_refused_both_ways_and_nothing_is_written(served, caplog):
    storage, secret, server = served
    with (
        caplog.at_level(logging.WARNING, logger="jaxckpt"),
        pytest.raises(PeerAuthError, match="refused the connection"),
        connect(server.address, new_secret(), timeout_s=IO_S) as peer,
    ):
        peer.put("replicas/000000000001/0/x", b"injected")  # never reached
    assert server.refused == 1
    assert "does not know the job's secret" in caplog.text
    assert storage.list("replicas/") == []
    # A listener that does not know the secret cannot pose as a peer either.
    impostor = PeerServer(storage, new_secret(), timeout_s=IO_S)
    try:
        with pytest.raises(PeerAuthError), connect(impostor.address, secret, timeout_s=IO_S):
            pass
    finally:
        impostor.close()


def test_a_frame_over_the_bound_is_refused(tmp_path):
    storage = open_storage(str(tmp_path / "root"))
    secret = new_secret()
    server = PeerServer(storage, secret, timeout_s=IO_S, max_bytes=1000)
    try:
        with connect(server.address, secret, timeout_s=IO_S) as peer, pytest.raises(PeerError):
            peer.put("replicas/000000000001/0/big", b"x" * 2000)
        assert storage.list("replicas/") == []
    finally:
        server.close()


def test_a_stalled_peer_times_out_within_the_bound():
    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        # the listener stays open and silent until after the client gave up by itself
        with (
            pytest.raises(PeerError, match=r"did not answer within 0\.5s"),
            connect(address, new_secret(), timeout_s=0.5),
        ):
            pass
    finally:
        listener.close()


def test_a_peer_that_stalls_mid_request_times_out(served, monkeypatch):
    storage, secret, server = served
    stuck = Hold(lambda key: None)  # a stuck disk: it answers once released
    monkeypatch.setattr(storage, "read", stuck)
    try:
        with connect(server.address, secret, timeout_s=IO_S) as peer:
            peer._sock.settimeout(0.5)  # after the handshake: only the stalled get reaches it
            with pytest.raises(PeerError, match="no answer within the timeout"):
                peer.get("replicas/000000000001/0/x")
            assert stuck.returned == 0  # it gave up while the disk was still stuck
    finally:
        stuck.release()


def test_a_closed_server_is_unreachable(tmp_path):
    storage = open_storage(str(tmp_path / "root"))
    secret = new_secret()
    server = PeerServer(storage, secret, timeout_s=IO_S)
    address = server.address
    server.close()
    server.close()  # idempotent
    with (
        pytest.raises(PeerError, match=r"cannot reach|failed|did not answer"),
        connect(address, secret, timeout_s=1.0),
    ):
        pass
