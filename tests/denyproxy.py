"""A loopback HTTP proxy that answers ``403 Forbidden`` to the requests a rule matches.

One process of a multi-process test is pointed at it (``AWS_ENDPOINT_URL_S3``)
to lose its access to part of a root, as a host whose credentials or bucket
policy changed does; every other request is forwarded to the upstream server
unchanged (the ``Host`` header too, so S3 signatures stay valid). Stdlib
only; runs in threads of the calling process; forwards to 127.0.0.1 only.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import urllib.parse
from typing import Any

_HOP = {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade", "expect"}


class DenyProxy:
    """Forwards to ``upstream`` (``http://127.0.0.1:PORT``), denying matching requests.

    Args:
      upstream: the server's endpoint.
      deny: ``(method, path fragment)`` pairs; a request whose method is one of
        them and whose unquoted path contains its fragment gets a 403.
    """

    def __init__(self, upstream: str, deny: tuple[tuple[str, str], ...]) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.hostname not in ("127.0.0.1", "localhost"):
            raise ValueError(f"upstream must be on loopback, got {upstream}")
        self.upstream = (parsed.hostname, parsed.port or 80)
        self.deny = deny
        self.denied = 0
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def denies(self, method: str, path: str) -> bool:
        return any(method == m and fragment in path for m, fragment in self.deny)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        proxy: DenyProxy = self.server.proxy  # type: ignore[attr-defined]
        body = self._body()
        if proxy.denies(self.command, urllib.parse.unquote(self.path)):
            proxy.denied += 1
            payload = b"<Error><Code>AccessDenied</Code><Message>denied</Message></Error>"
            self.send_response_only(403, "Forbidden")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload if self.command != "HEAD" else b"")
            return
        conn = http.client.HTTPConnection(*proxy.upstream, timeout=120)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP and name.lower() != "content-length":
                    conn.putheader(name, value)
            if body or self.command in ("PUT", "POST", "PATCH"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        self.send_response_only(response.status, response.reason)
        headers = response.getheaders()
        for name, value in headers:
            if name.lower() not in _HOP and name.lower() != "content-length":
                self.send_header(name, value)
        if self.command == "HEAD" or response.status in (204, 304):
            length = dict((k.lower(), v) for k, v in headers).get("content-length")
            if length is not None:
                self.send_header("Content-Length", length)
            self.end_headers()
            return
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_GET

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts: list[bytes] = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return b"".join(parts)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))
