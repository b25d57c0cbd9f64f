"""Shared fixtures: storage roots on a local directory, an S3 server and a GCS emulator.

Importing this module isolates the process from real cloud credentials and
metadata servers (see ``servers.isolate_cloud_env``) before any test imports
boto3, google-auth or TensorStore. The servers start once per session, on
first use, listen on 127.0.0.1 only, and set ``AWS_ENDPOINT_URL_S3`` /
``STORAGE_EMULATOR_HOST`` for the session, as a user's environment would, so
``open_storage("s3://…")`` needs no options.

Test modules import the helpers with ``import servers``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import servers

servers.isolate_cloud_env(os.environ, tempfile.gettempdir())


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.Server]:
    """moto_server with bucket ``servers.BUCKET``; sets ``AWS_ENDPOINT_URL_S3``."""
    server = servers.start_moto(tmp_path_factory.mktemp("moto"))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("AWS_ENDPOINT_URL_S3", server.endpoint)
            yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.Server]:
    """The GCS emulator with bucket ``servers.BUCKET``; sets ``STORAGE_EMULATOR_HOST``."""
    server = servers.start_gcs_emulator(tmp_path_factory.mktemp("gcs"))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
            # jaxckpt copies STORAGE_EMULATOR_HOST into TensorStore's variable;
            # registering it here restores it at the end of the session.
            mp.setenv("TENSORSTORE_GCS_HTTP_URL", server.endpoint)
            yield server
    finally:
        server.stop()


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
