"""A loopback HTTP proxy that answers ``403 Forbidden`` to the requests a rule matches.

One process of a multi-process test is pointed at it (``AWS_ENDPOINT_URL_S3``)
to lose its access to part of a root, as a host whose credentials or bucket
policy changed does; every other request is forwarded to the upstream server
unchanged. It is ``scripts/faultproxy.py``'s proxy with ``deny`` rules only
(the forwarding is shared with the fault and throttling tests and with
``bench.py denied``).
"""

from __future__ import annotations

from faultproxy import FaultProxy


class DenyProxy(FaultProxy):
    """Forwards to ``upstream`` (``http://127.0.0.1:PORT``), denying matching requests.

    Args:
      upstream: the server's endpoint.
      deny: ``(method, path fragment)`` pairs; a request whose method is one of
        them and whose unquoted path contains its fragment gets a 403.
    """

    def __init__(self, upstream: str, deny: tuple[tuple[str, str], ...]) -> None:
        super().__init__(upstream)
        self.deny(*deny)

    @property
    def denied(self) -> int:
        """How many requests were answered 403."""
        return self.snapshot()["deny"]
