"""Where a restore target puts each array: its sharding, resolved and checked up front.

* Abstract targets (``jax.eval_shape`` / ``nnx.eval_shape`` under ``jax.set_mesh``)
  carry shardings on an ``AbstractMesh``: they are resolved against the mesh
  that is set when ``restore`` runs (the same axis names and sizes), else refused.
* A typed PRNG key's sharding may be written for its key data (a rank-0 key
  created under a 1x1 mesh carries ``P(None,)``): the key data is placed, then wrapped.
* An uncommitted target (a plain ``jnp`` array, or a ``ShapeDtypeStruct``
  without a sharding) gives an uncommitted array on the default device, as
  ``jnp.asarray`` would, so later computations may move it.
* Any other sharding that does not fit the saved array is a
  ``TreeMismatchError`` naming the tree path and the sharding, before anything is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxckpt.errors import TreeMismatchError
from jaxckpt.records import SavedLeaf

__all__ = [
    "concrete_targets",
    "keep_weak_type",
    "place_keys",
    "resolve_targets",
    "target_sharding",
    "uncommitted",
]


def uncommitted(target: Any) -> bool:
    """Whether ``target`` asks for an uncommitted array on the default device."""
    if isinstance(target, jax.ShapeDtypeStruct):
        return target.sharding is None
    return isinstance(target, jax.Array) and not target.committed


def target_sharding(target: Any) -> jax.sharding.Sharding | None:
    """The sharding a restored leaf gets (None: a numpy array)."""
    if isinstance(target, jax.Array):
        return target.sharding
    if isinstance(target, jax.ShapeDtypeStruct):
        return target.sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return None


def _concrete(path: str, sharding: Any) -> Any:
    """``sharding`` with an ``AbstractMesh`` resolved against the mesh set now."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    if not isinstance(sharding.mesh, jax.sharding.AbstractMesh):
        return sharding
    mesh = jax.sharding.get_mesh()
    if mesh.empty:
        raise TreeMismatchError(
            f"restore target leaf {path} has a sharding on an abstract mesh ({sharding}) and "
            "no mesh is set: call restore inside `with jax.set_mesh(mesh):`, the mesh the "
            "target was traced under"
        )
    if mesh.abstract_mesh.shape_tuple != sharding.mesh.shape_tuple:
        raise TreeMismatchError(
            f"restore target leaf {path} has a sharding on an abstract mesh "
            f"{dict(sharding.mesh.shape)}, but the mesh set now is {dict(mesh.shape)}: "
            "restore under the mesh the target was traced under"
        )
    return jax.sharding.NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def concrete_targets(targets: Any) -> Any:
    """A pytree of targets with every abstract-mesh sharding resolved (for readers, such
    as Orbax's, that need a concrete mesh); see :func:`resolve_targets` for the rules."""

    def one(path: Any, target: Any) -> Any:
        sharding = getattr(target, "sharding", None)
        if not isinstance(target, jax.ShapeDtypeStruct) or sharding is None:
            return target
        concrete = _concrete(jax.tree_util.keystr(path), sharding)
        if concrete is sharding:
            return target
        return jax.ShapeDtypeStruct(
            target.shape, target.dtype, sharding=concrete, weak_type=target.weak_type
        )

    return jax.tree_util.tree_map_with_path(one, targets)


def _key_shape(leaf: SavedLeaf) -> tuple[int, ...]:
    """A key leaf's key shape (its saved shape is the key data's: one more axis)."""
    return tuple(leaf.shape[:-1])


def _check(path: str, leaf: SavedLeaf, sharding: Any) -> None:
    """Refuses a sharding that cannot hold the saved array, naming the path and sharding."""
    shapes = [leaf.shape] if leaf.kind != "key" else [_key_shape(leaf), leaf.shape]
    error: Exception | None = None
    for shape in shapes:
        try:
            sharding.shard_shape(shape)
            return
        except Exception as e:  # JAX raises ValueError, TypeError, ...
            error = error or e
    saved = f"{'key ' if leaf.kind == 'key' else ''}{shapes[0]} {leaf.dtype}"
    raise TreeMismatchError(
        f"restore target leaf {path}: its sharding {sharding} does not fit the saved "
        f"array {saved}: {error}"
    )


def resolve_targets(
    paths: Sequence[str], leaves: Sequence[SavedLeaf], targets: Sequence[Any]
) -> list[Any]:
    """The targets with abstract-mesh shardings made concrete, every sharding checked.

    Raises:
      TreeMismatchError: a sharding on an abstract mesh with no (or another) mesh
        set, or a sharding that does not fit the saved array; naming the path.
    """
    out = []
    for path, leaf, target in zip(paths, leaves, targets, strict=True):
        sharding = getattr(target, "sharding", None)
        if isinstance(target, jax.ShapeDtypeStruct) and sharding is not None:
            concrete = _concrete(path, sharding)
            if concrete is not sharding:
                target = jax.ShapeDtypeStruct(
                    target.shape, target.dtype, sharding=concrete, weak_type=target.weak_type
                )
        if leaf.kind != "value" and leaf.name is not None and sharding is not None:
            _check(path, leaf, target_sharding(target))
        out.append(target)
    return out


def place_keys(leaf: SavedLeaf, target: Any, data: np.ndarray) -> jax.Array:
    """A key leaf from its key data, placed as ``target`` asks."""
    sharding = target_sharding(target)
    if sharding is None or uncommitted(target):
        return jax.random.wrap_key_data(jax.numpy.asarray(data), impl=leaf.key_impl)
    if len(getattr(sharding, "spec", ())) > len(_key_shape(leaf)):  # written for the key data
        return jax.random.wrap_key_data(jax.device_put(data, sharding), impl=leaf.key_impl)
    keys = jax.random.wrap_key_data(jax.numpy.asarray(data), impl=leaf.key_impl)
    return jax.device_put(keys, sharding)


def keep_weak_type(target: Any, value: Any) -> Any:
    """``value`` weakly typed when ``target`` is (a ``jax.Array`` or ``ShapeDtypeStruct``
    from a Python scalar, e.g. ``jax.eval_shape`` of a state with a float in it).

    A strongly typed array in its place changes type promotion (a bfloat16 times a weak
    float32 stays bfloat16; times a strong one it becomes float32), so the resumed run
    would compute something else, and a jitted step compiled for the weak type compiles
    again. The same buffers, no copy and no computation.
    """
    if not getattr(target, "weak_type", False) or not isinstance(value, jax.Array):
        return value
    if (
        value.weak_type
        or value.dtype != target.dtype
        or jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
    ):
        return value
    from jax._src import array, core  # no public constructor takes a weak type

    aval = core.ShapedArray(value.shape, value.dtype, weak_type=True)
    pieces = [shard.data for shard in value.addressable_shards]  # the buffers, in order
    return array.ArrayImpl(aval, value.sharding, pieces, committed=value.committed)
