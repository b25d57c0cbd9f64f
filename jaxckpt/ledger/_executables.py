"""Compiled steps kept in the local tier, one per process: a restart loads its step
instead of compiling it again (``CheckpointManager.compile``).

JAX's persistent compilation cache writes its entries from process 0 alone, and on a
CPU each process's programs have keys of their own, so in a job of several processes it
serves process 0 only, while the step's first collective waits for every other
process's compile. :class:`ExecutableCache` keeps this process's own executable
(``jax.experimental.serialize_executable``) in ``compilation-cache/executables/`` of the
local tier, under a key of everything the executable depends on (:func:`executable_key`):
the lowered program and its argument trees, this process and the devices, JAX's and
jaxlib's versions, the backend and its version, and the XLA flags.

A file that fails to load (torn, damaged, from another build) is compiled again and
replaced; no failure here raises (each is logged and counted): it costs a compile.
Loading an executable runs code from the file, which is the trust JAX's own cache
directory asks too: the file lies in this node's local tier, written by this job.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
from typing import Any

log = logging.getLogger("jaxckpt")

SUBDIR = "executables"
"""Inside the compilation cache's directory."""
MAGIC = b"jaxckpt-executable 1\n"
MAX_BYTES = 4 << 30
"""A larger file is not read (what is read from storage is checked before use)."""
KEEP = 4
"""Executables kept per process (the newest used); older ones are deleted."""


def executable_key(lowered: Any) -> str:
    """What this process's executable of ``lowered`` depends on, hashed."""
    import jax
    import jaxlib

    devices = jax.devices()
    client = devices[0].client
    parts = [
        lowered.as_text(),
        str(lowered.in_tree),
        str(lowered.out_tree),
        jax.__version__,
        jaxlib.__version__,
        client.platform,
        client.platform_version,
        f"{jax.process_index()}/{jax.process_count()}",
        repr([(d.id, d.process_index, d.device_kind) for d in devices]),
        os.environ.get("XLA_FLAGS", ""),
        os.environ.get("LIBTPU_INIT_ARGS", ""),
    ]
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


class ExecutableCache:
    """This process's compiled steps in ``directory`` (see the module docstring).

    Attributes:
      loaded: steps loaded from the cache.
      compiled: steps compiled (not in the cache, or it failed to load).
      failures: files that failed to load or to be written (each logged).
      outcome: the last compile's: ``loaded``, ``compiled`` (none kept) or
        ``recompiled`` (the kept one failed to load); None before the first.
    """

    def __init__(self, directory: str) -> None:
        self.directory = os.path.join(directory, SUBDIR)
        self.loaded = self.compiled = self.failures = 0
        self.outcome: str | None = None

    def compile(self, lowered: Any) -> Any:
        """``lowered.compile()``, or the executable this process kept of it."""
        import jax

        if not isinstance(lowered, jax.stages.Lowered):
            raise TypeError(
                f"compile() takes a jax.stages.Lowered (jax.jit(f).lower(...)), "
                f"not {type(lowered).__name__}"
            )
        began = time.monotonic()
        mine = f"p{jax.process_index()}-"  # this process's files
        path = os.path.join(self.directory, mine + executable_key(lowered)[:40])
        failed = self.failures
        compiled = self._load(path, lowered)
        if compiled is not None:
            self.loaded += 1
            self.outcome = "loaded"
            log.info("compiled step loaded from %s in %.2fs", path, time.monotonic() - began)
            with contextlib.suppress(OSError):
                os.utime(path)  # the newest used is kept
            return compiled
        compiled = lowered.compile()
        self.compiled += 1
        self.outcome = "recompiled" if self.failures > failed else "compiled"
        self._store(path, compiled, mine)
        return compiled

    def _load(self, path: str, lowered: Any) -> Any:
        from jax.experimental import serialize_executable

        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return None
        except OSError as e:
            return self._failed("cannot read", path, e, " (compiling it)")
        if size > MAX_BYTES:
            too_big = ValueError(f"{size} bytes > {MAX_BYTES}")
            return self._failed("cannot read", path, too_big, " (compiling it)")
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_BYTES + 1)
            head, digest = data[: len(MAGIC)], data[len(MAGIC) : len(MAGIC) + 32]
            payload = data[len(MAGIC) + 32 :]
            if head != MAGIC or hashlib.sha256(payload).digest() != digest:
                raise ValueError("not a whole executable written by jaxckpt (torn or damaged)")
            return serialize_executable.deserialize_and_load(
                payload, lowered.in_tree, lowered.out_tree
            )
        except Exception as e:  # compiled again and replaced
            return self._failed("cannot load", path, e, " (compiling it)")

    def _store(self, path: str, compiled: Any, mine: str) -> None:
        from jax.experimental import serialize_executable

        tmp = None
        try:
            payload, _, _ = serialize_executable.serialize(compiled)
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + hashlib.sha256(payload).digest() + payload)
            os.replace(tmp, path)
            tmp = None
            self._prune(mine)
        except Exception as e:  # the next run compiles again
            self._failed("cannot keep", path, e, "")
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _prune(self, mine: str) -> None:
        """Deletes this process's executables (names starting ``mine``) past the
        :data:`KEEP` newest used."""
        with os.scandir(self.directory) as entries:
            kept = [e for e in entries if e.name.startswith(mine) and e.is_file()]
        kept.sort(key=lambda e: e.stat().st_mtime, reverse=True)
        for old in kept[KEEP:]:
            with contextlib.suppress(OSError):
                os.unlink(old.path)

    def _failed(self, what: str, path: str, error: BaseException, then: str) -> None:
        self.failures += 1
        log.warning("compilation cache: %s the compiled step %s%s: %s", what, path, then, error)
