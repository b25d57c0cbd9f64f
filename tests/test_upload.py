"""Local files stored in object stores in bounded parts (``jaxckpt.storage.upload_file``):
S3 multipart and GCS resumable uploads on the loopback servers, streamed from the file."""

from __future__ import annotations

import tracemalloc

import faultproxy
import numpy as np
import pytest
from benchkit import servers

from jaxckpt.errors import StorageError
from jaxckpt.storage import LocalStorage, open_storage, upload_file

MIB = 1 << 20


def _file(tmp_path, nbytes: int) -> tuple[str, bytes]:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    path = tmp_path / "blob"
    path.write_bytes(data)
    return str(path), data


def test_a_file_larger_than_the_budget_goes_up_in_parts_streamed_from_disk(object_root, tmp_path):
    storage = open_storage(object_root)
    path, data = _file(tmp_path, 11 * MIB + 12345)
    storage.write("warm", b"", exclusive=True)  # the clients made (botocore: for S3) first
    told: list[int] = []
    tracemalloc.start()
    try:
        parts = upload_file(storage, "w/blob", path, part_bytes=MIB, progress=told.append)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert storage.read("w/blob") == data
    assert sum(told) == len(data)
    # S3 parts are 5 MiB at least (3 parts), GCS chunks the 1 MiB budget (12 chunks).
    assert parts == (3 if object_root.startswith("s3://") else 12)
    assert peak < 3 * MIB, peak  # never a part (5 MiB on S3), let alone the file, in memory


@pytest.mark.parametrize(
    ("kind", "part", "status"),
    [("s3", "partNumber=2", "partNumber=3"), ("gcs", "upload_id", "upload_id")],
)
def test_a_part_lost_in_flight_and_a_503_are_retried(request, tmp_path, kind, part, status):
    """A part the store got but whose answer was lost (a reset connection), then a 503:
    S3 sends the part again; GCS asks the session what it holds and goes on from there."""
    server = request.getfixturevalue(f"{kind}_server")
    proxy = faultproxy.FaultProxy(server.endpoint)
    try:
        proxy.inject("lost", method="PUT", path_contains=part)
        proxy.inject("error", method="PUT", path_contains=status)
        scheme = "s3" if kind == "s3" else "gs"
        storage = open_storage(
            f"{scheme}://{server.bucket}/{tmp_path.name}",
            endpoint=proxy.endpoint,
            initial_delay_s=0.01,
            max_delay_s=0.05,
        )
        path, data = _file(tmp_path, 12 * MIB)
        upload_file(storage, "blob", path, part_bytes=MIB)
        assert proxy.snapshot()["lost"] == 1 and proxy.snapshot()["error"] == 1
    finally:
        proxy.close()
    assert open_storage(f"{scheme}://{server.bucket}/{tmp_path.name}").read("blob") == data


def test_s3_object_is_a_multipart_one(s3_server, tmp_path):
    root = f"s3://{s3_server.bucket}/{tmp_path.name}"
    path, _ = _file(tmp_path, 6 * MIB)
    upload_file(open_storage(root), "blob", path, part_bytes=MIB)
    head = servers.s3_client().head_object(Bucket=s3_server.bucket, Key=f"{tmp_path.name}/blob")
    assert head["ETag"].strip('"').endswith("-2") and head["ContentLength"] == 6 * MIB


def test_a_file_within_the_budget_is_one_write(tmp_path):
    path, data = _file(tmp_path, 1000)
    storage = LocalStorage(str(tmp_path / "root"))
    assert upload_file(storage, "a/b", path, part_bytes=1000) == 1
    assert storage.read("a/b") == data


def test_a_root_without_parts_refuses_a_file_above_the_budget(tmp_path):
    path, _ = _file(tmp_path, 1001)
    storage = LocalStorage(str(tmp_path / "root"))
    with pytest.raises(StorageError, match=r"a/b: it is larger than the memory budget \(1000"):
        upload_file(storage, "a/b", path, part_bytes=1000)
    assert storage.read("a/b") is None


def test_the_next_upload_of_a_key_aborts_a_killed_attempts_parts(s3_server, tmp_path):
    client, key = servers.s3_client(), f"{tmp_path.name}/blob"
    killed = client.create_multipart_upload(Bucket=s3_server.bucket, Key=key)["UploadId"]
    client.upload_part(
        Bucket=s3_server.bucket, Key=key, UploadId=killed, PartNumber=1, Body=b"x" * MIB
    )
    path, data = _file(tmp_path, 6 * MIB)
    upload_file(
        open_storage(f"s3://{s3_server.bucket}/{tmp_path.name}"), "blob", path, part_bytes=MIB
    )
    left = client.list_multipart_uploads(Bucket=s3_server.bucket, Prefix=key).get("Uploads", [])
    assert left == []
    got = client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read()
    assert got == data


def test_gcs_refuses_an_upload_whose_bytes_do_not_match_its_md5(gcs_server, tmp_path, monkeypatch):
    """A resumable upload carries the file's MD5: bytes that changed on the way (here: an
    MD5 that does not match) are refused when the object would be finalised, not stored.
    (Each S3 part carries its Content-MD5 the same way; moto does not check it.)"""
    monkeypatch.setattr(
        "jaxckpt.storage._gcsupload._file_md5", lambda path, size: "AAAAAAAAAAAAAAAAAAAAAA=="
    )
    storage = open_storage(f"gs://{gcs_server.bucket}/{tmp_path.name}")
    path, _ = _file(tmp_path, 3 * MIB)
    with pytest.raises(
        StorageError,
        match=r"cannot write gs://.*/blob: HTTP 400: Provided MD5 hash .* doesn't match",
    ):
        upload_file(storage, "blob", path, part_bytes=MIB)
    assert storage.read("blob") is None
