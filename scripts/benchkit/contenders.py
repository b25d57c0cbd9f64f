"""The contenders (raw disk, jaxckpt, Orbax) and the state they save. Child side."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from benchkit.common import LOWMEM_RESTORE_BYTES, PACKED_OPTIONS, WRITER_NICE, Case, MiB


def make_state(case: Case, seed: int = 0) -> dict[str, Any]:
    """``{"layer0000": array, ...}``: distinct, normally distributed, XLA-owned leaves."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = case.leaf_bytes // 4
    base = jnp.asarray(
        np.random.default_rng(seed).standard_normal(min(n, 16 * MiB), dtype=np.float32)
    )

    @jax.jit
    def leaf(base: Any, i: Any) -> Any:  # base as an argument: not baked into the program
        tiled = jnp.tile(base, -(-n // base.size))[:n]
        return tiled * (1.0 + i * 1e-3) + i * 1e-3

    state = {f"layer{i:04d}": leaf(base, jnp.float32(i)) for i in range(case.leaves)}
    return jax.block_until_ready(state)


def abstract_of(state: Any) -> Any:
    import jax

    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def _stored_bytes(files: list[str]) -> int:
    """Bytes of ``files``; one gone since the listing (a pending record that a
    committed save removes in the background) counts as 0."""
    total = 0
    for f in files:
        with contextlib.suppress(FileNotFoundError):
            total += os.path.getsize(f)
    return total


def _files_under(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]


class RawSaver:
    """The disk's limit: each leaf to its own file, written and fsync'd in turn."""

    def __init__(self, root: str) -> None:
        self._root = root
        os.makedirs(root, exist_ok=True)

    def save(self, step: int, state: dict[str, Any]) -> None:
        import numpy as np

        folder = os.path.join(self._root, str(step))
        os.makedirs(folder)
        for name, value in state.items():
            data = np.ascontiguousarray(np.asarray(value)).data.cast("B")
            fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                while data:
                    data = data[os.write(fd, data) :]
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(folder)
        _fsync_dir(self._root)

    def wait(self) -> None:
        pass

    def restore(self, step: int, abstract: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        out = {}
        for name, spec in abstract.items():
            array = np.empty(spec.shape, spec.dtype)
            view = array.data.cast("B")
            with open(os.path.join(self._root, str(step), name), "rb", buffering=0) as f:
                while view:
                    view = view[f.readinto(view) :]
            out[name] = array
        return out

    def files(self) -> list[str]:
        return _files_under(self._root)

    def close(self) -> None:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JaxckptSaver:
    """jaxckpt.CheckpointManager, with the bench's options."""

    def __init__(
        self, root: str, options: dict[str, Any], store_options: dict[str, Any] | None = None
    ) -> None:
        import jaxckpt

        self._root = root
        if "://" in root:  # the bench's storage_options are local-disk options
            options = {k: v for k, v in options.items() if k != "storage_options"}
            if store_options:
                options["storage_options"] = store_options
        self._m = jaxckpt.CheckpointManager(root, **options)

    def save(self, step: int, state: Any) -> None:
        self._m.save(step, state)

    def wait(self) -> None:
        self._m.wait()

    def restore(self, step: int, abstract: Any) -> Any:
        return self._m.restore(step, target=abstract)

    def files(self) -> list[str]:
        return [] if "://" in self._root else _files_under(self._root)

    def close(self) -> None:
        self._m.close()


class OrbaxSaver:
    """``ocp.CheckpointManager`` with default options and ``StandardSave``."""

    def __init__(self, root: str) -> None:
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self._root = root
        self._m = ocp.CheckpointManager(root)

    def save(self, step: int, state: Any) -> None:
        self._m.save(step, args=self._ocp.args.StandardSave(state))

    def wait(self) -> None:
        self._m.wait_until_finished()

    def restore(self, step: int, abstract: Any) -> Any:
        return self._m.restore(step, args=self._ocp.args.StandardRestore(abstract))

    def files(self) -> list[str]:
        return [] if "://" in self._root else _files_under(self._root)

    def close(self) -> None:
        self._m.close()


class BackgroundRawSaver(RawSaver):
    """The raw writer on a background thread: the floor for an async save's overhead."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._save, args=(step, state), daemon=True)
        self._thread.start()

    def _save(self, step: int, state: dict[str, Any]) -> None:
        try:
            super().save(step, state)
        except BaseException as e:
            self._error = e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error


class RawKvSaver:
    """An object store's limit: each leaf one object, every request in flight at once.

    Plain TensorStore kvstore writes and reads of the same bytes, with the same
    request concurrency as jaxckpt's default (``request_concurrency``).
    """

    def __init__(self, root: str, concurrency: int = 32) -> None:
        import tensorstore as ts

        scheme, _, rest = root.partition("://")
        bucket, _, prefix = rest.partition("/")
        driver = "gcs" if scheme == "gs" else "s3"
        spec: dict[str, Any] = {"driver": driver, "bucket": bucket, "path": prefix + "/"}
        if driver == "s3":
            spec["aws_region"] = "us-east-1"
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                spec["endpoint"] = endpoint.rstrip("/")
        context = ts.Context({f"{driver}_request_concurrency": {"limit": concurrency}})
        self._kv = ts.KvStore.open(spec, context=context).result()

    def save(self, step: int, state: dict[str, Any]) -> None:
        import numpy as np

        futures = [
            self._kv.write(f"{step}/{name}", np.ascontiguousarray(np.asarray(value)).tobytes())
            for name, value in state.items()
        ]
        for future in futures:
            future.result()

    def wait(self) -> None:
        pass

    def restore(self, step: int, abstract: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        futures = {name: self._kv.read(f"{step}/{name}") for name in abstract}
        out = {}
        for name, spec in abstract.items():
            data = futures.pop(name).result().value
            out[name] = np.frombuffer(data, spec.dtype).reshape(spec.shape)
        return out

    def files(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


def open_saver(spec: dict[str, Any]) -> Any:
    contender, root = spec["contender"], spec["root"]
    if contender.startswith("raw-"):
        return RawKvSaver(root)
    if contender == "raw":
        return BackgroundRawSaver(root) if spec["phase"] == "loop" else RawSaver(root)
    if contender.startswith("jaxckpt"):
        if contender.endswith("-lowmem"):
            options = {**spec["jaxckpt_options"], "restore_memory_bytes": LOWMEM_RESTORE_BYTES}
            return JaxckptSaver(root, options)
        if contender.endswith("-ts"):
            return JaxckptSaver(root, spec["jaxckpt_options"], {"direct_reads": False})
        if contender.endswith("-nice"):
            return JaxckptSaver(root, {**spec["jaxckpt_options"], "writer_nice": WRITER_NICE})
        if contender.endswith("-packed"):
            return JaxckptSaver(root, {**spec["jaxckpt_options"], **PACKED_OPTIONS})
        return JaxckptSaver(root, spec["jaxckpt_options"])
    if contender.startswith("orbax"):
        return OrbaxSaver(root)
    raise ValueError(f"unknown contender {contender!r}")
