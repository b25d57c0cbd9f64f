"""TensorStore's failures as :class:`jaxckpt.StorageError` (naming the object, with an
errno), and two encodings of TensorStore's: durations and the "absent" generation.

TensorStore reports a failed request as ``ValueError("CODE: text [name='value']...")``
with the HTTP response body and headers as payloads; the error here keeps the
status text and the HTTP status, names the object and endpoint, and maps the
absl status code to an errno.
"""

from __future__ import annotations

import errno
import functools
import re

import tensorstore as ts

from jaxckpt.errors import StorageError

_MAX_DETAIL = 400
_PAYLOAD = re.compile(r"\s*\[[A-Za-z0-9_.-]+='.*?'\]", re.DOTALL)
_HTTP_STATUS = re.compile(r"\[http_response_code='(\d+)'\]")
_EXHAUSTED = re.compile(r"All \d+ retry attempts failed: ")

# absl status code names (as TensorStore prefixes its messages) -> errno.
_STATUS_ERRNO = {
    "NOT_FOUND": errno.ENOENT,
    "PERMISSION_DENIED": errno.EACCES,
    "UNAUTHENTICATED": errno.EACCES,
    "INVALID_ARGUMENT": errno.EINVAL,
    "FAILED_PRECONDITION": errno.EIO,
    "DEADLINE_EXCEEDED": errno.ETIMEDOUT,
    "UNAVAILABLE": errno.EHOSTUNREACH,
    "ABORTED": errno.EIO,
    "RESOURCE_EXHAUSTED": errno.EDQUOT,
}


def storage_error(
    action: str,
    where: str,
    exc: BaseException,
    *,
    bucket: str,
    endpoint: str | None,
    timeout_s: float | None,
    note: str = "",
) -> StorageError:
    """The error of ``action`` ("read", "write", ...) on the object ``where`` (its URI).

    Args:
      exc: TensorStore's (or botocore's, or a direct read's) failure; a
        ``TimeoutError`` means no answer within ``timeout_s``.
      note: appended to the detail, e.g. how long the request was retried.
    """
    if isinstance(exc, TimeoutError):
        detail = f"no answer within {timeout_s} s{note}"
        return StorageError(errno.ETIMEDOUT, f"cannot {action} {where}: {detail}")
    # TensorStore appends the HTTP response body and headers as [name='value']
    # payloads (S3 XML, GCS JSON): drop them, the status text says what failed.
    text = "".join([str(exc), *getattr(exc, "__notes__", ())])
    status = _HTTP_STATUS.search(text)
    detail = _EXHAUSTED.sub("", _PAYLOAD.sub("", text)).strip()
    if len(detail) > _MAX_DETAIL:
        detail = detail[:_MAX_DETAIL] + " …"
    if status:
        detail += f" (HTTP {status.group(1)})"
    detail += note
    code = detail.split(":", 1)[0]
    # A missing key is not an error for TensorStore, so NOT_FOUND means the bucket.
    if "NoSuchBucket" in detail or code == "NOT_FOUND":
        detail = f"bucket {bucket!r} does not exist or is not accessible ({detail})"
    if endpoint:
        detail += f" [endpoint {endpoint}]"
    # TensorStore drops the "INVALID_ARGUMENT: " prefix (bad bucket names, specs).
    default = errno.EINVAL if action == "open" else errno.EIO
    return StorageError(_STATUS_ERRNO.get(code, default), f"cannot {action} {where}: {detail}")


@functools.cache
def no_value_generation() -> bytes:
    """TensorStore's encoding of "the key does not exist" as a generation.

    The byte string is internal to TensorStore and changed between releases
    (``b"\\x05"`` before 0.1.8x, ``b"\\x02"`` in 0.1.86), so it is read from the
    in-memory driver, which reports exactly this generation for missing keys.
    """
    store = ts.KvStore.open({"driver": "memory"}).result()
    return store.read("missing").result().stamp.generation


def duration(seconds: float) -> str:
    return f"{round(seconds * 1e6)}us"
