"""A local file as one S3 object, through a multipart upload streamed from the file.

``CreateMultipartUpload``, then one ``UploadPart`` per :func:`s3_part_bytes` of the
file (each body a :class:`~jaxckpt.storage._upload.FileSlice`, sent as botocore reads
it, with its ``Content-MD5`` so the store checks every part), then
``CompleteMultipartUpload``: the object appears whole or not at all. Each request
is retried as :class:`~jaxckpt.storage._s3create.S3Creates` retries its own
(throttling and transient failures, full jitter, until the deadline); a failure
aborts the upload (its parts are dropped). A process killed mid-upload cannot abort:
the next upload of the same key first aborts the unfinished uploads of that key
(one listing), so the stored parts of killed attempts do not pile up.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
from typing import Any

from jaxckpt.storage._s3create import S3Creates
from jaxckpt.storage._upload import FileSlice, Progress, s3_part_bytes

__all__ = ["multipart_upload"]

_log = logging.getLogger(__name__)


def multipart_upload(
    creates: S3Creates, name: str, path: str, budget: int, progress: Progress | None = None
) -> int:
    """Uploads the file ``path`` as the object ``name`` in parts of about ``budget``
    bytes (see :func:`s3_part_bytes`); returns the number of parts.

    Raises:
      botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError: a request
        failed for good (the caller names the object).
      OSError: the file cannot be read.
    """
    size = os.path.getsize(path)
    part = s3_part_bytes(size, budget)
    client, bucket = creates._get_client(), creates._bucket
    _abort_unfinished(creates, name)
    upload: dict[str, Any] = {"Bucket": bucket, "Key": name}
    started = creates._retrying(lambda: client.create_multipart_upload(**upload))
    upload["UploadId"] = started["UploadId"]
    parts: list[dict[str, Any]] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for number, offset in enumerate(range(0, max(size, 1), part), start=1):
            length = min(part, size - offset)
            md5 = base64.b64encode(FileSlice(fd, offset, length).digest()).decode()

            def send(
                number: int = number, offset: int = offset, length: int = length, md5: str = md5
            ) -> Any:
                body = FileSlice(fd, offset, length)  # a fresh one per attempt: from its start
                return client.upload_part(
                    **upload,
                    PartNumber=number,
                    Body=body,
                    ContentLength=length,
                    ContentMD5=md5,
                )

            sent = creates._retrying(send)
            parts.append({"ETag": sent["ETag"], "PartNumber": number})
            if progress is not None:
                progress(length)
        done = {"Parts": parts}
        creates._retrying(lambda: client.complete_multipart_upload(**upload, MultipartUpload=done))
    except BaseException:
        with contextlib.suppress(Exception):  # the parts are dropped; a lifecycle rule, else
            client.abort_multipart_upload(**upload)
        raise
    finally:
        os.close(fd)
    _log.debug(
        "uploaded %s (%d bytes) to s3://%s/%s in %d parts", path, size, bucket, name, len(parts)
    )
    return len(parts)


def _abort_unfinished(creates: S3Creates, name: str) -> None:
    """Aborts the unfinished multipart uploads of the key ``name`` (a killed attempt's)."""
    client, bucket = creates._get_client(), creates._bucket
    listed = creates._retrying(lambda: client.list_multipart_uploads(Bucket=bucket, Prefix=name))
    for upload in listed.get("Uploads", []):
        if upload.get("Key") != name:
            continue
        _log.info("aborting an unfinished upload of s3://%s/%s", bucket, name)
        with contextlib.suppress(Exception):  # gone already, or the next upload tries again
            client.abort_multipart_upload(Bucket=bucket, Key=name, UploadId=upload["UploadId"])
