"""Loopback S3 (moto) and GCS emulator servers for the object-store rows."""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from benchkit import servers
from benchkit.common import STORE_CONTENDERS, Case, Settings
from benchkit.rounds import BucketRoots, child_env, run_io_rounds
from benchkit.summary import summarize_io


def loopback_endpoint(url: str) -> str:
    """``url`` if it names a server on this machine (``http://127.0.0.1:PORT``); else exits.

    For benchmarks pointed at a server that is already running (the test
    session's), whose bucket is ``servers.BUCKET``.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost") or not parts.port:
        raise SystemExit(f"{url!r}: only a loopback server, http://127.0.0.1:PORT, may be used")
    return url.rstrip("/")


def endpoints_env(s3_endpoint: str, gcs_endpoint: str) -> dict[str, str]:
    """The environment that sends S3 and GCS requests to the loopback servers."""
    return {
        "AWS_ENDPOINT_URL_S3": s3_endpoint,
        "STORAGE_EMULATOR_HOST": gcs_endpoint,
        "TENSORSTORE_GCS_HTTP_URL": gcs_endpoint,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


def start_both(servers: ModuleType, log_dir: Path) -> tuple[Any, Any]:
    """``(moto, GCS emulator)`` started on loopback; moto is stopped again if the emulator fails."""
    s3 = servers.start_moto(log_dir)
    try:
        return s3, servers.start_gcs_emulator(log_dir)
    except BaseException:
        s3.stop()
        raise


@contextmanager
def object_stores(log_dir: Path) -> Iterator[tuple[dict[str, str], ...]]:
    """Starts S3 and GCS servers on 127.0.0.1; yields (child env, buckets, server logs).

    Buckets and server logs are by store name (``s3``, ``gcs``).

    The child environment sends every endpoint and credential lookup to loopback
    (``AWS_ENDPOINT_URL*`` matter: Orbax's path handling inside jaxckpt goes
    through s3fs, which otherwise contacts ``s3.amazonaws.com``).
    """
    saved_env = dict(os.environ)
    servers.isolate_cloud_env(os.environ, str(log_dir))  # boto3 here and in the children
    try:
        s3, gcs = start_both(servers, log_dir)
        env = child_env()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    env.update(endpoints_env(s3.endpoint, gcs.endpoint), AWS_ENDPOINT_URL=s3.endpoint)
    try:
        buckets = {"s3": f"s3://{s3.bucket}", "gcs": f"gs://{gcs.bucket}"}
        yield env, buckets, {"s3": str(s3.log_path), "gcs": str(gcs.log_path)}
    finally:
        gcs.stop()
        s3.stop()


def run_store_rounds(
    s: Settings, case: Case, env: dict[str, str], buckets: dict[str, str], logs: dict[str, str]
) -> dict[str, Any]:
    samples = run_io_rounds(s, case, STORE_CONTENDERS, BucketRoots(buckets), env, logs)
    return {c: summarize_io(x, case.nbytes) for c, x in samples.items()}


# ---- one case --------------------------------------------------------------------------------
