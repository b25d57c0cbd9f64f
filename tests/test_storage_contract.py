"""The Storage contract, run against a local directory, moto (S3) and the GCS emulator."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import tensorstore as ts
from benchkit import servers
from creates import race_to_create

import jaxckpt
from jaxckpt.errors import CheckpointError, StorageError
from jaxckpt.storage import (
    PreconditionFailed,
    Storage,
    TensorStoreStorage,
    _local,
    _object,
    _tserror,
    open_storage,
    tensorstore_backed,
)
from jaxckpt.storage._options import DEFAULT_RETRY_DEADLINE_S, ObjectStoreOptions
from jaxckpt.storage._retry import Backoff


@pytest.fixture
def storage(storage_root: str) -> Storage:
    return open_storage(storage_root)


def test_implements_protocol_and_names_its_root(storage: Storage, storage_root: str) -> None:
    assert isinstance(storage, Storage)
    assert isinstance(storage, TensorStoreStorage) and tensorstore_backed(storage) is storage
    expected = storage_root if "://" in storage_root else os.path.abspath(storage_root)
    assert storage.uri == expected


@pytest.mark.parametrize("size", [0, 1, 5 << 20], ids=["empty", "1B", "5MiB"])
def test_write_read_round_trip(storage: Storage, size: int) -> None:
    data = os.urandom(size)
    storage.write("step_1/manifest.json", data)
    assert storage.read("step_1/manifest.json") == data


@pytest.mark.parametrize("count", [0, 3, 2500], ids=["none", "few", "over-IOV_MAX"])
def test_start_write_stores_the_pieces_in_order(storage: Storage, count: int) -> None:
    rng = np.random.default_rng(count)
    arrays = [rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8) for _ in range(count)]
    pieces: list[bytes | memoryview] = [
        a.data if i % 2 else a.tobytes() for i, a in enumerate(arrays)
    ]  # views of numpy buffers and bytes, some empty
    wait = storage.start_write("packs/0.0.bin", pieces)
    wait()
    assert storage.read("packs/0.0.bin") == b"".join(a.tobytes() for a in arrays)


def test_start_write_of_a_missing_bucket_raises_from_the_wait_or_the_start(
    object_root: str,
) -> None:
    scheme, rest = object_root.split("://", 1)
    missing = open_storage(f"{scheme}://no-such-bucket-{uuid.uuid4().hex[:8]}/{rest}")
    with pytest.raises(StorageError, match="no-such-bucket"):
        missing.start_write("packs/0.0.bin", [b"x"])()


def test_read_missing_returns_none(storage: Storage) -> None:
    assert storage.read("nope") is None
    assert storage.read("no/such/dir/key") is None


def test_plain_write_replaces(storage: Storage) -> None:
    storage.write("k", b"old")
    storage.write("k", b"new")
    assert storage.read("k") == b"new"


def test_exclusive_write_creates_once(storage: Storage) -> None:
    storage.write("step_1/COMMITTED", b"first", exclusive=True)
    with pytest.raises(PreconditionFailed):
        storage.write("step_1/COMMITTED", b"second", exclusive=True)
    assert storage.read("step_1/COMMITTED") == b"first"
    assert storage.list("") == ["step_1/COMMITTED"]  # nothing else left behind


def test_exclusive_create_race_has_one_winner(storage_root: str) -> None:
    # Three "hosts", each with its own storage object, race for the same keys.
    hosts = [open_storage(storage_root) for _ in range(3)]
    for host in hosts:  # measure outside the race
        assert getattr(host, "conditional_writes_enforced", True)
    for round_ in range(5):
        won = race_to_create(hosts, f"race/{round_}")
        assert len(won) == 1, f"round {round_}: winners {won}"
        assert hosts[0].read(f"race/{round_}") == won[0]


def test_delete_is_idempotent(storage: Storage) -> None:
    storage.write("a/b", b"x")
    storage.delete("a/b")
    assert storage.read("a/b") is None
    storage.delete("a/b")
    storage.delete("never/existed")


class _CoreOnly:
    """A root with the core interface only (no TensorStore driver), by delegation."""

    def __init__(self, inner: Storage) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        if name in ("kvstore_spec", "context_spec"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    @property
    def uri(self) -> str:
        return "mem://core-only"


def test_the_tensorstore_specs_are_a_capability_beside_the_core(tmp_path) -> None:
    core = _CoreOnly(open_storage(str(tmp_path)))
    assert not isinstance(core, TensorStoreStorage)
    with pytest.raises(StorageError, match="mem://core-only: TensorStore has no driver") as info:
        tensorstore_backed(core)  # type: ignore[arg-type]
    assert info.value.errno == errno.EOPNOTSUPP
    assert "kvstore_spec" not in Storage.__dict__ and "context_spec" not in Storage.__dict__


def test_delete_many_removes_those_keys_only(storage: Storage) -> None:
    for key in ("a/1", "a/2", "a/3", "b/1"):
        storage.write(key, b"x")
    storage.delete_many(["a/1", "a/3", "b/1", "a/missing"])  # a missing key is no error
    storage.delete_many([])
    assert storage.list("") == ["a/2"]


def test_delete_prefix_removes_only_that_prefix(storage: Storage) -> None:
    for key in ["a/x", "a/y/z", "ab/c", "abc", "b/a/x"]:
        storage.write(key, b"v")
    storage.delete_prefix("a/")
    assert storage.list("") == ["ab/c", "abc", "b/a/x"]
    storage.delete_prefix("missing/")


def test_delete_prefix_returns_only_when_the_tree_is_gone_while_another_removes_it(
    storage: Storage,
) -> None:
    """A fenced writer abandons its attempt while the new writer collects it."""
    for i in range(8 if "://" in storage.uri else 40):
        for j in range(10):
            storage.write(f"t/d{i}/f{j}", b"v")
    left: list[list[str]] = []

    def remove() -> None:
        storage.delete_prefix("t/")
        left.append(storage.list("t/"))

    removers = [threading.Thread(target=remove) for _ in range(2)]
    for remover in removers:
        remover.start()
    for remover in removers:
        remover.join(timeout=120)
    assert left == [[], []]


def test_delete_prefix_gives_up_on_a_tree_refilled_past_its_deadline(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that refills the tree as fast as the walks empty it: the removal raises,
    naming the prefix, once its deadline has passed (the collection retries it later)."""
    storage = open_storage(str(tmp_path))
    storage.write("t/d/f", b"v")
    walks: list[float] = []

    def refilled(path: str) -> None:
        walks.append(time.monotonic())
        raise OSError(errno.ENOTEMPTY, "Directory not empty", path)

    monkeypatch.setattr(_local, "_RMTREE_ATTEMPTS", 10**9)
    monkeypatch.setattr(_local, "_RMTREE_DEADLINE_S", 0.3)
    monkeypatch.setattr(_local.shutil, "rmtree", refilled)
    started = time.monotonic()
    with pytest.raises(StorageError, match="t/"):
        storage.delete_prefix("t/")
    assert len(walks) > 1 and 0.3 <= time.monotonic() - started < 5


def test_list_is_recursive_sorted_and_relative(storage: Storage) -> None:
    keys = ["s/2/z", "s/10/a", "s/1/b/c", "t", "s/1/a"]
    for key in keys:
        storage.write(key, b"")
    assert storage.list("") == sorted(keys)
    assert storage.list("s/") == ["s/1/a", "s/1/b/c", "s/10/a", "s/2/z"]
    assert storage.list("s/1/") == ["s/1/a", "s/1/b/c"]
    assert storage.list("s/1") == ["s/1/a", "s/1/b/c"]  # a prefix names a directory
    assert storage.list("nothing/") == []


def test_kvstore_spec_serves_tensorstore_zarr3(storage: Storage) -> None:
    expected = np.arange(48 * 40, dtype=np.float32).reshape(48, 40)
    spec = {
        "driver": "zarr3",
        "kvstore": storage.kvstore_spec("step_1/params/w/"),
        "metadata": {
            "shape": list(expected.shape),
            "data_type": "float32",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [16, 16]}},
        },
    }
    context = ts.Context(storage.context_spec())
    ts.open(spec, create=True, context=context).result().write(expected).result()
    spec.pop("metadata")
    got = ts.open(spec, open=True, context=ts.Context(storage.context_spec())).result()
    np.testing.assert_array_equal(got.read().result(), expected)
    keys = storage.list("step_1/")
    assert "step_1/params/w/zarr.json" in keys
    assert len(keys) == 1 + 3 * 3  # metadata + 3x3 chunks


def test_corrupt_object_flips_one_byte(storage: Storage) -> None:
    data = bytes(range(256)) * 4
    storage.write("step_1/params/c/0/0", data)
    offset = servers.corrupt_object(f"{storage.uri}/step_1/params/c/0/0")
    got = storage.read("step_1/params/c/0/0")
    assert got is not None and len(got) == len(data)
    assert [i for i in range(len(data)) if got[i] != data[i]] == [offset]
    assert got[offset] == data[offset] ^ 0xFF


# -- object stores only ----------------------------------------------------


def _missing_bucket(root: str) -> str:
    scheme = root.split("://", 1)[0]
    return f"{scheme}://jaxckpt-missing-{uuid.uuid4().hex[:12]}/run"


@pytest.mark.parametrize("operation", ["read", "write", "create", "delete", "list"])
def test_missing_bucket_raises_storage_error_naming_uri(object_root: str, operation: str) -> None:
    root = _missing_bucket(object_root)
    storage = open_storage(root, max_retries=2, initial_delay_s=0.05, max_delay_s=0.1)
    call = {
        "read": lambda: storage.read("k"),
        "write": lambda: storage.write("k", b"x"),
        "create": lambda: storage.write("k", b"x", exclusive=True),
        "delete": lambda: storage.delete("k"),
        "list": lambda: storage.list("steps/"),
    }[operation]
    with pytest.raises(StorageError) as info:
        call()
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, OSError)
    assert f"cannot {'write' if operation == 'create' else operation} {root}/" in str(info.value)


# A loaded 2-core machine may run a request or a thread switch late; a bound
# never waits less than this beyond what the configured settings imply.
LOAD_MARGIN_S = 10.0


def test_unreachable_endpoint_fails_at_the_retry_deadline(
    object_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused endpoint is retried until the deadline, no sooner and not much later."""
    # The GCS endpoint is process-wide (TENSORSTORE_GCS_HTTP_URL): restore it afterwards.
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", os.environ.get("TENSORSTORE_GCS_HTTP_URL", ""))
    dead = f"http://{servers.CLOSED_PORT}"
    settings = {"retry_deadline_s": 2.0, "initial_delay_s": 0.05, "max_delay_s": 0.2}
    storage = open_storage(object_root, endpoint=dead, **settings)
    calls = {
        "write": lambda: storage.write("k", b"x"),
        "read": lambda: storage.read("k"),
        "list": lambda: storage.list("steps/"),
        "delete": lambda: storage.delete_many(["a", "b"]),
    }
    for action, call in calls.items():
        start = time.monotonic()
        with pytest.raises(StorageError) as info:
            call()
        elapsed = time.monotonic() - start
        assert 2.0 <= elapsed < 2.0 + LOAD_MARGIN_S, (action, elapsed)
        message = str(info.value)
        assert object_root.split("://")[1].split("/")[0] in message and dead in message
        assert re.search(r"\(\d+ attempts in 2\.\d s\)", message), message


def test_max_retries_bounds_the_retries_before_the_deadline(
    object_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", os.environ.get("TENSORSTORE_GCS_HTTP_URL", ""))
    dead = f"http://{servers.CLOSED_PORT}"
    storage = open_storage(
        object_root, endpoint=dead, max_retries=3, initial_delay_s=0.05, max_delay_s=0.1
    )
    start = time.monotonic()
    with pytest.raises(StorageError, match=r"\(4 attempts in "):
        storage.read("k")
    assert time.monotonic() - start < 0.05 + 0.1 + 0.1 + LOAD_MARGIN_S


def test_retries_follow_the_deadline_by_default() -> None:
    options = ObjectStoreOptions()
    assert options.max_retries is None and options.retry_deadline_s is None
    assert options.backoff().deadline_s == DEFAULT_RETRY_DEADLINE_S == 120.0
    # A manager's roots retry as long as its saves may take.
    kwargs = jaxckpt.CheckpointOptions(save_timeout_s=900.0).storage_kwargs("s3://bucket/run")
    assert kwargs["retry_deadline_s"] == 900.0
    assert open_storage("s3://bucket/run", **kwargs)._backoff.deadline_s == 900.0
    given = {"retry_deadline_s": 30.0}
    kwargs = jaxckpt.CheckpointOptions(storage_options=given).storage_kwargs("s3://bucket/run")
    assert kwargs["retry_deadline_s"] == 30.0
    # Zarr arrays are retried by TensorStore alone: as many retries as fill the deadline
    # (0.5 + 1 + 2 + 4 s, then 8 s apart: 120 s after 19).
    spec = open_storage("s3://bucket/run").context_spec()
    assert spec["s3_request_retries"] == {
        "max_retries": 19,
        "initial_delay": "500000us",
        "max_delay": "8000000us",
    }
    assert open_storage("gs://bucket/run").context_spec()["gcs_request_retries"] == {
        "max_retries": 19,
        "initial_delay": "500000us",
        "max_delay": "8000000us",
    }
    assert open_storage("gs://bucket/run").context_spec()["gcs_request_concurrency"] == {
        "limit": 32
    }
    assert options.timeout_s == 300.0


def test_full_jitter_spreads_retries_over_the_window() -> None:
    backoff = Backoff(initial_s=0.5, max_s=8.0, deadline_s=600.0)
    for retry, window in ((0, 0.5), (3, 4.0), (10, 8.0)):
        delays = [backoff.delay(retry, started=0.0, now=1.0) for _ in range(2000)]
        assert all(d is not None and 0.0 <= d <= window for d in delays)
        mean = sum(d for d in delays if d is not None) / len(delays)
        assert 0.4 * window < mean < 0.6 * window  # uniform over [0, window): not a wave
        assert min(d for d in delays if d is not None) < 0.05 * window
    assert backoff.delay(10, started=0.0, now=599.5) <= 0.5  # cut short at the deadline
    assert backoff.delay(0, started=0.0, now=600.0) is None


@contextlib.contextmanager
def stalling_endpoint() -> Iterator[str]:
    """A loopback HTTP endpoint that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))  # bound and kept: no other process can take it
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=10)
        assert not thread.is_alive()
        for conn in held:
            conn.close()
        listener.close()


def test_stalling_endpoint_fails_after_timeout_s(
    object_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An endpoint that accepts and never answers: retries do not help, ``timeout_s`` does."""
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", os.environ.get("TENSORSTORE_GCS_HTTP_URL", ""))
    timeout_s = 1.5
    with stalling_endpoint() as endpoint:
        # A stalled attempt is retried like any transient failure, until the deadline.
        storage = open_storage(
            object_root, endpoint=endpoint, timeout_s=timeout_s, retry_deadline_s=timeout_s
        )
        start = time.monotonic()
        with pytest.raises(StorageError, match=rf"no answer within {timeout_s} s") as info:
            storage.read("jaxckpt.json")
        elapsed = time.monotonic() - start
        assert timeout_s <= elapsed < timeout_s + LOAD_MARGIN_S, elapsed
        assert info.value.errno == errno.ETIMEDOUT
        # A manager on that root fails the same way when it opens, instead of hanging.
        options = {"endpoint": endpoint, "timeout_s": timeout_s, "retry_deadline_s": timeout_s}
        start = time.monotonic()
        with pytest.raises(StorageError, match="no answer within"):
            jaxckpt.CheckpointManager(object_root, storage_options=options)
        assert time.monotonic() - start < timeout_s + LOAD_MARGIN_S


def test_server_enforces_conditions(object_root: str) -> None:
    storage = open_storage(object_root)
    assert isinstance(storage, _object.ObjectStorage)
    assert storage.conditional_writes_enforced
    assert storage.list("") == []  # the probe cleaned up after itself


@pytest.fixture(scope="module")
def unpatched_gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.Server]:
    """gcp-storage-emulator as released: it ignores ``ifGenerationMatch``."""
    server = servers.start_gcs_emulator(tmp_path_factory.mktemp("gcs-raw"), patched=False)
    yield server
    server.stop()


RACE_ROUNDS = 40


def test_fallback_on_a_server_that_ignores_conditions(
    unpatched_gcs: servers.Server,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Against the released emulator: the probe detects it, and check-write-read-back
    never overwrites an existing key; racing writers may both win (rate measured)."""
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", os.environ.get("TENSORSTORE_GCS_HTTP_URL", ""))
    root = f"gs://{unpatched_gcs.bucket}/{uuid.uuid4().hex}"
    hosts = [open_storage(root, endpoint=unpatched_gcs.endpoint) for _ in range(3)]
    for host in hosts:
        assert isinstance(host, _object.ObjectStorage)
        assert not host.conditional_writes_enforced
    assert "ignores create-only conditions" in caplog.text
    storage = hosts[0]
    assert storage.list("") == []  # the probes cleaned up after themselves

    storage.write("COMMITTED", b"first", exclusive=True)
    with pytest.raises(PreconditionFailed):
        hosts[1].write("COMMITTED", b"second", exclusive=True)
    assert storage.read("COMMITTED") == b"first"

    double = 0
    for round_ in range(RACE_ROUNDS):
        key = f"race/{round_}"
        won = race_to_create(hosts, key)
        assert won, f"round {round_}: nobody won"
        assert storage.read(key) in won, f"round {round_}: stored object is a loser's"
        double += len(won) > 1
    with capsys.disabled():
        print(f"\n  fallback race: {double} of {RACE_ROUNDS} rounds had more than one winner")
    assert storage.list("race/") == [f"race/{r}" for r in sorted(map(str, range(RACE_ROUNDS)))]


def test_no_value_generation_means_absent() -> None:
    store = ts.KvStore.open({"driver": "memory"}).result()
    absent = _tserror.no_value_generation()
    assert store.write("k", b"1", if_equal=absent).result().generation
    assert not store.write("k", b"2", if_equal=absent).result().generation
    assert store["k"] == b"1"


def test_kvstore_spec_paths() -> None:
    storage = open_storage("s3://bucket/runs/a/", endpoint="http://127.0.0.1:1", region="eu-west-1")
    assert storage.uri == "s3://bucket/runs/a"
    assert storage.kvstore_spec("step_1/") == {
        "driver": "s3",
        "bucket": "bucket",
        "path": "runs/a/step_1/",
        "endpoint": "http://127.0.0.1:1",
        "aws_region": "eu-west-1",
    }
    assert open_storage("s3://bucket").kvstore_spec("x")["path"] == "x/"


@pytest.mark.parametrize(
    ("uri", "options", "error"),
    [
        ("s3://b/p", {"max_retries": 0}, ValueError),
        ("s3://b/p", {"initial_delay_s": 10.0, "max_delay_s": 1.0}, ValueError),
        ("s3://b/p", {"endpoint": "127.0.0.1:9000"}, ValueError),
        ("s3://b/p", {"request_concurrency": True}, ValueError),
        ("s3://b/p", {"timeout_s": 0}, ValueError),
        ("s3://b/p", {"retries": 3}, TypeError),
        ("gs://b/p", {"region": "us-east-1"}, ValueError),
        ("s3:///p", {}, StorageError),
    ],
)
def test_options_are_validated(uri: str, options: dict[str, object], error: type) -> None:
    with pytest.raises(error):
        open_storage(uri, **options)


def test_read_buffer_matches_read_and_is_aligned_locally(storage: Storage) -> None:
    data = np.random.default_rng(0).bytes(3 << 20)
    storage.write("big/object", data)
    buffer = storage.read_buffer("big/object")
    assert buffer is not None and bytes(buffer) == data
    if isinstance(buffer, np.ndarray):  # local roots: aligned for zero-copy device_put
        assert buffer.ctypes.data % 64 == 0
    assert storage.read_buffer("big/missing") is None


def test_gcs_endpoint_is_process_wide_and_set_only_when_given(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """TensorStore's gcs driver takes its endpoint only from TENSORSTORE_GCS_HTTP_URL
    (read when a driver is opened), so an explicit endpoint or STORAGE_EMULATOR_HOST
    is copied there, for the whole process; nothing else touches it."""
    name = "TENSORSTORE_GCS_HTTP_URL"
    monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    open_storage("gs://bucket/run")
    open_storage("s3://bucket/run", endpoint="http://127.0.0.1:1")
    assert name not in os.environ
    open_storage("gs://bucket/run", endpoint="http://127.0.0.1:1/")
    assert os.environ[name] == "http://127.0.0.1:1"
    assert "redirecting" not in caplog.text
    open_storage("gs://bucket/other", endpoint="http://127.0.0.1:2")
    assert os.environ[name] == "http://127.0.0.1:2"
    assert "redirecting every TensorStore GCS request" in caplog.text
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:3")
    assert open_storage("gs://bucket/run")._endpoint == "http://127.0.0.1:3"
    assert os.environ[name] == "http://127.0.0.1:3"
