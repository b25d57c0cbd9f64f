"""Reading jaxckpt checkpoints with zarr-python: extra data types and fsspec stores.

Every array jaxckpt writes is a plain zarr v3 array (``bytes`` little-endian +
``crc32c`` codecs, a regular chunk grid), and each step's ``arrays/`` prefix is
a zarr v3 group. zarr-python 3 reads all of them, except that it has no
built-in ``bfloat16`` or ``float8_*`` data types (the names TensorStore and
jaxckpt use): opening such an array fails with ``No Zarr data type found that
matches 'bfloat16'``, and ``group.arrays()`` fails for the whole group.

:func:`register_dtypes` adds those types to zarr-python's data-type registry,
backed by the ml_dtypes numpy types that JAX uses, so any zarr reader in the
process then opens them. :func:`open_group` does that and also opens a
committed step on ``gs://`` and ``s3://`` through fsspec (gcsfs / s3fs, the
``jaxckpt[zarr]`` extra), with the same endpoint environment variables as
jaxckpt itself.

A packed step (:data:`jaxckpt.formats.PACKED`, the default) has no per-array zarr
objects: its chunks lie in pack objects. Each chunk there is stored exactly as
zarr's ``bytes`` + ``crc32c`` codecs encode it (``raw || crc32c(raw)``), so
:func:`reference_manifest` maps every zarr key of the step (group and array
``zarr.json``, chunk keys) to the bytes that hold it (``[pack URL, offset,
size]``, a kerchunk / fsspec reference spec, version 1), and
:func:`open_group` opens packed steps through fsspec's ``ReferenceFileSystem``.

>>> import tempfile, numpy as np, ml_dtypes, jaxckpt
>>> root = tempfile.mkdtemp()
>>> with jaxckpt.CheckpointManager(root) as mgr:
...     mgr.save(3, {"w": np.arange(4).astype(ml_dtypes.bfloat16)})
True
>>> group = open_group(root)
>>> w = group["w"][:]
>>> str(w.dtype), w.astype(np.float32).tolist()
('bfloat16', [0.0, 1.0, 2.0, 3.0])
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from jaxckpt.errors import CheckpointError
from jaxckpt.formats import step_format

__all__ = [
    "ZARR_EXTRA_DTYPES",
    "fsspec_url",
    "open_group",
    "reference_manifest",
    "register_dtypes",
]

#: Data types jaxckpt can write that zarr-python 3 lacks; all are 1 or 2 bytes
#: per element, little-endian, like numpy's ml_dtypes types of the same name.
ZARR_EXTRA_DTYPES = (
    "bfloat16",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)


class ZarrUnavailableError(CheckpointError, ImportError):
    """zarr-python (or the fsspec backend for ``gs://`` / ``s3://``) is not installed.

    Install the extra: ``pip install 'jaxckpt[zarr]'`` (zarr, gcsfs, s3fs).
    """


def _zdtype_class(name: str) -> Any:
    import ml_dtypes
    import numpy as np
    from zarr.core.dtype.npy.float import BaseFloat

    native = np.dtype(getattr(ml_dtypes, name))

    @dataclass(frozen=True, kw_only=True)
    class MLDtype(BaseFloat):
        """A zarr v3 data type for ml_dtypes' ``{name}`` (registered by jaxckpt)."""

        dtype_cls = type(native)
        _zarr_v3_name = name
        _zarr_v2_names = ()

        @property
        def item_size(self) -> int:
            return native.itemsize

    MLDtype.__name__ = MLDtype.__qualname__ = f"ML_{name}"
    return MLDtype


def register_dtypes() -> tuple[str, ...]:
    """Registers jaxckpt's extra data types with zarr-python; returns the names added.

    Idempotent, and it never replaces a type zarr-python already has (a future
    release with a built-in ``bfloat16`` keeps its own).

    Raises:
      ZarrUnavailableError: zarr-python 3 is not installed.
    """
    try:
        from zarr.core.dtype import data_type_registry
    except ImportError as e:
        raise ZarrUnavailableError("zarr-python 3 is needed: pip install 'jaxckpt[zarr]'") from e
    data_type_registry._lazy_load()  # entry-point types first, so ours never shadow them
    added = []
    for name in ZARR_EXTRA_DTYPES:
        if name in data_type_registry.contents:
            continue
        data_type_registry.register(name, _zdtype_class(name))
        added.append(name)
    return tuple(added)


def fsspec_url(
    uri: str, *, endpoint: str | None = None, region: str | None = None
) -> tuple[str, dict[str, Any]]:
    """The fsspec URL and ``storage_options`` that reach a jaxckpt URI.

    Endpoints come from the same places jaxckpt reads them: ``endpoint``, else
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (s3fs, addressing the bucket
    as jaxckpt's own clients do: ``JAXCKPT_S3_ADDRESSING_STYLE``, else path-style
    with a custom endpoint) or ``STORAGE_EMULATOR_HOST`` (gcsfs, with anonymous
    credentials, as for an emulator). Local paths come back unchanged with no options.

    >>> url, options = fsspec_url("s3://b/run/steps/3/arrays", endpoint="http://127.0.0.1:9000")
    >>> url, options["endpoint_url"], options["config_kwargs"]
    ('s3://b/run/steps/3/arrays', 'http://127.0.0.1:9000', {'s3': {'addressing_style': 'path'}})
    >>> fsspec_url("/data/run")
    ('/data/run', {})
    """
    scheme, sep, _ = uri.partition("://")
    options_for = _FSSPEC_OPTIONS.get(scheme) if sep else None
    if options_for is None:
        return uri.removeprefix("file://"), {}
    return uri, options_for(uri, endpoint, region)


def _s3fs_options(uri: str, endpoint: str | None, region: str | None) -> dict[str, Any]:
    from jaxckpt.storage import S3Address, resolve_style

    options: dict[str, Any] = {}
    url = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if url:
        options["endpoint_url"] = url
    if region:
        options["client_kwargs"] = {"region_name": region}
    bucket, style = uri.partition("://")[2].partition("/")[0], resolve_style("auto", uri)
    address = S3Address(bucket=bucket, region=region or "", endpoint=url or None, style=style)
    if address.botocore_style():
        options["config_kwargs"] = {"s3": {"addressing_style": address.botocore_style()}}
    return options


def _gcsfs_options(uri: str, endpoint: str | None, region: str | None) -> dict[str, Any]:
    host = endpoint or os.environ.get("STORAGE_EMULATOR_HOST")
    if not host:
        return {}
    return {"endpoint_url": host if "://" in host else f"http://{host}", "token": "anon"}


_FSSPEC_OPTIONS = {"s3": _s3fs_options, "gs": _gcsfs_options}
"""fsspec's ``storage_options`` per object-store scheme (s3fs, gcsfs)."""


def _fill_value(dtype: str) -> Any:
    """The zarr v3 ``fill_value`` TensorStore writes for a jaxckpt array (zero)."""
    from jaxckpt.records import np_dtype

    kind = np_dtype(dtype).kind
    if kind == "b":
        return False
    if kind in "iu":
        return 0
    if kind == "c":
        return [0.0, 0.0]
    return 0.0


def _fsspec_protocol(uri: str) -> str:
    return uri.split("://", 1)[0] if "://" in uri else "file"


def _committed(
    root: str | os.PathLike[str], step: int | None, endpoint: str | None, region: str | None
) -> tuple[Any, Any]:
    """The root's commit protocol and the marker of ``step`` (None: the latest)."""
    from jaxckpt.commit import CommitReader
    from jaxckpt.storage import open_storage

    options: dict[str, Any] = {}
    if endpoint is not None:
        options["endpoint"] = endpoint
    if region is not None:
        options["region"] = region
    protocol = CommitReader(open_storage(root, **options))
    protocol.check_root()
    return protocol, protocol.marker_or_latest(step)


def reference_manifest(
    root: str | os.PathLike[str],
    step: int | None = None,
    *,
    endpoint: str | None = None,
    region: str | None = None,
) -> dict[str, Any]:
    """A kerchunk-style reference spec (version 1) of a committed step's zarr group.

    Every key of the step's ``arrays/`` zarr v3 group maps to where its bytes
    are: the group's ``zarr.json`` and each array's ``zarr.json`` inline (the
    same metadata a plain step stores), each chunk to ``[URL, offset, size]``
    inside its pack object (packed steps) or ``[URL]`` of its chunk object
    (plain steps). The chunk bytes are the zarr ``bytes`` + ``crc32c`` encoding,
    so zarr-python decodes them and checks each CRC32C. The spec is plain JSON:
    save it and open it later with ``fsspec.filesystem("reference", fo=...)``.
    Value leaves (Python scalars, strings) are not zarr arrays and are left out.

    Args:
      root: a local path, ``gs://bucket/prefix`` or ``s3://bucket/prefix``.
      step: the committed step; None takes the newest.
      endpoint, region: as for :func:`open_group`.

    Returns:
      ``{"version": 1, "refs": {key: str | [url] | [url, offset, size]}}``.

    Raises:
      NotACheckpointRootError / StepNotFoundError: no such root or committed step.

    >>> import tempfile, numpy as np, jaxckpt
    >>> root = tempfile.mkdtemp()
    >>> with jaxckpt.CheckpointManager(root) as mgr:  # packed, the default
    ...     mgr.save(1, {"w": np.arange(3, dtype=np.float32)})
    True
    >>> refs = reference_manifest(root)["refs"]
    >>> sorted(refs), refs["w/c/0"][1:]
    (['w/c/0', 'w/zarr.json', 'zarr.json'], [0, 16])
    """
    import json

    from jaxckpt.formats import zarr_metadata
    from jaxckpt.restoring import load_step

    protocol, marker = _committed(root, step, endpoint, region)
    loaded = load_step(protocol, marker)
    loc = marker.location
    group = protocol.storage.read(loc.arrays_prefix + "zarr.json")
    refs: dict[str, Any] = {
        "zarr.json": group.decode()
        if group is not None
        else json.dumps(
            {"zarr_format": 3, "node_type": "group", "attributes": {"jaxckpt_step": loc.step}}
        )
    }
    for leaf in loaded.leaves:
        if leaf.name is None or leaf.dtype is None:
            continue
        meta = {
            "zarr_format": 3,
            "node_type": "array",
            **zarr_metadata(leaf),
            "fill_value": _fill_value(leaf.dtype),
        }
        refs[f"{leaf.name}/zarr.json"] = json.dumps(meta, sort_keys=True)
        for c in loaded.chunks.get(leaf.name, ()):
            address = c.address(loc, leaf.name)
            url = protocol.where(address.key)
            ref = [url] if address.whole else [url, address.offset, address.size]
            refs[f"{leaf.name}/{c.key}"] = ref
    return {"version": 1, "refs": refs}


def open_group(
    root: str | os.PathLike[str],
    step: int | None = None,
    *,
    endpoint: str | None = None,
    region: str | None = None,
) -> Any:
    """Opens a committed step's arrays as a read-only zarr-python group.

    The step is found through jaxckpt's commit markers (the newest committed
    one by default), so a partial save is never opened; then the data types
    are registered (:func:`register_dtypes`) and the step's ``arrays/`` group
    is opened, locally or through fsspec (gcsfs / s3fs). A packed step is
    opened through fsspec's ``ReferenceFileSystem`` over its
    :func:`reference_manifest` (each chunk a ranged read of its pack). Array
    names are the dotted tree paths (``params.dense.kernel``). zarr-python
    checks each chunk's CRC32C as it reads.

    Args:
      root: a local path, ``gs://bucket/prefix`` or ``s3://bucket/prefix``.
      step: the committed step; None opens the newest.
      endpoint: an S3-compatible endpoint or GCS emulator URL (default: from
        the environment, as for jaxckpt).
      region: the S3 region (s3fs's default otherwise).

    Returns:
      A ``zarr.Group``.

    Raises:
      NotACheckpointRootError / StepNotFoundError: no such root or committed step.
      ZarrUnavailableError: zarr, or gcsfs/s3fs for an object store, is missing.
    """
    protocol, marker = _committed(root, step, endpoint, region)
    zarr_arrays = step_format(p.layout for p in protocol.read_manifest(marker)).zarr_arrays
    register_dtypes()
    import zarr

    uri = protocol.where(marker.location.arrays_prefix).rstrip("/")
    url, storage_options = fsspec_url(uri, endpoint=endpoint, region=region)
    if not zarr_arrays:  # chunks are byte ranges: through a reference manifest
        from fsspec.implementations.reference import ReferenceFileSystem

        spec = reference_manifest(root, marker.step, endpoint=endpoint, region=region)
        protocol_name = _fsspec_protocol(uri)
        if protocol_name != "file":  # zarr drives fsspec asynchronously, as do s3fs/gcsfs
            storage_options = {**storage_options, "asynchronous": True}
        try:
            fs = ReferenceFileSystem(
                spec,
                remote_protocol=protocol_name,
                remote_options=storage_options,
                asynchronous=True,
            )
        except ImportError as e:
            raise ZarrUnavailableError(
                f"reading {url} with zarr-python needs gcsfs/s3fs: "
                f"pip install 'jaxckpt[zarr]' ({e})"
            ) from e
        store = zarr.storage.FsspecStore(fs=fs, path="", read_only=True)
        return zarr.open_group(store=store, mode="r")
    if not storage_options and "://" not in url:
        return zarr.open_group(store=zarr.storage.LocalStore(url, read_only=True), mode="r")
    try:
        store = zarr.storage.FsspecStore.from_url(
            url, storage_options=storage_options, read_only=True
        )
    except ImportError as e:
        raise ZarrUnavailableError(
            f"reading {url} with zarr-python needs gcsfs/s3fs: pip install 'jaxckpt[zarr]' ({e})"
        ) from e
    return zarr.open_group(store=store, mode="r")
