"""Loopback object-store servers for tests and benchmarks, and a helper to corrupt objects.

One module for the test suite, ``scripts/bench.py`` and ``scripts/torture.py``,
imported everywhere as ``from benchkit import servers``: a script run from
``scripts/`` has that directory on its path, and pytest adds it (``pythonpath``
in ``pyproject.toml``). It imports nothing outside the standard library at
module level, so a benchmark pays nothing for it. ``tests/conftest.py`` calls
:func:`isolate_cloud_env` at import time and starts the servers once per
session through fixtures.

* S3: moto's server, started through this file (``python -P servers.py moto
  HOST``) so that its conditional writes are atomic, as S3's are (see
  :func:`_run_moto`); ``moto-unpatched`` runs ``moto_server`` as released.
* GCS: ``gcp-storage-emulator``, started through this file (``python -P servers.py
  gcs-emulator HOST``) so that three gaps in it can be patched to behave as
  real GCS does (see :func:`_run_gcs_emulator`); ``gcs-emulator-unpatched``
  runs it as released.

Each server binds a port of its own choosing and logs it, so no port is ever
picked here, released, and then lost to another process.

Everything listens on 127.0.0.1, and the environment keeps every credential
lookup (AWS instance metadata, GCE metadata, gcloud files) off the network.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

BUCKET = "jaxckpt-test"
CLOSED_PORT = "127.0.0.1:9"  # the discard port: nothing listens there on CI machines

# Set for the whole test session (and inherited by the servers).
CLOUD_TEST_ENV = {
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "GCE_METADATA_ROOT": CLOSED_PORT,
    "GCE_METADATA_HOST": CLOSED_PORT,
    "GCE_METADATA_IP": CLOSED_PORT,
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
}
# Removed for the session: a developer's real credentials or endpoints.
SCRUBBED_ENV = (
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING",
    "STORAGE_EMULATOR_HOST",
    "TENSORSTORE_GCS_HTTP_URL",
)


def isolate_cloud_env(environ: MutableMapping[str, str], scratch_dir: str) -> None:
    """Points every cloud credential lookup at loopback or nowhere.

    ``CLOUDSDK_CONFIG`` names a directory that does not exist, so neither
    google-auth nor TensorStore finds gcloud application-default credentials;
    with no credentials, TensorStore's GCS driver probes ``GCE_METADATA_ROOT``
    (a closed loopback port) and then sends unauthenticated requests, and
    google-cloud-storage uses anonymous credentials when
    ``STORAGE_EMULATOR_HOST`` is set.
    """
    for name in SCRUBBED_ENV:
        environ.pop(name, None)
    environ.update(CLOUD_TEST_ENV)
    environ["CLOUDSDK_CONFIG"] = os.path.join(scratch_dir, f"no-gcloud-config-{uuid.uuid4().hex}")


def free_port() -> int:
    """A port that was free a moment ago: only for callers that retry on a lost race."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Server:
    """A server subprocess with one bucket created in it."""

    name: str
    endpoint: str
    bucket: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def log_tail(self, n: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


START_TIMEOUT_S = 60.0
_LISTENING = re.compile(r"(?:Running on|listening on) http://127\.0\.0\.1:(\d+)")


def _spawn(
    name: str,
    argv: list[str],
    probe_path: str,
    log_dir: Path,
    env: dict[str, str] | None = None,
    nice: int = 0,
) -> Server:
    """Starts a server that binds a port of its own choosing (port 0) and logs it.

    No port is picked by the caller and released, so no other process can take
    it in between: the server's own log line names the port it listens on.
    ``nice``: the server's nice value (added to this process's).
    """
    log_path = log_dir / f"{name}-{uuid.uuid4().hex[:6]}.log"
    niced = (lambda: os.nice(nice)) if nice else None
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=niced
        )
    server = Server(name, "", BUCKET, process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (match := _LISTENING.search(server.log_tail(100_000))):
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"{name} did not listen within {START_TIMEOUT_S:.0f}s")
        time.sleep(0.05)
    server.endpoint = f"http://127.0.0.1:{match.group(1)}"
    while True:
        try:
            with urllib.request.urlopen(server.endpoint + probe_path, timeout=2):
                return server
        except urllib.error.HTTPError:
            return server  # it answers; an error status is still an answer
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"{name} did not answer:\n{server.log_tail()}") from None
            time.sleep(0.05)


MOTO_KEY_BUFFER_BYTES = 4 << 30
"""Objects up to this size stay in moto's memory."""


def start_moto(
    log_dir: Path,
    *,
    unauthenticated_requests: int | None = None,
    patched: bool = True,
    key_buffer_bytes: int = MOTO_KEY_BUFFER_BYTES,
    nice: int = 0,
) -> Server:
    """Starts moto's S3 server on a loopback port it picks, with bucket :data:`BUCKET`.

    Objects are kept in memory, as in the GCS emulator: moto spills an object
    over 5 MiB to a temporary file by default, and reads that file whole for
    every GET, ranged or not.

    Args:
      log_dir: where the server's log goes.
      unauthenticated_requests: if set, moto checks the signature and IAM
        access key of every request after this many (its
        ``INITIAL_NO_AUTH_ACTION_COUNT``); the start-up probe and the bucket's
        creation take two of them.
      patched: serialise the writes of each key (:func:`_run_moto`); False runs
        ``moto_server`` as released.
      key_buffer_bytes: larger objects are spilled to temporary files.
      nice: the server's nice value (a benchmark's stand-in for a store elsewhere).
    """
    env = dict(os.environ, MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(key_buffer_bytes))
    if unauthenticated_requests is not None:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(unauthenticated_requests)
    if patched:
        argv = [sys.executable, "-P", __file__, "moto", "127.0.0.1"]
    else:
        argv = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", "0"]
    server = _spawn("moto", argv, "/", log_dir, env, nice)
    try:
        s3_client(server.endpoint).create_bucket(Bucket=server.bucket)
    except BaseException:
        server.stop()
        raise
    return server


def start_gcs_emulator(log_dir: Path, *, patched: bool = True) -> Server:
    """Starts the GCS emulator on a loopback port it picks, with bucket :data:`BUCKET`.

    Args:
      log_dir: where the server's log goes.
      patched: run it with the fixes of :func:`_run_gcs_emulator`; False runs
        the released emulator's server and handlers unchanged.
    """
    mode = "gcs-emulator" if patched else "gcs-emulator-unpatched"
    # -P: benchkit's own modules (common, report, ...) must not shadow the emulator's imports
    argv = [sys.executable, "-P", __file__, mode, "127.0.0.1"]
    server = _spawn(mode, argv, "/storage/v1/b?project=test", log_dir)
    try:
        _gcs_json(server.endpoint, "POST", "/storage/v1/b?project=test", {"name": server.bucket})
        # Soft delete off, as a GCS bucket can have it (the emulator takes it in a PATCH
        # only): its default keeps every deleted object's bytes in memory for 7 days, so a
        # benchmark that deletes each round's step grew by the state every round, and its
        # reads slowed with it (0.17 s to 0.74 s over ten rounds of a 256 MiB state).
        _gcs_json(server.endpoint, "PATCH", f"/storage/v1/b/{server.bucket}",
                  {"softDeletePolicy": {"retentionDurationSeconds": "0"}})  # fmt: skip
    except BaseException:
        server.stop()
        raise
    return server


def _gcs_json(endpoint: str, method: str, path: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(
        f"{endpoint}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method=method,
    )
    with urllib.request.urlopen(request, timeout=START_TIMEOUT_S):  # one request at a time
        pass


def s3_client(endpoint: str | None = None) -> Any:
    """A boto3 S3 client for ``endpoint`` (default: ``AWS_ENDPOINT_URL_S3``)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint or os.environ["AWS_ENDPOINT_URL_S3"],
        region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
    )


def gcs_client() -> Any:
    """A google-cloud-storage client for the emulator named by ``STORAGE_EMULATOR_HOST``."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project="test", credentials=AnonymousCredentials())


def corrupt_object(uri: str, offset: int | None = None) -> int:
    """Flips all bits of one byte of a stored object, through the store's own API.

    Works on any backend the test fixtures provide: a local path or
    ``file://`` URI, ``s3://bucket/key`` (boto3 against ``AWS_ENDPOINT_URL_S3``)
    and ``gs://bucket/key`` (google-cloud-storage against
    ``STORAGE_EMULATOR_HOST``).

    Args:
      uri: the object, e.g. ``storage.uri + "/step_1/params/c/0/0"``.
      offset: the byte to flip; default the middle byte.

    Returns:
      The offset of the flipped byte.
    """
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme == "file":
        path = Path(rest if sep else uri)
        data = bytearray(path.read_bytes())
        offset = _flip(data, offset, uri)
        path.write_bytes(bytes(data))
        return offset
    bucket, _, key = rest.partition("/")
    if scheme == "s3":
        client = s3_client()
        data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        offset = _flip(data, offset, uri)
        client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
        return offset
    if scheme == "gs":
        blob = gcs_client().bucket(bucket).blob(key)
        data = bytearray(blob.download_as_bytes())
        offset = _flip(data, offset, uri)
        blob.upload_from_string(bytes(data))
        return offset
    raise ValueError(f"cannot corrupt {uri!r}: unknown scheme")


def _flip(data: bytearray, offset: int | None, uri: str) -> int:
    if not data:
        raise ValueError(f"cannot corrupt {uri}: the object is empty")
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0xFF
    return offset


def _serve_gcs_emulator(host: str, label: str) -> None:
    """Runs the emulator's server on a port the OS picks and logs that port."""
    from gcp_storage_emulator import server

    emulator = server.Server(host, 0, in_memory=True)
    emulator.start()
    port = emulator._api._httpd.server_address[1]
    print(f"{label} listening on http://{host}:{port}", flush=True)
    try:
        while True:
            time.sleep(1)
    finally:
        emulator.stop()


def _run_gcs_emulator(host: str) -> None:
    """Runs gcp-storage-emulator (in memory) with three GCS behaviours patched in.

    The emulator, as measured with 2026.7.19, (1) fails a media upload of an
    empty object (it reads the empty body as None and calls ``len(None)``);
    (2) ignores ``startOffset``/``endOffset`` when listing, so TensorStore's
    range listings and ``delete_range`` cover the whole bucket; (3) ignores
    ``ifGenerationMatch`` on uploads, so create-only writes overwrite; (4)
    sends no ``x-goog-generation`` header with a download, which TensorStore's
    OCDBT driver needs ("Malformed StorageGeneration"). Real GCS does all
    four, and the code under test relies on them, so they are patched here,
    as are its listen backlog and (5) its silence on ``Expect: 100-continue``
    (curl then waited 1 s before every upload over 1 MiB). (6) After every
    write it serialized its whole object table to JSON (``indent=2``) for a
    ``.meta`` file that an in-memory emulator reads only when it starts, so a
    write cost time in proportion to the objects in the bucket (1,000 leaves
    of 64 KiB saved in 62 s against 4 s for 300); that write is skipped here.
    The emulator serves one request at a time (a plain
    ``http.server.HTTPServer``), so the generation check and the upload are
    atomic with respect to other requests.
    """
    import http.server
    import logging
    from http import HTTPStatus

    from gcp_storage_emulator import server, storage
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    storage.Storage._write_config_to_file = lambda self: None  # in memory: never read back

    original_insert, original_ls = objects.insert, objects.ls
    original_media_upload = objects._media_upload
    original_download = objects.download

    def download(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_download(request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            try:
                obj = storage.get_file_obj(
                    request.params["bucket_name"], request.params["object_id"]
                )
            except NotFound:
                return result
            response["x-goog-generation"] = str(obj.get("generation") or 0)
        return result

    def media_upload(request: Any, response: Any, storage: Any) -> Any:
        if request.data is None:
            request._data = b""
        return original_media_upload(request, response, storage)

    def insert(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        condition = request.query.get("ifGenerationMatch")
        if condition:
            name = request.query.get("name", [None])[0]
            if name is None and isinstance(request.data, dict):
                name = request.data.get("meta", {}).get("name")
            try:
                obj = storage.get_file_obj(request.params["bucket_name"], name)
                current = int(obj.get("generation") or 0)
            except NotFound:
                current = 0
            if current != int(condition[0]):
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json(
                    {
                        "error": {
                            "code": 412,
                            "message": "At least one of the pre-conditions did not hold.",
                            "errors": [{"reason": "conditionNotMet"}],
                        }
                    }
                )
                return None
        return original_insert(request, response, storage, *args, **kwargs)

    def ls(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_ls(request, response, storage, *args, **kwargs)
        start = request.query.get("startOffset", [""])[0]
        end = request.query.get("endOffset", [""])[0]
        if (start or end) and response.status == HTTPStatus.OK and response._content:
            body = json.loads(response._content)
            body["items"] = [
                item
                for item in body.get("items") or []
                if item["name"] >= start and (not end or item["name"] < end)
            ]
            response.json(body)
        return result

    objects._media_upload = media_upload
    objects.insert = insert
    objects.ls = ls
    objects.download = download  # also reached through objects.get (?alt=media)
    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler is original_insert:
                handlers[method] = insert
            elif handler is original_ls:
                handlers[method] = ls
            elif handler is original_download:
                handlers[method] = download
    # Not a GCS behaviour, but a test-speed one: the default listen backlog of
    # 5 drops the SYNs of TensorStore's concurrent requests, costing 1 s each.
    http.server.HTTPServer.request_queue_size = 128
    # GCS answers "Expect: 100-continue" (which curl sends with every upload
    # over 1 MiB); the emulator's HTTP/1.0 handler does not, so curl waited its
    # 1 s expect timeout before each such upload's body.
    original_parse = server.RequestHandler.parse_request

    def parse_request(self: Any) -> bool:
        ok = original_parse(self)
        expect = self.headers.get("Expect", "") if ok else ""
        if expect.lower() == "100-continue" and self.request_version >= "HTTP/1.1":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.wfile.flush()
        return bool(ok)

    server.RequestHandler.parse_request = parse_request
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _serve_gcs_emulator(host, "patched gcp-storage-emulator")


def _run_moto(host: str) -> None:
    """Runs moto's S3 server with the writes of each key serialised.

    moto 5.2.5 answers ``PutObject`` with ``If-None-Match: *`` (and a
    ``CompleteMultipartUpload`` with it) by looking the key up and then storing
    the object, without a lock, in a threaded server: two writers racing for one
    key could both be told they created it (2 of 20 races of 16 writers, with
    bodies large enough to be spilled to disk). S3 decides the condition
    atomically, and the commit protocol's create-only records (markers, epochs)
    rely on that. Every PUT and POST of an object therefore runs under a lock
    of its (bucket, key) here: conditional writes of one key take turns, a plain
    write cannot land between another's check and store, and writes of
    different keys still run in parallel.
    """
    import collections
    import threading

    from moto import server
    from moto.s3.responses import S3Response

    guard = threading.Lock()
    locks: collections.defaultdict[tuple[str, str], threading.Lock] = collections.defaultdict(
        threading.Lock
    )

    def serialised(method: Any) -> Any:
        def run(self: Any, *args: Any) -> Any:
            key = (str(self.bucket_name), str(args[-1]))  # both methods take key_name last
            with guard:
                lock = locks[key]
            with lock:
                return method(self, *args)

        return run

    S3Response._key_response_put = serialised(S3Response._key_response_put)
    S3Response._key_response_post = serialised(S3Response._key_response_post)
    server.main(["-H", host, "-p", "0"])


if __name__ == "__main__":
    modes = ("gcs-emulator", "gcs-emulator-unpatched", "moto")
    if len(sys.argv) != 3 or sys.argv[1] not in modes:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(modes)}}} HOST")
    if sys.argv[1] == "moto":
        _run_moto(sys.argv[2])
    elif sys.argv[1] == "gcs-emulator":
        _run_gcs_emulator(sys.argv[2])
    else:
        _serve_gcs_emulator(sys.argv[2], "gcp-storage-emulator (as released)")
