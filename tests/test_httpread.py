"""Direct reads (``jaxckpt.storage._http``): jaxckpt's own GETs into the restored arrays.

Against the real loopback S3 and GCS servers (the restore path, and its
fallback to TensorStore), and against a small HTTP server on loopback that
answers the way a misbehaving store or proxy would.
"""

from __future__ import annotations

import http.server
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
import pytest
from triggers import HANG_S

import jaxckpt
from jaxckpt.storage import _cloudreads, _http, open_storage
from jaxckpt.storage._http import DirectReader, DirectReadError, StoreUnavailableError
from jaxckpt.storage._retry import Backoff

CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens on loopback


@pytest.mark.usefixtures("plain_by_default")
def test_a_restore_reads_every_chunk_over_its_own_connections(object_root: str) -> None:
    state = {f"w{i}": jnp.arange(16_384 + i, dtype=jnp.float32) for i in range(4)}
    with jaxckpt.CheckpointManager(object_root) as mgr:
        mgr.save(1, state)
    with jaxckpt.CheckpointManager(object_root, read_only=True) as mgr:
        restored = mgr.restore(1, target=state)
        reader = mgr._storage._ranged  # type: ignore[attr-defined]
    for name in state:
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(state[name]))
    assert reader.direct is not None and reader.direct.enabled
    assert (reader.direct.reads, reader.direct.failed) == (4, 0)
    assert reader.peak_inflight_bytes == 0  # nothing went through TensorStore


def test_parts_that_fail_directly_are_read_through_tensorstore(
    object_root: str, caplog: pytest.LogCaptureFixture
) -> None:
    storage = open_storage(object_root, read_part_bytes=1000)
    blob = np.random.default_rng(0).bytes(10_007)
    storage.write("obj/a", blob)
    reader = storage._ranged  # type: ignore[attr-defined]
    reader.direct = DirectReader(CLOSED, lambda name: "/" + name, None, timeout_s=5)
    with caplog.at_level(logging.WARNING, logger="jaxckpt.storage._http"):
        buffer = storage.read_buffer("obj/a", len(blob))
    assert buffer is not None and bytes(buffer) == blob
    assert reader.direct.failed >= _http.FAILURES_BEFORE_OFF and not reader.direct.enabled
    assert "failed in a row; reading through TensorStore from now on" in caplog.text
    assert CLOSED in caplog.text
    failed = reader.direct.failed
    again = storage.read_buffer("obj/a", len(blob))
    assert again is not None and bytes(again) == blob
    assert reader.direct.failed == failed  # switched off: not tried again


def test_a_proxy_in_the_environment_leaves_reads_to_tensorstore(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("https_proxy", CLOSED)
    assert _cloudreads.s3_reader("bucket", "us-east-1", None, 5) is None
    assert _cloudreads.gcs_reader("bucket", None, 5) is None
    monkeypatch.setenv("no_proxy", "amazonaws.com,googleapis.com")
    assert _cloudreads.s3_reader("bucket", "us-east-1", None, 5) is not None
    assert _cloudreads.gcs_reader("bucket", None, 5) is not None


def test_urls_follow_each_store_s_addressing() -> None:
    aws = _cloudreads.s3_reader("my-bucket", "eu-west-1", None, 5)
    dotted = _cloudreads.s3_reader("my.bucket", "eu-west-1", None, 5)
    custom = _cloudreads.s3_reader("b", "us-east-1", "http://127.0.0.1:9000/", 5)
    gcs = _cloudreads.gcs_reader("b", "http://127.0.0.1:4443", 5)
    assert aws is not None and dotted is not None and custom is not None and gcs is not None
    assert aws.base_url == "https://my-bucket.s3.eu-west-1.amazonaws.com"
    assert aws._object_path("run/a b+c") == "/run/a%20b%2Bc"
    assert dotted.base_url == "https://s3.eu-west-1.amazonaws.com"
    assert dotted._object_path("k") == "/my.bucket/k"
    assert (custom.base_url, custom._object_path("run/k")) == ("http://127.0.0.1:9000", "/b/run/k")
    assert gcs._object_path("run/c/0") == "/storage/v1/b/b/o/run%2Fc%2F0?alt=media"
    assert gcs._authorize is None  # plain HTTP (an emulator): never a bearer token


# ---- a loopback server that misbehaves on purpose ---------------------------------------------

BODY = bytes(range(256)) * 4  # 1 KiB


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as object stores
    behaviours: ClassVar[dict[str, Callable[[_Handler, int, int], None]]] = {}
    busy: ClassVar[int] = 0
    connections: ClassVar[list[int]] = []  # one handler per connection: their ports

    def setup(self) -> None:
        super().setup()
        type(self).connections.append(self.client_address[1])

    def do_GET(self) -> None:
        lo, hi = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
        type(self).behaviours[self.path](self, lo, hi)

    def send(
        self,
        status: int,
        body: bytes,
        length: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that gave up (the stall test) resets its connection: expected here


def _ranged(h: _Handler, lo: int, hi: int, shift: int = 0) -> None:
    if lo >= len(BODY):
        h.send(416, b"")
        return
    body = BODY[lo + shift : hi + 1 + shift]
    h.send(
        206,
        body,
        headers={"Content-Range": f"bytes {lo + shift}-{lo + shift + len(body) - 1}/{len(BODY)}"},
    )


def _whole(h: _Handler, lo: int, hi: int) -> None:
    h.send(200, BODY)


def _truncated(h: _Handler, lo: int, hi: int) -> None:
    h.send(
        206, BODY[lo : lo + 40], length=hi + 1 - lo, headers={"Content-Range": f"bytes {lo}-{hi}/*"}
    )
    h.close_connection = True


def _ranged_then_closed(h: _Handler, lo: int, hi: int) -> None:
    """Answers, then closes the connection without saying so (an idle timeout)."""
    _ranged(h, lo, hi)
    h.close_connection = True


STALL = threading.Event()  # set when the test ends: a stalled answer waits for it


def _stalled(h: _Handler, lo: int, hi: int) -> None:
    STALL.wait(HANG_S)
    _ranged(h, lo, hi)


BUSY_ANSWERS = 4


def _busy_then_ok(h: _Handler, lo: int, hi: int) -> None:
    """``503 SlowDown`` to the first :data:`BUSY_ANSWERS` requests, then the range."""
    _Handler.busy += 1
    if _Handler.busy <= BUSY_ANSWERS:
        h.send(503, b"<Error><Code>SlowDown</Code></Error>")
    else:
        _ranged(h, lo, hi)


# Short retries for the misbehaving server: up to 0.05 s apart, for 1 s.
QUICK = Backoff(initial_s=0.01, max_s=0.05, deadline_s=1.0)
READ_TIMEOUT_S = 2.0  # reached by the stalled answers only (the others answer at once)


@pytest.fixture
def misbehaving() -> Iterator[DirectReader]:
    _Handler.behaviours = {
        "/ok": _ranged,
        "/closes": _ranged_then_closed,
        "/whole": _whole,
        "/truncated": _truncated,
        "/missing": lambda h, lo, hi: h.send(404, b"<Error>NoSuchKey</Error>"),
        "/busy": lambda h, lo, hi: h.send(503, b"<Error>SlowDown</Error>"),
        "/throttled": lambda h, lo, hi: h.send(429, b"Too Many Requests"),
        "/busy-then-ok": _busy_then_ok,
        "/shifted": lambda h, lo, hi: _ranged(h, lo, hi, shift=8),
        "/no-range": lambda h, lo, hi: h.send(206, BODY[lo : hi + 1]),
        "/stalled": _stalled,
    }
    _Handler.connections = []
    _Handler.busy = 0
    STALL.clear()
    server = _QuietServer(("127.0.0.1", 0), _Handler)
    # A short poll: shutdown() waits for serve_forever to look (0.5 s by default).
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    reader = DirectReader(
        f"http://127.0.0.1:{server.server_address[1]}",
        lambda name: "/" + name,
        None,
        READ_TIMEOUT_S,
        backoff=QUICK,
    )
    yield reader
    STALL.set()
    reader.close()
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_ranges_land_in_the_buffer_and_connections_are_reused(misbehaving: DirectReader) -> None:
    out = bytearray(100)
    assert misbehaving.read_into("ok", 300, memoryview(out)) == 100
    assert bytes(out) == BODY[300:400]
    assert misbehaving.read_into("ok", 1000, memoryview(out)) == 24  # the object is shorter
    assert bytes(out[:24]) == BODY[1000:]
    assert misbehaving.read_into("ok", 2000, memoryview(out)) == 0  # 416: it ends before
    assert misbehaving.read_into("missing", 0, memoryview(out)) is None
    assert len(_Handler.connections) == 1
    assert (misbehaving.reads, misbehaving.failed) == (4, 0)


def test_a_kept_alive_connection_the_server_closed_is_replaced_not_failed(
    misbehaving: DirectReader,
) -> None:
    out = bytearray(100)
    for offset in (0, 100, 200):
        assert misbehaving.read_into("closes", offset, memoryview(out)) == 100
        assert bytes(out) == BODY[offset : offset + 100]
    assert len(_Handler.connections) == 3  # the later GETs found their idle connection closed
    assert (misbehaving.reads, misbehaving.failed) == (3, 0)


def test_a_server_that_ignores_the_range_is_read_only_from_the_start(
    misbehaving: DirectReader,
) -> None:
    out = bytearray(100)
    assert misbehaving.read_into("whole", 0, memoryview(out)) == 100
    assert bytes(out) == BODY[:100]
    with pytest.raises(DirectReadError, match="HTTP 200"):
        misbehaving.read_into("whole", 300, memoryview(out))


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("shifted", "asked for bytes from 0, got bytes 8-107/1024"),
        ("no-range", "asked for bytes from 0, got no range"),
    ],
)
def test_failures_are_direct_read_errors_and_switch_it_off(
    misbehaving: DirectReader, name: str, match: str
) -> None:
    out = bytearray(100)
    for _ in range(_http.FAILURES_BEFORE_OFF):
        assert misbehaving.enabled
        with pytest.raises(DirectReadError, match=match):
            misbehaving.read_into(name, 0, memoryview(out))
    assert not misbehaving.enabled
    assert misbehaving.failed == _http.FAILURES_BEFORE_OFF


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("busy", "HTTP 503"),
        ("throttled", "HTTP 429"),
        ("truncated", "ended after 40 of 100 bytes"),
        ("stalled", "timed out"),
    ],
)
def test_throttling_and_transient_failures_are_retried_until_the_deadline(
    misbehaving: DirectReader, name: str, match: str
) -> None:
    """Retried with backoff for the deadline, then the read fails; direct reads stay on."""
    out = bytearray(100)
    for _ in range(_http.FAILURES_BEFORE_OFF + 1):
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError, match=match) as info:
            misbehaving.read_into(name, 0, memoryview(out))
        took = time.monotonic() - start  # its last attempt may start just before the deadline
        assert QUICK.deadline_s <= took < QUICK.deadline_s + READ_TIMEOUT_S + 10.0, took
        # the message tells how long it kept trying: the deadline at least (more on a busy
        # machine, where the last attempt ends after it)
        tried = re.search(r"\(\d+ attempts in (\d+\.\d) s\)", str(info.value))
        assert tried and float(tried.group(1)) >= QUICK.deadline_s, str(info.value)
    assert misbehaving.enabled and misbehaving.failed == 0
    assert misbehaving.retries >= 4 * (_http.FAILURES_BEFORE_OFF + 1) or name == "stalled"


def test_a_store_that_stops_throttling_is_read_directly(misbehaving: DirectReader) -> None:
    out = bytearray(100)
    assert misbehaving.read_into("busy-then-ok", 300, memoryview(out)) == 100
    assert bytes(out) == BODY[300:400]
    assert misbehaving.retries == BUSY_ANSWERS
    assert (misbehaving.reads, misbehaving.failed, misbehaving.enabled) == (1, 0, True)


def test_a_credential_error_is_a_direct_read_error(misbehaving: DirectReader) -> None:
    def no_credentials(url: str, headers: dict[str, str]) -> None:
        raise LookupError("no credentials in the chain")

    misbehaving._authorize = no_credentials
    with pytest.raises(DirectReadError, match="cannot authorize: LookupError: no credentials"):
        misbehaving.read_into("ok", 0, memoryview(bytearray(10)))
    assert misbehaving.failed == 1


def test_a_success_resets_the_run_of_failures(misbehaving: DirectReader) -> None:
    out = bytearray(10)
    for _ in range(2 * _http.FAILURES_BEFORE_OFF):
        with pytest.raises(DirectReadError):
            misbehaving.read_into("shifted", 0, memoryview(out))
        assert misbehaving.read_into("ok", 0, memoryview(out)) == 10
    assert misbehaving.enabled


def test_s3_reads_are_signed_as_a_checking_server_expects(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto with IAM checks on: a read signed with the key's secret passes, a wrong one fails."""
    import boto3
    from benchkit import servers

    server = servers.start_moto(tmp_path, unauthenticated_requests=5)
    try:
        iam = boto3.client("iam", endpoint_url=server.endpoint, region_name="us-east-1")
        iam.create_user(UserName="trainer")
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        policy = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", '
        policy += '"Action": "s3:*", "Resource": "*"}]}'
        iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=policy)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        blob = np.random.default_rng(1).bytes(5000)
        storage = open_storage(f"s3://{server.bucket}/run", endpoint=server.endpoint)
        storage.write("obj/a b", blob)  # TensorStore's signed PUT: the checks are on
        reader = _cloudreads.s3_reader(server.bucket, "us-east-1", server.endpoint, 10)
        assert reader is not None
        out = bytearray(3000)
        assert reader.read_into("run/obj/a b", 1000, memoryview(out)) == 3000
        assert bytes(out) == blob[1000:4000]
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong" + key["SecretAccessKey"][5:])
        forged = _cloudreads.s3_reader(server.bucket, "us-east-1", server.endpoint, 10)
        assert forged is not None
        with pytest.raises(DirectReadError, match="HTTP 403"):
            forged.read_into("run/obj/a b", 0, memoryview(out))
    finally:
        server.stop()
