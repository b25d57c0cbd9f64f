"""A loopback TCP proxy that makes a loopback object store look far away.

Loopback servers answer at once and serve any one connection as fast as the
CPU allows, which hides how many requests a design keeps in flight. A
:class:`Shaper` sits between a client and one loopback upstream (moto, the GCS
emulator) and, per TCP connection,

* delays each direction by ``latency_s`` (so a request's round trip is at
  least ``2 * latency_s``), and the first bytes a client sends by one more
  round trip, the TCP handshake a far-away server costs (moto closes every
  connection after its response, so every request pays it, as it would
  over a fresh connection to a real store; ``Profile.handshake=False``
  models kept-alive connections instead);
* caps the connection's rate in each direction at ``conn_bytes_per_s``
  (a token bucket per connection and direction);
* caps all connections and both directions together at
  ``total_bytes_per_s`` (one shared token bucket: a host's NIC).

It counts connections, HTTP requests (parsed from the client's byte stream:
request line, headers, a ``Content-Length`` or chunked body) and bytes, so a
benchmark can report requests per step without reading server logs. With
``exchanges`` set to a list it also records each request as an
:class:`Exchange`: when it started, its request line, and the status and body
bytes of its response (parsed from the server's byte stream by
:class:`ResponseCounter`), so requests can be told apart by kind and key.

It forwards to a loopback address only (checked when it is constructed) and
listens on 127.0.0.1. Stdlib only; it runs in threads of the calling
process: per connection, a reader and a writer thread for each direction.

>>> Profile(name="20ms", latency_s=0.01, conn_bytes_per_s=25e6, total_bytes_per_s=200e6).rtt_s
0.02
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import ipaddress
import queue
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

CHUNK_BYTES = 64 << 10
QUEUE_CHUNKS = 64  # per direction: 4 MiB in flight inside the proxy, > any delay x rate here
_EOF = b""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Profile:
    """How far away the shaped store is. ``None`` rates are uncapped."""

    name: str
    latency_s: float = 0.0
    conn_bytes_per_s: float | None = None
    total_bytes_per_s: float | None = None
    handshake: bool = True
    """Charge every new connection a round trip before its first bytes. False models a
    client whose connections are kept alive (moto closes each one after its response,
    so every request opens one; a real store keeps them open for the next request)."""

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"profile {self.name}: latency_s must be >= 0, got {self.latency_s}")
        for rate in (self.conn_bytes_per_s, self.total_bytes_per_s):
            if rate is not None and rate <= 0:
                raise ValueError(f"profile {self.name}: rates must be > 0, got {rate}")

    @property
    def rtt_s(self) -> float:
        return 2 * self.latency_s


BARE = Profile(name="bare")


class TokenBucket:
    """A thread-safe token bucket of ``rate`` bytes/s; ``take`` blocks until its bytes are due.

    A taker may overdraw (the bucket goes into debt) and then sleeps until the
    debt is paid, so over any interval the bytes taken stay below
    ``rate * interval + burst`` however many threads take at once.
    """

    def __init__(self, rate: float | None, burst: int = CHUNK_BYTES) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._tokens = float(burst)
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if self._rate is None:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
            self._stamp = now
            self._tokens -= n
            wait = -self._tokens / self._rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


class RequestCounter:
    """Counts HTTP/1.x requests in a client's byte stream, fed chunk by chunk."""

    def __init__(self, on_request: Callable[[bytes], None] | None = None) -> None:
        self.requests = 0
        self._on_request = on_request
        self._head = b""
        self._body_left = 0
        self._chunked = False
        self._tail = b""  # the last bytes of a chunked body, to find its terminator

    def feed(self, data: bytes) -> int:
        """Consumes ``data``; returns how many requests started in it."""
        started = 0
        while data:
            if self._body_left:
                n = min(self._body_left, len(data))
                self._body_left -= n
                data = data[n:]
                continue
            if self._chunked:
                joined = self._tail + data
                if joined.startswith(b"0\r\n\r\n") and not self._tail:
                    end = 5  # an empty chunked body
                else:
                    found = joined.find(b"\r\n0\r\n\r\n")
                    end = -1 if found < 0 else found + 7
                if end < 0:
                    self._tail = joined[-6:]
                    return started
                self._chunked, self._tail = False, b""
                data = joined[end:]
                continue
            self._head += data
            data = b""
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return started
            head, data = self._head[:end], self._head[end + 4 :]
            self._head = b""
            started += 1
            self.requests += 1
            if self._on_request is not None:
                self._on_request(head.split(b"\r\n", 1)[0])
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    self._body_left = int(value.strip() or 0)
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    self._chunked = True
        return started


@dataclasses.dataclass
class Exchange:
    """One HTTP request through the proxy and what its response carried (filled in as it comes).

    Mutable on purpose: the request side creates it, the response side fills it in.
    """

    started: float
    """``time.monotonic()`` when the request's head had arrived (shared by every process of
    the machine, so a child's own monotonic stamps bracket it)."""
    method: str
    target: str
    """The request target as sent: ``/bucket/key?query``."""
    status: int = 0
    """The response's status; 0 while no response has come."""
    received: int = 0
    """Body bytes of the response (chunked bodies: their bytes as framed)."""


class ResponseCounter:
    """Splits a server's HTTP/1.x byte stream into responses, filling in their exchanges.

    Responses come in request order on a connection, so each one (bar ``1xx``
    interim responses) completes the oldest exchange of ``pending``. A response
    to HEAD, a 204 and a 304 have no body; otherwise ``Content-Length``, a
    chunked body, or every byte until the connection closes.
    """

    def __init__(self, pending: collections.deque[Exchange]) -> None:
        self._pending = pending
        self._current: Exchange | None = None
        self._head = b""
        self._body_left = 0
        self._chunked = False
        self._until_close = False
        self._tail = b""

    def feed(self, data: bytes) -> None:
        while data:
            if self._until_close or self._body_left or self._chunked:
                data = self._body(data)
                continue
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = self._head[:end], self._head[end + 4 :]
            self._head = b""
            self._start(head)

    def _start(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        try:
            status = int(lines[0].split()[1])
        except (IndexError, ValueError):
            status = 0
        if 100 <= status < 200:
            return  # an interim response (100 Continue): the final one follows
        current = self._pending.popleft() if self._pending else None
        if current is not None:
            current.status = status
        self._current = current
        if (current is not None and current.method == "HEAD") or status in (204, 304):
            return
        length = None
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value.strip() or 0)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunked = True
        if self._chunked:
            return
        if length is None:
            self._until_close = True
        else:
            self._body_left = length

    def _body(self, data: bytes) -> bytes:
        """Counts the body bytes at the front of ``data``; returns what follows the body."""
        if self._until_close:
            n = len(data)
        elif self._body_left:
            n = min(self._body_left, len(data))
            self._body_left -= n
        else:  # chunked: up to the terminating zero-length chunk
            joined = self._tail + data
            found = joined.find(b"0\r\n\r\n") if joined.startswith(b"0\r\n") else -1
            if found < 0:
                found = joined.find(b"\r\n0\r\n\r\n")
                found = -1 if found < 0 else found + 2
            if found < 0:
                self._tail = joined[-6:]
                n = len(data)
            else:
                n = max(0, found + 5 - len(self._tail))
                self._chunked, self._tail = False, b""
        if self._current is not None:
            self._current.received += n
        return data[n:]


def _loopback_address(url: str) -> tuple[str, int]:
    """``(host, port)`` of ``http://HOST:PORT`` if HOST is a loopback address; else ValueError."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise ValueError(f"upstream {url!r}: expected http://127.0.0.1:PORT")
    host = "127.0.0.1" if parts.hostname == "localhost" else parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"upstream {url!r}: the shaper forwards to loopback addresses only")
    return host, parts.port


class Shaper:
    """A shaping TCP proxy on 127.0.0.1 in front of one loopback upstream.

    Args:
      upstream: ``http://127.0.0.1:PORT`` of the server; anything that is not
        a loopback address raises ``ValueError`` here, before any socket opens.
      profile: latency and caps.

    Use as a context manager; :attr:`endpoint` is the URL clients use.
    """

    def __init__(self, upstream: str, profile: Profile = BARE) -> None:
        self._upstream = _loopback_address(upstream)
        self.profile = profile
        self._total = TokenBucket(profile.total_bytes_per_s)
        self._lock = threading.Lock()
        self._counts = {"connections": 0, "requests": 0, "bytes_up": 0, "bytes_down": 0}
        self.trace: list[tuple[float, str]] | None = None
        """Set to a list to record ``(monotonic time, request line)`` of every request."""
        self.exchanges: list[Exchange] | None = None
        """Set to a list to record every request as an :class:`Exchange`."""
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept, name="shaper-accept", daemon=True)

    def __enter__(self) -> Shaper:
        self._accepter.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        self._listener.close()
        self._accepter.join(timeout=5)

    def counts(self, reset: bool = False) -> dict[str, int]:
        """Connections, requests and bytes (each way) since the start or the last reset."""
        with self._lock:
            out = dict(self._counts)
            if reset:
                self._counts = dict.fromkeys(self._counts, 0)
        return out

    def _trace_request(self, line: bytes) -> Exchange | None:
        """Records one request; its :class:`Exchange` when exchanges are recorded."""
        trace, exchanges = self.trace, self.exchanges
        if trace is None and exchanges is None:
            return None
        now, text = time.monotonic(), line.decode("latin-1")
        if trace is not None:
            trace.append((now, text))
        if exchanges is None:
            return None
        method, _, rest = text.partition(" ")
        exchange = Exchange(started=now, method=method, target=rest.rpartition(" ")[0] or rest)
        exchanges.append(exchange)
        return exchange

    def _add(self, key: str, n: int) -> None:
        with self._lock:
            self._counts[key] += n

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            accepted = time.monotonic()
            try:
                server = socket.create_connection(self._upstream, timeout=30)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._add("connections", 1)
            _Connection(self, client, server, accepted).start()


class _Connection:
    """One proxied TCP connection: two shaped directions; the sockets close when both end."""

    def __init__(
        self, shaper: Shaper, client: socket.socket, server: socket.socket, accepted: float
    ) -> None:
        self._shaper = shaper
        self._sockets = (client, server)
        self._accepted = accepted
        self._left = 2
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._pending: collections.deque[Exchange] = collections.deque()
        self._requests = RequestCounter(self._on_request)
        self._responses = ResponseCounter(self._pending)

    def _on_request(self, line: bytes) -> None:
        exchange = self._shaper._trace_request(line)
        if exchange is not None:
            self._pending.append(exchange)

    def start(self) -> None:
        client, server = self._sockets
        self._direction(client, server, "bytes_up", handshake=True)
        self._direction(server, client, "bytes_down", handshake=False)

    def _direction(
        self, source: socket.socket, sink: socket.socket, key: str, *, handshake: bool
    ) -> None:
        chunks: queue.Queue[tuple[float, bytes]] = queue.Queue(maxsize=QUEUE_CHUNKS)
        bucket = TokenBucket(self._shaper.profile.conn_bytes_per_s)
        threading.Thread(
            target=self._read, args=(source, chunks, key == "bytes_up"), daemon=True
        ).start()
        threading.Thread(
            target=self._write, args=(sink, chunks, bucket, key, handshake), daemon=True
        ).start()

    def _read(self, source: socket.socket, chunks: queue.Queue[Any], count: bool) -> None:
        while True:
            try:
                data = source.recv(CHUNK_BYTES)
            except OSError:
                data = _EOF
            if data and count:
                self._shaper._add("requests", self._requests.feed(data))
            elif data and self._shaper.exchanges is not None:
                self._responses.feed(data)
            item = (time.monotonic(), data)
            while True:
                try:
                    chunks.put(item, timeout=0.5)
                    break
                except queue.Full:
                    if self._done.is_set():  # the writer has gone: nobody drains the queue
                        return
            if not data:
                return

    def _write(
        self,
        sink: socket.socket,
        chunks: queue.Queue[Any],
        bucket: TokenBucket,
        key: str,
        handshake: bool,
    ) -> None:
        latency = self._shaper.profile.latency_s
        # the client's first bytes wait for the handshake's round trip as well
        charged = handshake and self._shaper.profile.handshake
        earliest = self._accepted + 2 * latency if charged else 0.0
        try:
            while True:
                arrived, data = chunks.get()
                due = max(arrived, earliest) + latency
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                bucket.take(len(data))
                self._shaper._total.take(len(data))
                sink.sendall(data)
                self._shaper._add(key, len(data))
        except OSError:
            pass
        finally:
            self._finish()

    def _finish(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._done.set()
            for s in self._sockets:
                s.close()


_ANSWER_S = 120.0
"""The longest the proxies' process may take to start or answer (a spawned interpreter on a
busy machine can take tens of seconds): only a hang reaches it."""


class ShaperProcess:
    """:class:`Shaper` proxies in a process of their own, so their threads never hold the GIL
    of the process being measured (they would slow a Python client but not TensorStore's
    C++ I/O).

    The same interface: ``endpoint``, ``profile``, :meth:`counts`, a context manager.
    ``copies`` proxies (each in front of ``upstream``, each with its own endpoint in
    ``endpoints``) tell apart the requests of as many clients, e.g. one per JAX process;
    with ``record`` each keeps its :class:`Exchange` list (:meth:`exchanges`).
    """

    def __init__(
        self, upstream: str, profile: Profile = BARE, *, copies: int = 1, record: bool = False
    ) -> None:
        import multiprocessing

        if copies < 1:
            raise ValueError(f"copies must be >= 1, got {copies}")
        self.profile = profile
        ctx = multiprocessing.get_context("spawn")  # never fork a process running jax threads
        self._pipe, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve_shaper, args=(child, upstream, profile, copies, record), daemon=True
        )
        self._process.start()
        if not self._pipe.poll(_ANSWER_S):
            self._process.kill()
            raise RuntimeError(f"the shaping proxy's process did not start within {_ANSWER_S:g} s")
        reply = self._pipe.recv()
        if isinstance(reply, BaseException):
            raise reply
        self.endpoints: list[str] = list(reply)
        self.endpoint: str = self.endpoints[0]

    def __enter__(self) -> ShaperProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def counts(self, reset: bool = False, copy: int = 0) -> dict[str, int]:
        """As :meth:`Shaper.counts`, of proxy ``copy``."""
        return dict(self._ask("counts", reset, copy))

    def exchanges(self, copy: int = 0, reset: bool = False) -> list[Exchange]:
        """The exchanges proxy ``copy`` recorded (``record=True``) since the start or a reset."""
        return list(self._ask("exchanges", reset, copy))

    def _ask(self, command: str, reset: bool, copy: int) -> Any:
        self._pipe.send((command, reset, copy))
        if not self._pipe.poll(_ANSWER_S):
            raise RuntimeError(f"the shaping proxy's process did not answer within {_ANSWER_S:g} s")
        reply = self._pipe.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close(self) -> None:
        if self._process.is_alive():
            with contextlib.suppress(OSError):
                self._pipe.send(("close", False, 0))
            self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)


def _serve_shaper(pipe: Any, upstream: str, profile: Profile, copies: int, record: bool) -> None:
    with contextlib.ExitStack() as stack:
        try:
            shapers = [stack.enter_context(Shaper(upstream, profile)) for _ in range(copies)]
        except BaseException as e:  # the parent raises it
            pipe.send(e)
            return
        for shaper in shapers:
            shaper.exchanges = [] if record else None
        pipe.send([shaper.endpoint for shaper in shapers])
        while True:
            try:
                command, reset, copy = pipe.recv()
            except EOFError:
                return
            if command == "close":
                return
            if not 0 <= copy < copies:
                pipe.send(IndexError(f"no proxy {copy}: there are {copies}"))
                continue
            shaper = shapers[copy]
            if command == "counts":
                pipe.send(shaper.counts(reset=reset))
            else:
                recorded = list(shaper.exchanges or [])
                if reset and shaper.exchanges is not None:
                    del shaper.exchanges[: len(recorded)]
                pipe.send(recorded)
