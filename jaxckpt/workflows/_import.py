"""Importing foreign checkpoints into new steps of a jaxckpt root.

Two sources: safetensors (one file, a Hugging Face shard set with its index, or
a directory of them, here) and Orbax checkpoints (:mod:`jaxckpt.workflows._orbax_import`).
An imported tree is saved through :class:`jaxckpt.CheckpointManager`, so each
new step is committed by the same protocol as any save, with every chunk
checksummed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxckpt.errors import CheckpointError, StepAlreadyExistsError
from jaxckpt.tools import read_safetensors, tree_from_names

__all__ = ["ImportResult", "ImportSourceError", "import_safetensors"]


class ImportSourceError(CheckpointError, ValueError):
    """The import source is not a checkpoint jaxckpt can read.

    The message names the path and what was expected. Point the import at a
    ``.safetensors`` file, a shard index, or an Orbax checkpoint directory; an
    Orbax item jaxckpt cannot store is named, and ``skip_items`` (``jaxckpt
    import --skip-item``) leaves it out.
    """


@dataclass(frozen=True, kw_only=True)
class ImportResult:
    """What an import committed: the root, the step, how many arrays and bytes."""

    root: str
    step: int
    arrays: int
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Imported:
    """One step to commit: its tree and what is stored beside it."""

    tree: Any
    source: str
    metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] | None = None
    process_state: Any = None


def commit_imports(
    root: Any,
    steps: Sequence[int | None],
    load: Callable[[int], Imported],
    storage_options: dict[str, Any],
) -> list[ImportResult]:
    """Saves ``load(i)`` as ``steps[i]`` (None: the newest + 1), one step at a time.

    ``root`` is a root URI or path, or an open :class:`~jaxckpt.CheckpointManager`
    (the import then saves through it). The first step is loaded before anything is
    written; every step is checked to be free before the first save; each is
    committed (and its tree released) before the next is loaded. All or nothing: a
    failure removes what the import made (:class:`~jaxckpt.workflows._import_dest.Destination`).
    """
    from jaxckpt._manager import CheckpointManager
    from jaxckpt.workflows._import_dest import Destination

    if isinstance(root, CheckpointManager):
        return _commit(root, steps, load, None, None)
    dest = Destination.note(root, storage_options)
    first = load(0)  # the source is read before the destination is touched
    committed: list[int] = []
    try:
        with CheckpointManager(root, storage_options=storage_options) as mgr:
            try:
                return _commit(mgr, steps, load, first, committed)
            except BaseException:
                if dest.is_root:
                    dest.undo(lambda s: _delete_quietly(mgr, s), committed)
                raise
    except BaseException:
        if not dest.is_root:
            dest.undo(lambda _: None, committed)
        raise


def _commit(
    mgr: Any,
    steps: Sequence[int | None],
    load: Callable[[int], Imported],
    first: Imported | None,
    committed: list[int] | None,
) -> list[ImportResult]:
    import jax

    committed = [] if committed is None else committed
    existing = set(mgr.steps())
    taken = sorted({s for s in steps if s is not None} & existing)
    if taken:
        others = f" (and {len(taken) - 1} more of the steps to import)" if len(taken) > 1 else ""
        raise StepAlreadyExistsError(
            f"step {taken[0]} already exists under {mgr.root}{others}; import into another "
            "step or root"
        )
    results = []
    try:
        for i, wanted in enumerate(steps):
            step = wanted if wanted is not None else max(existing, default=-1) + 1
            item = first if i == 0 and first is not None else load(i)
            extra = {} if item.process_state is None else {"process_state": item.process_state}
            metadata = {"imported_from": item.source, **item.metadata}
            mgr.save(step, item.tree, force=True, metadata=metadata, metrics=item.metrics, **extra)
            committed.append(step)  # from here a failure removes it
            mgr.wait()
            existing.add(step)
            arrays = [x for x in jax.tree.leaves(item.tree) if hasattr(x, "dtype")]
            nbytes = sum(int(getattr(x, "nbytes", 0)) for x in arrays)
            results.append(
                ImportResult(root=mgr.root, step=step, arrays=len(arrays), nbytes=nbytes)
            )
    except BaseException:
        if first is None:  # through the caller's manager: remove the steps this import made
            for step in committed:
                _delete_quietly(mgr, step)
        raise
    return results


def _delete_quietly(mgr: Any, step: int) -> None:
    with contextlib.suppress(CheckpointError):  # never committed: nothing to remove
        mgr.delete(step)


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
    imported = Imported(tree=tree, source=f"safetensors:{os.path.abspath(src)}")
    return commit_imports(root, [step], lambda _: imported, storage_options)[0]
