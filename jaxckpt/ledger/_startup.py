"""Startup: when this process started, and JAX's persistent compilation cache.

A restart's badput is not only the restore: importing the libraries and compiling the
step come first. The ledger records the process's start (from ``/proc`` on Linux), the
manager's open, the end of the restore and the first ``save`` call; the opt-in
``compilation_cache`` option points JAX's ``jax_compilation_cache_dir`` at a directory
beside the checkpoints, so a restarted job loads its compiled step instead of
compiling it again.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("jaxckpt")

CACHE_DIR = "compilation-cache"
"""The cache's directory inside the local tier (or a local root)."""
JAX_MIN_COMPILE_S = 1.0
"""JAX's default ``jax_persistent_cache_min_compile_time_secs``: programs that compile
faster are not cached."""
MIN_COMPILE_S = 0.0
"""What the cache takes instead (unless the job chose a threshold of its own): a restart
compiles every program again, and on a CPU most take well under a second each, while a
cache entry is one small local file read."""


def process_start_time() -> float | None:
    """Wall-clock time this process started (Linux ``/proc``; else None)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().decode()
        with open("/proc/stat", "rb") as f:
            boot = next(
                float(line.split()[1])
                for line in f.read().decode().splitlines()
                if line.startswith("btime ")
            )
        ticks = int(stat.rpartition(")")[2].split()[19])  # field 22: starttime
        start = boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    now = time.time()
    return start if 0 < start <= now else None


def cache_dir(root: str, local_root: str | None) -> str:
    """Where the compilation cache lives: in the local tier, else in a local root.

    Raises:
      ValueError: neither is a local directory (an object store is not a cache for
        compiled programs that every restart reads at once).
    """
    from jaxckpt.storage import parse_root

    for candidate in (local_root, root):
        if candidate is not None:
            parsed = parse_root(candidate)
            if parsed.scheme == "file":
                return os.path.join(parsed.path, CACHE_DIR)
    raise ValueError(
        f"compilation_cache needs a local_root or a local root; {root} is an object store"
    )


def enable_compilation_cache(directory: str) -> None:
    """Points JAX's persistent compilation cache at ``directory`` (created if missing) and
    caches every program (``MIN_COMPILE_S``), unless the job already chose a cache
    directory (or a threshold) of its own."""
    import jax

    current = getattr(jax.config, "jax_compilation_cache_dir", None)
    if current and os.path.abspath(current) != os.path.abspath(directory):
        log.info("compilation cache: keeping the job's own %s", current)
        return
    if current:
        return
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    threshold = getattr(jax.config, "jax_persistent_cache_min_compile_time_secs", None)
    if threshold == JAX_MIN_COMPILE_S:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    try:  # a program compiled before this point made JAX decide on no cache: decide again
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
    except (ImportError, AttributeError):  # pragma: no cover - another jax
        pass
    log.info("compilation cache in %s", directory)
