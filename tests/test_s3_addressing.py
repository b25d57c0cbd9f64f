"""``ObjectStoreOptions.addressing_style``: every S3 client names the bucket the same way.

A strict front (``tests/vhostproxy.py``) serves moto's bucket only virtual-hosted, as
CoreWeave's object storage does, and refuses path-style requests. The clients reach it
as their HTTP proxy (``http_proxy``), so ``BUCKET.s3.test`` is never resolved: the front
sees each absolute URL, checks the host name and forwards to moto on 127.0.0.1.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
from benchkit import servers
from vhostproxy import VirtualHostProxy

import jaxckpt
from jaxckpt.storage import ObjectStoreOptions, _s3create, open_storage
from jaxckpt.storage._s3address import ADDRESSING_ENV, S3Address


def test_the_option_is_checked() -> None:
    with pytest.raises(ValueError, match="'virtul'"):
        ObjectStoreOptions(addressing_style="virtul")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="s3:// roots only"):
        open_storage("gs://bucket/run", addressing_style="virtual")
    with pytest.raises(jaxckpt.StorageError, match=r"127\.0\.0\.1 cannot carry a bucket name"):
        open_storage(
            "s3://bucket/run", endpoint="http://127.0.0.1:9000", addressing_style="virtual"
        )


def test_the_environment_sets_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADDRESSING_ENV, "virtual")
    storage = open_storage("s3://bucket/run", endpoint="https://cwobject.com")
    spec = storage.kvstore_spec("steps/")  # type: ignore[attr-defined]
    assert (spec["bucket"], spec["endpoint"]) == ("", "https://bucket.cwobject.com")
    path = open_storage("s3://bucket/run", endpoint="https://x.com", addressing_style="path")
    assert path.kvstore_spec("")["endpoint"] == "https://x.com"  # type: ignore[attr-defined]
    monkeypatch.setenv(ADDRESSING_ENV, "hosted")
    with pytest.raises(jaxckpt.StorageError, match=r"s3://bucket/run.*'hosted'"):
        open_storage("s3://bucket/run")


AWS = "https://s3.eu-west-1.amazonaws.com"
CW = "https://cwobject.com"


@pytest.mark.parametrize(
    ("bucket", "endpoint", "style", "base", "prefix", "ts_bucket", "ts_endpoint", "boto"),
    [
        # auto: what every client did before the option
        ("b-1", None, "auto", "https://b-1.s3.eu-west-1.amazonaws.com", "/", "b-1", None, None),
        ("b.1", None, "auto", AWS, "/b.1/", "b.1", None, None),
        ("b-1", CW, "auto", CW, "/b-1/", "b-1", CW, "path"),
        ("b-1", None, "path", AWS, "/b-1/", "b-1", AWS, "path"),
        ("b-1", CW + "/", "path", CW, "/b-1/", "b-1", CW, "path"),
        ("b-1", CW, "virtual", "https://b-1.cwobject.com", "/", "", "https://b-1.cwobject.com",
         "virtual"),
        ("b.1", None, "virtual", "https://b.1.s3.eu-west-1.amazonaws.com", "/", "",
         "https://b.1.s3.eu-west-1.amazonaws.com", "virtual"),
        ("b-1", "http://h:81/s3", "virtual", "http://b-1.h:81", "/s3/", "", "http://b-1.h:81/s3",
         "virtual"),
    ],
)  # fmt: skip
def test_one_address_for_every_client(
    bucket: str,
    endpoint: str | None,
    style: str,
    base: str,
    prefix: str,
    ts_bucket: str,
    ts_endpoint: str | None,
    boto: str | None,
) -> None:
    a = S3Address(bucket=bucket, region="eu-west-1", endpoint=endpoint, style=style)  # type: ignore[arg-type]
    assert (a.base_url, a.object_prefix, a.botocore_style()) == (base, prefix, boto)
    members = a.tensorstore_members()
    assert (members["bucket"], members.get("endpoint")) == (ts_bucket, ts_endpoint)


@pytest.fixture
def strict(_moto: servers.Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[VirtualHostProxy]:
    """moto behind a virtual-hosted-only front, which every client uses as its HTTP proxy."""
    front = VirtualHostProxy(_moto.endpoint, _moto.bucket)
    for name in ("HTTP_PROXY", "http_proxy"):  # libcurl reads the lower-case one only
        monkeypatch.setenv(name, front.proxy_url)
    for name in ("NO_PROXY", "no_proxy"):  # moto itself, reached directly by the checks
        monkeypatch.setenv(name, "127.0.0.1,localhost")
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    # botocore's clients are shared per process and keep the proxy they were made with.
    monkeypatch.setattr(_s3create, "_clients", {})
    try:
        yield front
    finally:
        front.close()


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": np.arange(100.0)}


def _restored(root: str, options: ObjectStoreOptions, state: dict[str, np.ndarray]) -> None:
    reader = jaxckpt.CheckpointManager(root, storage_options=options, read_only=True)
    restored = reader.restore(target=state)
    for name, value in state.items():
        np.testing.assert_array_equal(np.asarray(restored[name]), value)


def _round_trip(root: str, front: VirtualHostProxy, style: str, layout: str) -> None:
    options = ObjectStoreOptions(endpoint=front.endpoint, addressing_style=style)  # type: ignore[arg-type]
    state = _state()
    with jaxckpt.CheckpointManager(root, storage_options=options, layout=layout) as mgr:
        assert mgr.save(1, state)
    _restored(root, options, state)


@pytest.mark.parametrize("layout", ["packed", "plain"])
def test_virtual_hosted_save_and_restore_through_a_strict_store(
    strict: VirtualHostProxy, layout: str
) -> None:
    root = f"s3://{strict.bucket}/vhost-{uuid.uuid4().hex[:8]}"
    _round_trip(root, strict, "virtual", layout)
    counts = Counter(strict.counts)
    assert counts["refused"] == 0, counts
    # TensorStore (listings, records; the arrays of a plain step), botocore (create-only
    # markers) and the direct reader (the restore's chunks) all went virtual-hosted.
    assert counts["virtual tensorstore"] and counts["virtual botocore"], counts
    assert counts["virtual python"], counts
    # The objects landed where a path-style client of moto itself finds them.
    moto = ObjectStoreOptions(endpoint=f"http://127.0.0.1:{strict.upstream_port}")
    _restored(root, moto, _state())
    assert strict.counts == counts  # not through the front (no_proxy)


def test_path_style_fails_clearly_against_the_same_store(strict: VirtualHostProxy) -> None:
    root = f"s3://{strict.bucket}/path-{uuid.uuid4().hex[:8]}"
    with pytest.raises(jaxckpt.CheckpointError) as caught:
        _round_trip(root, strict, "path", "packed")
    text = "".join(str(e) for e in [caught.value, caught.value.__cause__] if e is not None)
    assert strict.bucket in text and "AccessDenied" in text, text
    assert strict.counts["refused"] >= 1 and strict.counts["virtual"] == 0, strict.counts


def test_zarr_python_reads_address_the_bucket_the_same_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from jaxckpt.zarr_compat import fsspec_url

    _, options = fsspec_url("s3://b-1/run", endpoint="https://cwobject.com")
    assert options["config_kwargs"] == {"s3": {"addressing_style": "path"}}
    monkeypatch.setenv(ADDRESSING_ENV, "virtual")
    _, options = fsspec_url("s3://b-1/run", endpoint="https://cwobject.com")
    assert options["config_kwargs"] == {"s3": {"addressing_style": "virtual"}}


def test_an_old_tensorstore_refuses_virtual_hosted_roots_clearly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1.81")
    with pytest.raises(jaxckpt.StorageError, match=r"s3://bucket/run.*tensorstore>=0\.1\.82"):
        open_storage("s3://bucket/run", endpoint="https://cwobject.com", addressing_style="virtual")
    assert open_storage("s3://bucket/run", endpoint="https://cwobject.com")  # path-style works
