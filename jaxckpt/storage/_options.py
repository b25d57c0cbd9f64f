"""The options of an object-store root (``gs://``, ``s3://``), and a restore's memory budget.

Imports nothing heavy (no TensorStore), so the options are public API that
``import jaxckpt`` and ``jaxckpt ls`` can offer without opening a store.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

from jaxckpt.storage._retry import Backoff
from jaxckpt.storage._s3address import ADDRESSING_STYLES

DEFAULT_RETRY_DEADLINE_S = 120.0
"""``retry_deadline_s`` of a root opened without a manager (a manager's follows its
``save_timeout_s``): a CLI command against a dead endpoint fails within minutes."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectStoreOptions:
    """Options of a ``gs://`` or ``s3://`` root.

    Attributes:
      endpoint: base URL of the service, e.g. ``http://127.0.0.1:9000``. None
        uses ``AWS_ENDPOINT_URL_S3`` then ``AWS_ENDPOINT_URL`` (S3) or
        ``STORAGE_EMULATOR_HOST`` (GCS), else the public service.
      region: S3 region; None uses ``AWS_REGION``, ``AWS_DEFAULT_REGION``, then
        ``us-east-1``. Not valid for GCS.
      retry_deadline_s: how long one request is retried while the store
        throttles (S3 ``503 SlowDown``, ``429``) or fails transiently (5xx,
        timeouts, dropped connections), counted from its first attempt: a
        store that throttles for a minute slows a save down instead of failing
        it. None: the manager's ``save_timeout_s``
        (``CheckpointOptions.storage_kwargs``), or :data:`DEFAULT_RETRY_DEADLINE_S`
        for a root opened on its own (the CLI). Every request path retries
        this way (:mod:`jaxckpt.storage._retry`).
      max_retries: the most retries of one request; None: as many as
        ``retry_deadline_s`` allows.
      initial_delay_s: the window of the first retry's delay: retry ``n`` waits
        a uniform random time below ``min(max_delay_s, initial_delay_s * 2**n)``
        (full jitter), so throttled clients do not come back in waves.
      max_delay_s: the largest window.
      request_concurrency: concurrent HTTP requests per TensorStore context.
      timeout_s: the longest one request may go without progress, and the
        deadline of one metadata operation (read, write, list, delete of a
        prefix): a connect or a transfer that moves nothing for this long
        fails and is retried (TensorStore's libcurl stall limits, set
        process-wide when the first root is opened, and the socket timeout
        of direct reads), so a store that stalls in
        the middle of a save fails it after about ``(max_retries + 1) *
        timeout_s`` plus the backoff, not after ``save_timeout_s``. None
        waits forever.
      read_part_bytes: the largest ranged GET of a restore; a larger chunk
        object is fetched by several requests at once. None: a fifth of the
        budget, at most 16 MiB (so two or more requests are in flight).
      read_ahead_bytes: the restore's memory budget on this store, beyond the
        restored arrays themselves: the responses in flight at once, plus
        three parts for the Python copy of the one being placed into its
        array and for what malloc keeps of freed parts (at least one part in
        flight). Lower it on hosts with little RAM; raise it on high-latency
        links (throughput ≈ two fifths of read_ahead_bytes / round-trip
        time). None: a tenth of each restore's bytes, from 16 MiB to 1 GiB
        (:func:`restore_budget`).
        ``CheckpointOptions.restore_memory_bytes`` sets it for a manager.
        Applies to reads through TensorStore (below).
      direct_reads: a restore reads chunk objects over jaxckpt's own HTTP
        connections, straight into the restored arrays (``jaxckpt.storage._http``):
        no response copies, so no budget is needed, and parts of
        ``read_part_bytes`` (default 64 MiB) are in flight on every reader
        thread. S3 requests are signed by botocore (``pip install
        jaxckpt[s3]``), GCS requests carry google-auth credentials
        (``jaxckpt[gcs]``). Without those libraries, with an HTTP proxy in
        the environment, with False here, or after three failed direct
        reads in a row, chunks are read through TensorStore under
        ``read_ahead_bytes``; a direct read that fails is read again there.
      addressing_style: how S3 requests name the bucket, for every client
        (TensorStore, botocore, direct reads): ``"path"``
        (``ENDPOINT/BUCKET/KEY``), ``"virtual"`` (``BUCKET.HOST/KEY``, which
        stores such as CoreWeave's require), or ``"auto"``: the environment's
        ``JAXCKPT_S3_ADDRESSING_STYLE`` if set, else path-style with a custom
        endpoint and, on AWS, virtual-hosted when the bucket name has no dots.
        Not valid for GCS.
    """

    endpoint: str | None = None
    region: str | None = None
    retry_deadline_s: float | None = None
    max_retries: int | None = None
    initial_delay_s: float = 0.5
    max_delay_s: float = 8.0
    request_concurrency: int = 32
    timeout_s: float | None = 300.0
    read_part_bytes: int | None = None
    read_ahead_bytes: int | None = None
    direct_reads: bool = True
    addressing_style: Literal["auto", "path", "virtual"] = "auto"

    def __post_init__(self) -> None:
        if self.addressing_style not in ADDRESSING_STYLES:
            raise ValueError(
                f"addressing_style must be one of {', '.join(ADDRESSING_STYLES)}, "
                f"got {self.addressing_style!r}"
            )
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"endpoint must start with http:// or https://, got {self.endpoint!r}")
        if self.region is not None and not self.region:
            raise ValueError("region must be a non-empty string or None")
        for name in ("max_retries", "request_concurrency", "read_part_bytes", "read_ahead_bytes"):
            value = getattr(self, name)
            if value is None and name != "request_concurrency":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.direct_reads, bool):
            raise ValueError(f"direct_reads must be True or False, got {self.direct_reads!r}")
        if not 0.001 <= self.initial_delay_s <= self.max_delay_s < math.inf:
            raise ValueError(
                "need 0.001 <= initial_delay_s <= max_delay_s, got "
                f"{self.initial_delay_s!r} and {self.max_delay_s!r}"
            )
        for name in ("timeout_s", "retry_deadline_s"):  # None, not infinity, means no bound
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not 0 < value < math.inf):
                raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")

    @classmethod
    def from_mapping(
        cls, options: Mapping[str, Any] | ObjectStoreOptions | None
    ) -> ObjectStoreOptions:
        """Options from today's untyped ``storage_options`` mapping (or the options).

        >>> ObjectStoreOptions.from_mapping({"max_retries": 2}).max_retries
        2

        Raises:
          TypeError: a key that is not a field.
          ValueError: an invalid value.
        """
        if options is None:
            return cls()
        if isinstance(options, ObjectStoreOptions):
            return options
        return cls(**dict(options))

    def check_scheme(self, scheme: str) -> None:
        """Raises ValueError if an option does not apply to ``scheme`` ("gs" or "s3")."""
        if scheme == "gs" and self.region is not None:
            raise ValueError("region applies to s3:// roots only")
        if scheme == "gs" and self.addressing_style != "auto":
            raise ValueError("addressing_style applies to s3:// roots only")

    def replace(self, **changes: Any) -> ObjectStoreOptions:
        """A copy with ``changes`` applied (and checked)."""
        return dataclasses.replace(self, **changes)

    def backoff(self) -> Backoff:
        """The retry schedule of every request to this root."""
        deadline = self.retry_deadline_s
        return Backoff(
            initial_s=self.initial_delay_s,
            max_s=self.max_delay_s,
            deadline_s=DEFAULT_RETRY_DEADLINE_S if deadline is None else deadline,
            max_retries=self.max_retries,
        )

    def budget(self, restore_bytes: int) -> tuple[int, int]:
        """``(part_bytes, ahead_bytes)`` of a restore of ``restore_bytes``."""
        ahead = self.read_ahead_bytes
        if ahead is None:
            ahead = restore_budget(restore_bytes)
        part = self.read_part_bytes
        return (max(1, min(MAX_READ_PART_BYTES, ahead // 5)) if part is None else part), ahead


MAX_SPAN_BYTES = 32 << 20
"""A restore fetches adjacent chunks of one pack object by one ranged read of at most this
(``jaxckpt.formats._chunkread``; here so that ``jaxckpt plan`` can read it without jax)."""
MIN_SPAN_BYTES = 1 << 20
"""... and does not make spans shorter than this to put more reads in flight."""


def span_limit(packed_bytes: float, reads_in_flight: int) -> int:
    """The longest ranged read of a packed restore of ``packed_bytes`` with
    ``reads_in_flight`` at once: an eighth over the even share (so a pack's alignment
    padding leaves no one-chunk tail), within ``MIN_SPAN_BYTES`` and ``MAX_SPAN_BYTES``.

    >>> span_limit(64 << 20, 16) >> 10, span_limit(0, 16) >> 20, span_limit(1 << 40, 16) >> 20
    (4608, 1, 32)
    """
    share = math.ceil(packed_bytes / max(1, reads_in_flight)) * 9 // 8
    return int(min(MAX_SPAN_BYTES, max(MIN_SPAN_BYTES, share)))


DIRECT_PART_BYTES = 64 << 20
"""The default part of a direct ranged GET (no copy, so only the wire bounds it)."""
MAX_READ_PART_BYTES = 16 << 20
"""The default part of a ranged GET is at most this (a fifth of the budget below it)."""
MIN_RESTORE_BUDGET = 16 << 20
MAX_RESTORE_BUDGET = 1 << 30


def restore_budget(restore_bytes: int) -> int:
    """The default memory budget of a restore: a tenth of its bytes, 16 MiB to 1 GiB.

    Two fifths of it are in flight, so a restore peaks at about 1.08x the
    state (from 160 MiB of state up: the issue-14 benchmark), and a large
    restore keeps many requests in flight on a high-latency link.

    >>> restore_budget(256 << 20) >> 20
    25
    >>> restore_budget(0) >> 20, restore_budget(1 << 40) >> 20
    (16, 1024)
    """
    return min(MAX_RESTORE_BUDGET, max(MIN_RESTORE_BUDGET, restore_bytes // 10))
