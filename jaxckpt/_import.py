"""Importing foreign checkpoints into a new step of a jaxckpt root.

Two sources: safetensors (one file, a Hugging Face shard set with its index, or
a directory of them) and Orbax checkpoints (a ``CheckpointManager`` directory,
one of its step directories, or one item directory). The imported tree is
saved through :class:`jaxckpt.CheckpointManager`, so the new step is committed
by the same protocol as any save, with every chunk checksummed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxckpt._safetensors import read_safetensors, tree_from_names
from jaxckpt.errors import CheckpointError, StepAlreadyExistsError

__all__ = ["ImportResult", "import_orbax", "import_safetensors"]


class ImportSourceError(CheckpointError, ValueError):
    """The import source is not a checkpoint jaxckpt can read.

    The message names the path and what was expected. Point the import at a
    ``.safetensors`` file, a shard index, or an Orbax checkpoint directory.
    """


@dataclass(frozen=True, kw_only=True)
class ImportResult:
    """What an import committed: the root, the step, how many arrays and bytes."""

    root: str
    step: int
    arrays: int
    nbytes: int


def _save(
    root: str | os.PathLike[str],
    step: int | None,
    tree: Any,
    source: str,
    storage_options: dict[str, Any],
) -> ImportResult:
    from jaxckpt import CheckpointManager

    leaves = [x for x in _leaves(tree) if isinstance(x, np.ndarray | np.generic)]
    with CheckpointManager(root, storage_options=storage_options) as mgr:
        steps = mgr.steps()
        if step is None:
            step = steps[-1] + 1 if steps else 0
        elif step in steps:
            raise StepAlreadyExistsError(
                f"step {step} already exists under {mgr.root}; import into another step"
            )
        mgr.save(step, tree, force=True, metadata={"imported_from": source})
        mgr.wait()
        uri = mgr.root
    return ImportResult(
        root=uri, step=step, arrays=len(leaves), nbytes=sum(int(x.nbytes) for x in leaves)
    )


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [y for v in tree.values() for y in _leaves(v)]
    if isinstance(tree, list | tuple):
        return [y for v in tree for y in _leaves(v)]
    return [tree]


def import_safetensors(
    src: str | os.PathLike[str],
    root: str | os.PathLike[str],
    *,
    step: int | None = None,
    **storage_options: Any,
) -> ImportResult:
    """Saves the tensors of a safetensors file or shard set as a new committed step.

    Dotted tensor names become nested dicts (``a.b.c`` -> ``{"a": {"b": {"c": ...}}}``),
    so a checkpoint exported by ``jaxckpt export`` comes back with its dict nesting
    (list indices come back as dict keys ``"0"``, ``"1"``, ...). The files are
    memory-mapped; the save copies each tensor once into host memory.

    Args:
      src: a ``.safetensors`` file, a ``model.safetensors.index.json``, or a
        directory holding either.
      root: the jaxckpt root (created if needed; local, ``gs://``, ``s3://``).
      step: the new step; None takes the newest committed step + 1 (0 on an empty root).

    Raises:
      SafetensorsFormatError: a malformed file (names the file and tensor).
      StepAlreadyExistsError: ``step`` is already committed under ``root``.
    """
    src = os.fspath(src)
    if not os.path.exists(src):
        raise ImportSourceError(f"{src} does not exist")
    tree = tree_from_names(list(read_safetensors(src)))
    return _save(root, step, tree, f"safetensors:{os.path.abspath(src)}", storage_options)


def _orbax_item(path: str) -> tuple[str, int | None]:
    """The item directory to restore and the step its path names, if any."""

    def is_item(p: str) -> bool:
        return os.path.exists(os.path.join(p, "_METADATA")) or os.path.exists(
            os.path.join(p, "manifest.ocdbt")
        )

    def step_of(p: str) -> int | None:
        name = os.path.basename(os.path.normpath(p))
        return int(name) if name.isdigit() else None

    if not os.path.isdir(path):
        raise ImportSourceError(f"{path} is not a directory (expected an Orbax checkpoint)")
    if is_item(path):
        parent = os.path.dirname(os.path.normpath(path))
        return path, step_of(path) if step_of(path) is not None else step_of(parent)
    entries = sorted(os.listdir(path))
    items = [e for e in entries if is_item(os.path.join(path, e))]
    if items:  # a step directory holding one or more items
        chosen = "default" if "default" in items else items[0]
        if len(items) > 1 and "default" not in items:
            raise ImportSourceError(
                f"{path} holds several Orbax items ({', '.join(items)}); name one of them"
            )
        return os.path.join(path, chosen), step_of(path)
    steps = [int(e) for e in entries if e.isdigit() and os.path.isdir(os.path.join(path, e))]
    if steps:  # a CheckpointManager directory: its newest step
        return _orbax_item(os.path.join(path, str(max(steps))))
    raise ImportSourceError(
        f"{path} is not an Orbax checkpoint (no _METADATA, item directory or step directory)"
    )


def import_orbax(
    src: str | os.PathLike[str],
    root: str | os.PathLike[str],
    *,
    step: int | None = None,
    log: Callable[[str], None] | None = None,
    **storage_options: Any,
) -> ImportResult:
    """Saves an Orbax PyTree/StandardSave checkpoint as a new committed step.

    Arrays are restored to host memory (numpy) with Orbax's own reader, keeping
    their dtypes (bfloat16 included); scalars saved by Orbax come back as Python
    values.

    Args:
      src: an Orbax ``CheckpointManager`` directory (its newest step is
        imported), one step directory (``.../1000``; the ``default`` item), or
        an item directory.
      root: the jaxckpt root (created if needed).
      step: the new step; None takes the Orbax step number when the path names
        one, else the newest committed step + 1.
      log: called with a one-line description of what is imported.

    Raises:
      ImportSourceError: ``src`` is not an Orbax checkpoint.
      StepAlreadyExistsError: the step is already committed under ``root``.
    """
    import jax
    import orbax.checkpoint as ocp

    item, orbax_step = _orbax_item(os.fspath(src))
    if log is not None:
        log(f"importing Orbax item {item}")
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        metadata = checkpointer.metadata(item)
        tree_meta = getattr(getattr(metadata, "item_metadata", None), "tree", None)
        if tree_meta is None:
            tree_meta = getattr(metadata, "tree", metadata)
        scalars = jax.tree.map(lambda m: type(m).__name__ == "ScalarMetadata", tree_meta)
        args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), tree_meta)
        restored = checkpointer.restore(item, args=ocp.args.PyTreeRestore(restore_args=args))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ImportSourceError(f"cannot read Orbax checkpoint {item}: {e}") from e
    finally:
        checkpointer.close()
    tree = jax.tree.map(
        lambda x, is_scalar: x.item() if is_scalar and np.ndim(x) == 0 else np.asarray(x),
        restored,
        scalars,
    )
    target = step if step is not None else orbax_step
    return _save(root, target, tree, f"orbax:{os.path.abspath(item)}", storage_options)
