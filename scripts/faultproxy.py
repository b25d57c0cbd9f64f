"""A fault-injecting HTTP proxy for the loopback object-store servers.

``scripts/torture.py`` puts one in front of moto (S3) and one in front of the
GCS emulator and points the writer processes at it
(``AWS_ENDPOINT_URL_S3`` / ``STORAGE_EMULATOR_HOST``). Each request is
forwarded to the server unchanged (the ``Host`` header too, so S3 signatures
stay valid), except that, with the probabilities of the current
:class:`FaultPlan`, it is

* answered ``503 Service Unavailable`` without being forwarded (``error``);
* answered ``503 SlowDown`` (S3's throttling reply, its XML error body) or, for a
  GCS request, ``429 Too Many Requests`` without being forwarded (``throttle``);
* cut by a TCP reset before it is forwarded (``reset``);
* forwarded, then cut by a reset instead of the answer (``lost``): the server
  did the work but the client cannot know, the nastiest transient fault, as a
  load balancer dropping a connection produces;
* delayed by up to ``slow_s`` seconds before it is forwarded (``slow``).

:meth:`FaultProxy.inject` can also flip one byte of a response's body
(``flip``): a transfer error that only a checksum catches, once; or answer
``403 Forbidden`` (S3's ``AccessDenied``) to the requests a rule matches
(``deny``): a host whose credentials or bucket policy changed, for as many
requests as the rule says or for good (:meth:`FaultProxy.deny`).

It forwards to 127.0.0.1 only (the upstream is checked), speaks HTTP/1.1 with
keep-alive to the client and opens one upstream connection per request.
Stdlib only; runs in threads of the calling process.

>>> plan = FaultPlan(error=0.05, reset=0.02, lost=0.02, slow=0.05, slow_s=0.2)
>>> plan.total
0.14
"""

from __future__ import annotations

import http.client
import http.server
import os
import random
import socket
import struct
import sys
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from typing import Any

LOOPBACK = ("127.0.0.1", "localhost")
FAULT_KINDS = ("error", "reset", "lost", "slow")
PLAN_KINDS = (*FAULT_KINDS, "throttle")  # what a plan can inject (torture plans: FAULT_KINDS)
INJECT_KINDS = (*PLAN_KINDS, "flip", "deny")  # by FaultProxy.inject only, never by a plan
_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_TOO_MANY = b'{"error": {"code": 429, "message": "The rate of change requests is too high."}}'
_DENIED = b"<Error><Code>AccessDenied</Code><Message>denied</Message></Error>"

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "expect",
}
_UPSTREAM_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """Probabilities, per request, of each fault; at most one fault per request.

    Attributes:
      error: answer 503 without forwarding.
      reset: reset the connection without forwarding.
      lost: forward, then reset the connection instead of answering.
      slow: delay forwarding by a uniform 0..``slow_s`` seconds.
      slow_s: the longest delay.
      throttle: answer as a throttling store does (S3 ``503 SlowDown``, GCS ``429``).
    """

    error: float = 0.0
    reset: float = 0.0
    lost: float = 0.0
    slow: float = 0.0
    slow_s: float = 0.5
    throttle: float = 0.0

    def __post_init__(self) -> None:
        for name in PLAN_KINDS:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"fault rate {name} must be in [0, 1], got {getattr(self, name)}")
        if self.total > 1.0:
            raise ValueError(f"fault rates add up to {self.total} > 1")
        if self.slow_s < 0:
            raise ValueError(f"slow_s must be >= 0, got {self.slow_s}")

    @property
    def total(self) -> float:
        return round(sum(getattr(self, name) for name in PLAN_KINDS), 9)

    def scaled(self, factor: float) -> FaultPlan:
        """The same plan with every rate multiplied by ``factor`` (capped so they sum to <= 1)."""
        factor = min(factor, 1.0 / self.total) if self.total else factor
        rates = {name: getattr(self, name) * factor for name in PLAN_KINDS}
        return FaultPlan(**rates, slow_s=self.slow_s)

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """``"error=0.05,reset=0.02,lost=0.02,slow=0.05,slow_s=0.3"`` (missing: 0)."""
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name not in (*PLAN_KINDS, "slow_s"):
                raise ValueError(f"bad fault rate {item!r}: use NAME=VALUE, NAME in {PLAN_KINDS}")
            values[name] = float(value)
        return cls(**values)


NO_FAULTS = FaultPlan()


class FaultProxy:
    """A threaded HTTP proxy to one loopback server, injecting faults per :class:`FaultPlan`.

    Args:
      upstream: the server's base URL, ``http://127.0.0.1:PORT``.
      seed: seeds the fault choices (the thread interleaving still varies).
      nice: the nice value of the proxy's threads (Linux: its listener's, which the
        threads serving its connections inherit).
    """

    def __init__(self, upstream: str, *, seed: int = 0, nice: int = 0) -> None:
        url = urllib.parse.urlsplit(upstream)
        if url.scheme != "http" or url.hostname not in LOOPBACK or url.port is None:
            raise ValueError(f"the proxy forwards to http://127.0.0.1:PORT only, got {upstream!r}")
        self.upstream = ("127.0.0.1", url.port)
        self._plan = NO_FAULTS
        self._rules: list[_Rule] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self._nice = nice
        self._thread = threading.Thread(target=self._serve, name="faultproxy", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        if self._nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        self._server.serve_forever()

    @property
    def endpoint(self) -> str:
        """The proxy's base URL, to use in place of the server's."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    @plan.setter
    def plan(self, plan: FaultPlan) -> None:
        with self._lock:
            self._plan = plan

    def inject(self, kind: str, *, method: str, path_contains: str, times: int | None = 1) -> None:
        """Injects ``kind`` into the next ``times`` requests that match, whatever the plan.

        Args:
          kind: one of :data:`INJECT_KINDS` (``flip``: forward, then flip the middle byte
            of the response body; ``deny``: answer ``403 AccessDenied``).
          method: the HTTP method to match (``PUT``, ``POST``, ...).
          path_contains: a substring of the URL-decoded request path and query.
          times: how many requests; None: every matching request until
            :meth:`clear_rules`.
        """
        if kind not in INJECT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; use one of {INJECT_KINDS}")
        with self._lock:
            self._rules.append(_Rule(kind, method.upper(), path_contains, times))

    def deny(self, *rules: tuple[str, str]) -> None:
        """Answers ``403 AccessDenied`` to every request that matches a ``(method, path
        fragment)`` rule, until :meth:`clear_rules`; ``counts["deny"]`` counts them."""
        for method, fragment in rules:
            self.inject("deny", method=method, path_contains=fragment, times=None)

    def clear_rules(self) -> None:
        """Drops every rule of :meth:`inject` and :meth:`deny`."""
        with self._lock:
            self._rules.clear()

    def wait_idle(self, timeout: float) -> bool:
        """Waits until no request is being forwarded; False on timeout.

        A writer killed mid-request leaves its request here, still to be
        forwarded (a slow fault delays it): the server applies it after the
        client is gone, as a real store may. Checks wait for that to settle.
        """
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout=timeout)

    def _enter(self) -> None:
        with self._lock:
            self._inflight += 1

    def _leave(self) -> None:
        with self._idle:
            self._inflight -= 1
            self._idle.notify_all()

    def snapshot(self) -> Counter[str]:
        """A copy of the counts: ``requests`` and one entry per fault kind injected."""
        with self._lock:
            return Counter(self.counts)

    def _choose(self, method: str, path: str) -> tuple[str | None, float]:
        with self._lock:
            self.counts["requests"] += 1
            x = self._rng.random()
            plan = self._plan
            delay = self._rng.uniform(0.0, plan.slow_s)
            for rule in self._rules:
                if rule.matches(method, path):
                    if rule.times is not None:
                        rule.times -= 1
                    self.counts[rule.kind] += 1
                    return rule.kind, delay
            for kind in PLAN_KINDS:
                rate = getattr(plan, kind)
                if x < rate:
                    self.counts[kind] += 1
                    return kind, delay
                x -= rate
            return None, 0.0

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


@dataclass
class _Rule:
    kind: str
    method: str
    path_contains: str
    times: int | None  # None: for good

    def matches(self, method: str, path: str) -> bool:
        left = self.times is None or self.times > 0
        return left and self.method == method and self.path_contains in path


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    proxy: FaultProxy

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Clients that hang up (a killed writer, a reset we injected) are not errors."""
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        # A response goes out in two writes (headers, body): without this, Nagle's algorithm
        # holds the body until the client's delayed ACK, 40 ms a response that no store adds.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would drown the torture run's output

    def do_GET(self) -> None:
        self._proxy()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_GET

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _reset(self) -> None:
        """Closes the client connection with a TCP RST (SO_LINGER 0)."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    def _proxy(self) -> None:
        self.server.proxy._enter()
        try:
            self._forward_with_faults()
        finally:
            self.server.proxy._leave()

    def _forward_with_faults(self) -> None:
        body = self._body()
        fault, delay = self.server.proxy._choose(self.command, urllib.parse.unquote(self.path))
        if fault == "error":
            payload = b"injected fault: 503 Service Unavailable\n"
            self.send_response_only(503, "Service Unavailable")
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(payload)
            self.close_connection = True
            return
        if fault == "throttle":
            gcs = self.path.startswith(("/storage/", "/upload/", "/batch/"))
            status, reason, payload = (
                (429, "Too Many Requests", _TOO_MANY) if gcs else (503, "Slow Down", _SLOWDOWN)
            )
            self.send_response_only(status, reason)
            self.send_header("Content-Type", "application/json" if gcs else "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        if fault == "deny":
            self.send_response_only(403, "Forbidden")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(_DENIED)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(_DENIED)
            return
        if fault == "reset":
            self._reset()
            return
        if fault == "slow":
            time.sleep(delay)
        try:
            status, reason, headers, data = self._forward(body)
        except OSError as e:
            self.send_error(502, f"upstream failed: {e}")
            self.close_connection = True
            return
        if fault == "lost":
            self._reset()
            return
        if fault == "flip":
            data = _flipped(data)
        self.send_response_only(status, reason)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        if self.command == "HEAD" or status in (204, 304) or 100 <= status < 200:
            length = dict((k.lower(), v) for k, v in headers).get("content-length")
            if length is not None:
                self.send_header("Content-Length", length)
            self.end_headers()
            return
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.server.proxy.upstream, timeout=_UPSTREAM_TIMEOUT_S)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                    conn.putheader(name, value)
            if body or self.command in ("PUT", "POST", "PATCH"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            response = conn.getresponse()
            data = response.read()
            return response.status, response.reason, response.getheaders(), data
        finally:
            conn.close()


def _flipped(data: bytes) -> bytes:
    """``data`` with its middle byte inverted."""
    if not data:
        return data
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
