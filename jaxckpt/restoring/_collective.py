"""The collective of the read-once exchange (:mod:`jaxckpt.restoring._readonce`): one
jitted function that turns every shared leaf's stream (its chunks in grid order, split
over the target's devices) into the array laid out as targeted, run with a deadline.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax

from jaxckpt.errors import CheckpointError

if TYPE_CHECKING:
    from jaxckpt.restoring._readonce import SharedLeaf


@dataclass(frozen=True)
class _Meta:
    size: int
    shape: tuple[int, ...]
    chunk: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, s: SharedLeaf) -> _Meta:
        return cls(s.size, tuple(s.leaf.shape), tuple(s.leaf.chunk_shape), s.dtype.name)


@functools.lru_cache(maxsize=32)
def _reassemble(metas: tuple[_Meta, ...], shardings: tuple[Any, ...]) -> Any:
    """One jitted function: streams (in chunk-grid order) to arrays, laid out as targeted."""

    def reassemble(*streams: jax.Array) -> tuple[jax.Array, ...]:
        out = []
        for meta, stream in zip(metas, streams, strict=True):
            rank = len(meta.shape)
            grid = [d // c for d, c in zip(meta.shape, meta.chunk, strict=True)]
            x = stream[: meta.size].reshape(*grid, *meta.chunk)
            x = x.transpose([i for a in range(rank) for i in (a, rank + a)])
            out.append(x.reshape(meta.shape).astype(meta.dtype))
        return tuple(out)

    return jax.jit(reassemble, out_shardings=shardings)


def _collective(fn: Any, inputs: list[jax.Array], timeout_s: float, what: str) -> Any:
    """Runs the jitted exchange on a helper thread; raises instead of hanging on a dead peer.

    JAX cannot cancel a collective: after a timeout the (daemon) thread stays
    blocked in it, and the process should exit rather than go on.
    """
    box: list[Any] = []

    def work() -> None:
        try:
            results = fn(*inputs)
            for r in results:
                r.block_until_ready()
            box.append(results)
        except BaseException as e:  # handed to the waiting thread
            box.append(e)

    thread = threading.Thread(target=work, name="jaxckpt-exchange", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CheckpointError(
            f"{what}: the collective did not finish within {timeout_s:.0f}s "
            "(a peer process is dead or stalled)"
        )
    (result,) = box
    if isinstance(result, BaseException):
        raise CheckpointError(f"{what}: the exchange failed: {result}") from result
    return result
