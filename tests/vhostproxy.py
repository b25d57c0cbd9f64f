"""A strict virtual-hosted S3 front for moto: an HTTP proxy that refuses path-style requests.

Stores such as CoreWeave's accept only virtual-hosted requests
(``http://BUCKET.DOMAIN/key``). Without DNS for ``BUCKET.DOMAIN`` the test's clients
reach this server as their HTTP proxy (``http_proxy``): each request line then
carries the absolute URL (``GET http://BUCKET.s3.test:80/key HTTP/1.1``), so the
proxy sees the host name without anything resolving it. A request whose host is
``BUCKET.DOMAIN`` is forwarded to moto path-style (``/BUCKET/key``, moto checks no
signatures); anything else (path-style ``http://DOMAIN/BUCKET/key``, an
origin-form request, another host, ``CONNECT``) is answered ``403`` with an S3
error body and counted. It forwards to ``127.0.0.1`` only. Stdlib only; runs in
threads of the calling process.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import socket
import threading
import urllib.parse
from collections import Counter
from typing import Any

_REFUSED = (
    b"<?xml version='1.0' encoding='UTF-8'?>\n<Error><Code>AccessDenied</Code><Message>"
    b"path-style requests are refused: put the bucket in the host name</Message></Error>"
)
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "expect", "content-length", "host"}
)  # fmt: skip


class VirtualHostProxy:
    """Serves bucket ``bucket`` of moto at ``upstream`` as ``http://BUCKET.DOMAIN``.

    Args:
      upstream: moto's endpoint, ``http://127.0.0.1:PORT``.
      bucket: the only bucket served.
      domain: the fake service name (never resolved: clients send absolute URLs).

    Attributes:
      counts: ``virtual`` (forwarded) and ``refused`` requests, and ``refused <agent>``
        / ``virtual <agent>`` per client (``botocore``, ``tensorstore``, ``python``).
    """

    def __init__(self, upstream: str, bucket: str, domain: str = "s3.test") -> None:
        url = urllib.parse.urlsplit(upstream)
        if url.scheme != "http" or url.hostname != "127.0.0.1" or url.port is None:
            raise ValueError(f"forwards to http://127.0.0.1:PORT only, got {upstream!r}")
        self.upstream_port = url.port
        self.bucket = bucket
        self.domain = domain
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.front = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def proxy_url(self) -> str:
        """What the clients' ``http_proxy`` is set to."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def endpoint(self) -> str:
        """The store's endpoint as its users name it (path-style base)."""
        return f"http://{self.domain}"

    def count(self, outcome: str, agent: str) -> None:
        with self.lock:
            self.counts[outcome] += 1
            self.counts[f"{outcome} {agent}"] += 1

    def close(self) -> None:
        """Stops serving, and ends the kept-alive connections (a client that kept one must
        not reach a later test's front through this one)."""
        self._server.shutdown()
        self._server.server_close()
        with self.lock:
            for conn in self.connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=10)


def _agent(headers: Any) -> str:
    text = headers.get("User-Agent", "").lower()
    if "botocore" in text or "boto3" in text:
        return "botocore"
    return "tensorstore" if ("curl" in text or "tensorstore" in text) else "python"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        front: VirtualHostProxy = self.server.front  # type: ignore[attr-defined]
        with front.lock:
            front.connections.add(self.connection)

    def finish(self) -> None:
        front: VirtualHostProxy = self.server.front  # type: ignore[attr-defined]
        with front.lock:
            front.connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        front: VirtualHostProxy = self.server.front  # type: ignore[attr-defined]
        body = self._body()
        url = urllib.parse.urlsplit(self.path)
        agent = _agent(self.headers)
        if url.scheme != "http" or url.hostname != f"{front.bucket}.{front.domain}":
            front.count("refused", agent)
            self._answer(403, "Forbidden", [("Content-Type", "application/xml")], _REFUSED)
            return
        front.count("virtual", agent)
        target = f"/{front.bucket}{url.path or '/'}" + (f"?{url.query}" if url.query else "")
        conn = http.client.HTTPConnection("127.0.0.1", front.upstream_port, timeout=60)
        try:
            conn.putrequest(self.command, target, skip_host=True, skip_accept_encoding=True)
            conn.putheader("Host", f"127.0.0.1:{front.upstream_port}")
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    conn.putheader(name, value)
            if body or self.command in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            response = conn.getresponse()
            data = response.read()
            headers = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
            length = response.getheader("Content-Length")
        finally:
            conn.close()
        self._answer(response.status, response.reason, headers, data, length)

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def do_CONNECT(self) -> None:
        front: VirtualHostProxy = self.server.front  # type: ignore[attr-defined]
        front.count("refused", "connect")
        self._answer(405, "Method Not Allowed", [], b"")
        self.close_connection = True

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts: list[bytes] = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(parts)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _answer(
        self,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        data: bytes,
        head_length: str | None = None,
    ) -> None:
        self.send_response_only(status, reason)
        for name, value in headers:
            self.send_header(name, value)
        if self.command == "HEAD":
            self.send_header("Content-Length", head_length or "0")
            self.end_headers()
            return
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
