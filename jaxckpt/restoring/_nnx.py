"""Flax NNX adapter for the resume pre-flight (needs the ``[flax]`` extra)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def nnx_step_fn(graphdef: Any, train_step: Callable[..., Any]) -> Callable[[Any, Any], Any]:
    """Adapts a Flax NNX train step, which updates modules in place, to ``step_fn(state, batch)``.

    ``train_step(*objects, batch)`` is typically an ``nnx.jit`` function; ``objects``
    are ``nnx.merge(graphdef, state)`` (a tuple such as ``(model, optimizer)`` is passed
    as separate arguments). The returned function gives ``(nnx.state(objects), aux)``
    with ``aux`` whatever ``train_step`` returned (e.g. the loss)::

        graphdef, state = nnx.split((model, optimizer))
        report = jaxckpt.check_resume(jaxckpt.nnx_step_fn(graphdef, train_step), state, batches)
    """
    try:
        from flax import nnx
    except ImportError as e:
        raise ImportError(
            "jaxckpt.nnx_step_fn needs Flax: pip install 'jaxckpt[flax]' (or pip install flax)"
        ) from e

    def step_fn(state: Any, batch: Any) -> tuple[Any, Any]:
        objects = nnx.merge(graphdef, state)
        args = objects if isinstance(objects, tuple) else (objects,)
        aux = train_step(*args, batch)
        return nnx.state(objects), aux

    return step_fn
