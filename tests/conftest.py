"""Shared fixtures: storage roots on a local directory, an S3 server and a GCS emulator.

Importing this module isolates the process from real cloud credentials and
metadata servers (see ``servers.isolate_cloud_env``) before any test imports
boto3, google-auth or TensorStore. The servers start once per session, on
first use, and listen on 127.0.0.1 only (on ports they pick themselves). Each
test that uses one gets ``AWS_ENDPOINT_URL_S3`` / ``STORAGE_EMULATOR_HOST`` set
for that test only, as a user's environment would, so ``open_storage("s3://…")``
needs no options, and every other test sees the same environment whatever ran
before it.

Test modules import the helpers with ``from benchkit import servers``
(``scripts/benchkit/servers.py``; pytest puts ``tests/`` and ``scripts/`` on the
path, ``pythonpath`` in ``pyproject.toml``).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from benchkit import servers

import jaxckpt

servers.isolate_cloud_env(os.environ, tempfile.gettempdir())


@pytest.fixture(scope="session")
def _moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.Server]:
    server = servers.start_moto(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def _gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.Server]:
    server = servers.start_gcs_emulator(tmp_path_factory.mktemp("gcs"))
    yield server
    server.stop()


# The fixtures below set the environment through their own MonkeyPatch, so a
# test's ``monkeypatch.undo()`` leaves the server's endpoint in place.


@pytest.fixture
def s3_server(_moto: servers.Server) -> Iterator[servers.Server]:
    """moto_server with bucket ``servers.BUCKET``; ``AWS_ENDPOINT_URL_S3`` set for this test."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ENDPOINT_URL_S3", _moto.endpoint)
        yield _moto


@pytest.fixture
def gcs_server(_gcs_emulator: servers.Server) -> Iterator[servers.Server]:
    """The GCS emulator with bucket ``servers.BUCKET``; ``STORAGE_EMULATOR_HOST`` set for this test.

    jaxckpt copies ``STORAGE_EMULATOR_HOST`` into the process-wide
    ``TENSORSTORE_GCS_HTTP_URL`` when a ``gs://`` root is opened; registering
    that variable here restores it (unset) after the test.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STORAGE_EMULATOR_HOST", _gcs_emulator.endpoint)
        mp.setenv("TENSORSTORE_GCS_HTTP_URL", _gcs_emulator.endpoint)
        yield _gcs_emulator


@pytest.fixture(autouse=True)
def _tensorstore_gcs_url_restored() -> Iterator[None]:
    """Every test starts with TensorStore's GCS endpoint unset (or its server's) and ends so."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)
        yield


RAM_DIR = Path("/dev/shm")
RAM_SPARE_BYTES = 256 << 20  # left free in RAM beyond what a test asks for


@pytest.fixture
def ram_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A fresh directory in RAM (tmpfs at ``/dev/shm``), else ``tmp_path``; removed after.

    For tests whose subject is not the disk, where fsync on a real disk costs most of
    their time (tmpfs makes it a no-op). A test that writes a lot asks for the room it
    needs with ``@pytest.mark.parametrize("ram_dir", [NBYTES], indirect=True)``; without
    that much free RAM it gets ``tmp_path``.
    """
    need = int(getattr(request, "param", 0))
    ok = RAM_DIR.is_dir() and os.access(RAM_DIR, os.W_OK)
    if ok and shutil.disk_usage(RAM_DIR).free < need + RAM_SPARE_BYTES:
        ok = False
    if not ok:
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="jaxckpt-test-", dir=RAM_DIR))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _root(request: pytest.FixtureRequest, kind: str, tmp_path: Path) -> str:
    if kind == "local":
        return str(tmp_path / "root")
    server: servers.Server = request.getfixturevalue(f"{kind}_server")
    scheme = "s3" if kind == "s3" else "gs"
    return f"{scheme}://{server.bucket}/{uuid.uuid4().hex}"


@pytest.fixture(params=["local", "s3", "gcs"])
def storage_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty root URI on each backend: a directory, s3://… or gs://…."""
    return _root(request, request.param, tmp_path)


@pytest.fixture(params=["s3", "gcs"])
def object_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty ``s3://`` or ``gs://`` root."""
    return _root(request, request.param, tmp_path)


@pytest.fixture
def sigint_default() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in this test, as in a terminal: a suite started in
    the background by a shell without job control (``cmd &``, ``nohup``) inherits SIGINT
    ignored, and a test that sends SIGINT to itself would then see nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def plain_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Managers made without ``layout=`` in this process write the plain layout.

    For tests about what the plain layout stores (one chunk object per chunk: the
    objects they corrupt, delete, count or open with zarr-python), written when plain
    was the default. Child processes take ``--layout`` (plain unless told).
    """
    defaults = jaxckpt.CheckpointOptions.__init__.__kwdefaults__
    assert defaults is not None and defaults["layout"] == "packed"
    monkeypatch.setitem(defaults, "layout", "plain")
