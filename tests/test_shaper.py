"""The shaping proxy (``benchkit/shaper.py``): latency and caps hold, jaxckpt works through it.

Timing bounds are lower bounds with a 10% tolerance (a loaded machine makes
transfers slower, never faster), plus loose upper bounds that catch a proxy
that stalls.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import numpy as np
import pytest
from benchkit import servers
from benchkit.shaper import Profile, RequestCounter, Shaper

import jaxckpt

MB = 1e6
Handler = Callable[[socket.socket], None]


@contextmanager
def upstream(handler: Handler) -> Iterator[str]:
    """A loopback TCP server running ``handler(conn)`` per connection; yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: _run(handler, c), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        with suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        listener.close()
        thread.join(timeout=5)


def _run(handler: Handler, conn: socket.socket) -> None:
    with conn:
        handler(conn)


def send_n(n: int) -> Handler:
    """A handler that waits for one byte, then sends ``n`` bytes and closes."""

    def handler(conn: socket.socket) -> None:
        conn.recv(1)
        conn.sendall(b"x" * n)

    return handler


def echo(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)


def fetch(endpoint: str, n: int) -> None:
    """Connects through the proxy, asks for the bytes, reads ``n`` of them."""
    port = int(endpoint.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"?")
        got = 0
        while chunk := s.recv(1 << 20):
            got += len(chunk)
    assert got == n


def test_one_connection_is_held_to_its_cap() -> None:
    n, cap = 2_000_000, 4 * MB
    with upstream(send_n(n)) as url, Shaper(url, Profile(name="c", conn_bytes_per_s=cap)) as sh:
        t0 = time.monotonic()
        fetch(sh.endpoint, n)
        elapsed = time.monotonic() - t0
        assert sh.counts()["bytes_down"] == n
    assert 0.9 * n / cap <= elapsed < 5 * n / cap, elapsed


def test_connections_together_are_held_to_the_total_cap() -> None:
    n, total = 1_000_000, 4 * MB
    profile = Profile(name="t", conn_bytes_per_s=100 * MB, total_bytes_per_s=total)
    with upstream(send_n(n)) as url, Shaper(url, profile) as sh:
        t0 = time.monotonic()
        threads = [threading.Thread(target=fetch, args=(sh.endpoint, n)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        elapsed = time.monotonic() - t0
        assert sh.counts()["connections"] == 2
    # each alone would take 0.01 s at its own cap; together they share the total
    assert 0.9 * 2 * n / total <= elapsed < 5 * 2 * n / total, elapsed


def test_a_round_trip_takes_twice_the_latency_and_connecting_one_more() -> None:
    latency = 0.05
    with upstream(echo) as url, Shaper(url, Profile(name="l", latency_s=latency)) as sh:
        port = int(sh.endpoint.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            t0 = time.monotonic()
            s.sendall(b"ping")
            assert s.recv(16) == b"ping"
            first = time.monotonic() - t0  # handshake RTT + request RTT
            t0 = time.monotonic()
            s.sendall(b"pong")
            assert s.recv(16) == b"pong"
            second = time.monotonic() - t0
    assert 0.9 * 4 * latency <= first < 4 * latency + 1.0, first
    assert 0.9 * 2 * latency <= second < 2 * latency + 1.0, second


@pytest.mark.parametrize(
    "url", ["http://10.0.0.1:80", "http://example.com:80", "https://127.0.0.1:1"]
)
def test_refuses_anything_but_a_loopback_upstream(url: str) -> None:
    with pytest.raises(ValueError, match="upstream"):
        Shaper(url)


def test_request_counter_skips_bodies_of_either_framing() -> None:
    counter = RequestCounter()
    put = b"PUT /a HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\n" + b"GET /x HTTP/1.1"[:10]
    chunked = b"POST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nGET \r\n0\r\n\r\n"
    stream = put + chunked + b"GET /c HTTP/1.1\r\n\r\n"
    for i in range(0, len(stream), 7):  # fed in pieces that split lines and bodies
        counter.feed(stream[i : i + 7])
    assert counter.requests == 3


@pytest.mark.parametrize("kind", ["s3", "gcs"])
@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_jaxckpt_round_trips_through_the_shaper(
    kind: str, layout: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    server: servers.Server = request.getfixturevalue(f"{kind}_server")
    profile = Profile(name="20ms", latency_s=0.005, conn_bytes_per_s=25 * MB)
    rng = np.random.default_rng(0)
    state = {
        "w": rng.standard_normal((64, 256), dtype=np.float32),
        "b": rng.standard_normal(7, dtype=np.float32),
        "step": np.int64(3),
    }
    with Shaper(server.endpoint, profile) as sh:
        if kind == "s3":
            monkeypatch.setenv("AWS_ENDPOINT_URL_S3", sh.endpoint)
            root = f"s3://{server.bucket}/shaped-{layout}-{time.monotonic_ns()}"
        else:
            monkeypatch.setenv("STORAGE_EMULATOR_HOST", sh.endpoint)
            monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", sh.endpoint)
            root = f"gs://{server.bucket}/shaped-{layout}-{time.monotonic_ns()}"
        with jaxckpt.CheckpointManager(root, layout=layout) as mgr:
            mgr.save(1, state)
            mgr.wait()
        with jaxckpt.CheckpointManager(root, layout=layout) as mgr:
            out = mgr.restore(1)
        assert sh.counts()["requests"] > 0
    for name, value in state.items():
        got = np.asarray(out[name])
        assert got.dtype == np.asarray(value).dtype and got.tobytes() == np.asarray(value).tobytes()


def test_shaper_process_proxies_and_counts_from_its_own_process(
    s3_server: servers.Server,
) -> None:
    import tensorstore as ts
    from benchkit.shaper import ShaperProcess

    latency = 0.02
    with ShaperProcess(s3_server.endpoint, Profile(name="p", latency_s=latency)) as sh:
        kv = ts.KvStore.open(
            {
                "driver": "s3",
                "bucket": s3_server.bucket,
                "endpoint": sh.endpoint,
                "aws_region": "us-east-1",
            }
        ).result()
        start = time.monotonic()
        kv.write(f"proc-{time.monotonic_ns()}", b"x" * 1000).result()
        took = time.monotonic() - start
        counts = sh.counts(reset=True)
        assert counts["requests"] >= 1 and counts["bytes_up"] >= 1000, counts
        assert took >= 2 * latency  # the proxy's own process delayed it
        assert sh.counts()["requests"] == 0  # reset
        child = sh._process
    assert not child.is_alive()
