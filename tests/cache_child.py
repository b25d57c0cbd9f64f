"""A restarted job's step: opens a manager with ``compilation_cache=True`` on ROOT, then
jits and runs a small step, printing ``CACHE hits=H misses=M`` (JAX's persistent cache
events while the step compiled) and ``DONE``.

Usage: ``python tests/cache_child.py ROOT``
"""

from __future__ import annotations

import collections
import sys

import jax
import jax.numpy as jnp

import jaxckpt


def main() -> int:
    events: collections.Counter[str] = collections.Counter()
    jax.monitoring.register_event_listener(lambda name, **kw: events.update([name]))
    with jaxckpt.CheckpointManager(sys.argv[1], compilation_cache=True):
        before = events.copy()

        @jax.jit
        def step(w: jax.Array, x: jax.Array) -> jax.Array:
            return jnp.tanh(x @ w) @ w.T

        jax.block_until_ready(step(jnp.ones((16, 16)), jnp.ones((4, 16))))
        seen = events - before
    hits = seen["/jax/compilation_cache/cache_hits"]
    misses = seen["/jax/compilation_cache/cache_misses"]
    print(f"CACHE hits={hits} misses={misses}", flush=True)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
