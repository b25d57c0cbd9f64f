"""Create-only writes on S3 go out as one ``PutObject`` with ``If-None-Match: *``.

Against moto, behind the benchmark's shaping proxy (``benchkit.shaper``),
whose request log shows what went over the wire.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from benchkit import servers
from benchkit.shaper import Profile, Shaper
from creates import race_to_create

from jaxckpt.errors import StorageError
from jaxckpt.storage import PreconditionFailed, _object, _s3create, open_storage


@pytest.fixture
def far(s3_server: servers.Server) -> Iterator[Shaper]:
    """moto 20 ms away (10 ms each way), its requests logged."""
    with Shaper(s3_server.endpoint, Profile(name="20ms", latency_s=0.01, handshake=False)) as s:
        yield s


def _storage(far: Shaper, server: servers.Server) -> Any:
    root = f"s3://{server.bucket}/creates-{uuid.uuid4().hex[:8]}"
    storage = open_storage(root, endpoint=far.endpoint)
    assert isinstance(storage, _object.ObjectStorage)
    storage.write("warm", b"")  # the client and its connection exist before the log starts
    return storage


def _methods(far: Shaper) -> list[str]:
    assert far.trace is not None
    return [line.split()[0] for _, line in far.trace]


def test_a_create_is_one_conditional_put_and_a_second_is_refused(
    far: Shaper, s3_server: servers.Server
) -> None:
    storage = _storage(far, s3_server)
    assert storage.conditional_writes_enforced
    far.trace = []
    storage.write("commits/1.json", b"first", exclusive=True)
    assert _methods(far) == ["PUT"]  # no HEAD before it: one round trip
    far.trace = []
    with pytest.raises(PreconditionFailed, match=r"commits/1\.json"):
        storage.write("commits/1.json", b"second", exclusive=True)
    assert _methods(far) == ["PUT", "GET"]  # refused, then read: is it our own lost write?
    assert storage.read("commits/1.json") == b"first"
    storage.write("commits/1.json", b"first", exclusive=True)  # our own bytes: a retry landed


def test_racing_creators_on_a_far_store_have_exactly_one_winner(
    far: Shaper, s3_server: servers.Server
) -> None:
    """Four writers at 20 ms race for each key: the store lets exactly one create it."""
    first = _storage(far, s3_server)
    hosts = [first] + [open_storage(first.uri, endpoint=far.endpoint) for _ in range(3)]
    for host in hosts:
        host.write("warm", b"")
    for round_ in range(4):
        key = f"race/{round_}"
        won = race_to_create(hosts, key)
        assert len(won) == 1, f"round {round_}: winners {won}"
        assert first.read(key) == won[0]


def test_a_store_that_refuses_the_condition_header_falls_back_to_tensorstore(
    far: Shaper,
    s3_server: servers.Server,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import botocore.exceptions

    def refuse(self: Any, name: str, data: bytes) -> str:
        error = {"Code": "NotImplemented", "Message": "If-None-Match is not supported"}
        raise botocore.exceptions.ClientError(
            {"Error": error, "ResponseMetadata": {"HTTPStatusCode": 501}}, "PutObject"
        )

    monkeypatch.setattr(_s3create.S3Creates, "create", refuse)
    storage = _storage(far, s3_server)
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        storage.write("commits/2.json", b"first", exclusive=True)
    assert "refuses If-None-Match writes" in caplog.text
    far.trace = []
    with pytest.raises(PreconditionFailed):
        storage.write("commits/2.json", b"second", exclusive=True)
    assert _methods(far)[:2] == ["HEAD", "GET"]  # TensorStore's check, then our read
    assert storage.read("commits/2.json") == b"first"


def test_a_failed_create_names_the_key(s3_server: servers.Server) -> None:
    missing = f"s3://jaxckpt-missing-{uuid.uuid4().hex[:8]}/run"
    storage = open_storage(missing, max_retries=1, initial_delay_s=0.05, max_delay_s=0.1)
    with pytest.raises(StorageError, match=f"cannot write {missing}/"):
        storage.write("commits/3.json", b"x", exclusive=True)
