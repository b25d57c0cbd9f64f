"""Orbax checkpoints into jaxckpt steps, keeping Orbax's step numbers.

Each chosen step is read with Orbax itself and committed as the same step of a
jaxckpt root. With a ``target`` Orbax restores into it (a Flax ``TrainState``,
an NNX state, ...), so the imported step restores into that target with
jaxckpt too; without one, arrays come back as numpy in the saved nesting.

No item of a step is dropped silently: PyTree items are the state (one item is
the state itself, several are a dict by item name), a JSON item goes into the
step's metadata, a data-iterator item (grain's) becomes the step's
``process_state``, and any other item is refused by name unless ``skip_items``
names it (the skip is recorded in the step's metadata).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxckpt.errors import TreeMismatchError
from jaxckpt.restoring import concrete_targets
from jaxckpt.workflows._import import Imported, ImportResult, ImportSourceError, commit_imports
from jaxckpt.workflows._import_checks import (
    check_claims,
    check_links,
    check_step_number,
    host_memory,
)
from jaxckpt.workflows._orbax_layout import OrbaxItem, OrbaxStep, choose, read_json, read_source

if TYPE_CHECKING:
    from jaxckpt import CheckpointManager

__all__ = ["import_orbax"]

_MAX_MESSAGE = 1500  # Orbax's tree-mismatch messages list every path


@dataclass(frozen=True, kw_only=True)
class _Plan:
    """What one step's items become: state, metadata, process state, or skipped."""

    step: OrbaxStep
    trees: tuple[OrbaxItem, ...]
    json: tuple[OrbaxItem, ...]
    data_iter: OrbaxItem | None
    skipped: tuple[str, ...]


def _check_data_iter(step: OrbaxStep, item: OrbaxItem) -> None:
    files = sorted(f for f in os.listdir(item.path) if f.endswith(".json"))
    skip = f"pass skip_items=({item.name!r},) (jaxckpt import --skip-item {item.name})"
    if files != ["process_0-of-1.json"]:
        raise ImportSourceError(
            f"{item.path}: item {item.label} holds the data-iterator state of "
            f"{len(files)} processes ({', '.join(files[:4]) or 'no process_<i>-of-<n>.json'}); "
            f"an import runs in one process and takes a one-process state only: {skip} "
            f"to import step {step.step} without it"
        )


def _item_target(trees: tuple[OrbaxItem, ...], item: OrbaxItem, target: Any) -> Any:
    """The target of one PyTree item: the whole target, or its entry by item name."""
    return target if target is None or len(trees) == 1 else target[item.name]


def _plan(
    step: OrbaxStep, skip_items: Collection[str], target: Any, allow_lossy: bool, bound: int
) -> _Plan:
    """Sorts the step's items; refuses (naming the item) what cannot be imported, and what
    claims more than ``bound`` bytes, from the metadata alone (no array is read)."""
    kept = [i for i in step.items if i.name is None or i.name not in skip_items]
    skipped = tuple(sorted(i.name for i in step.items if i.name is not None and i not in kept))
    for item in kept:
        if item.kind == "other":
            raise ImportSourceError(
                f"{step.path}: item {item.label} ({item.handler or 'an unknown format'}) is "
                "neither a PyTree, a JSON item nor a data-iterator state, and jaxckpt cannot "
                f"import it: pass skip_items=({item.name!r},) (jaxckpt import --skip-item "
                f"{item.name}) to import step {step.step} without it"
            )
    trees = tuple(i for i in kept if i.kind == "tree")
    iters = [i for i in kept if i.kind == "data_iter"]
    if not trees:
        raise ImportSourceError(f"{step.path}: step {step.step} holds no PyTree item to import")
    if len(iters) > 1:
        names = ", ".join(i.label for i in iters)
        raise ImportSourceError(
            f"{step.path}: items {names} are all data-iterator states; skip all but one"
        )
    for item in iters:
        _check_data_iter(step, item)
    if target is not None and len(trees) > 1:
        items = sorted(str(i.name) for i in trees)
        if not isinstance(target, Mapping) or sorted(target) != items:
            raise TreeMismatchError(
                f"{step.path}: step {step.step} has the PyTree items {items}; the target "
                f"must be a dict with exactly these keys, one target per item"
            )
    claimed = 0
    for item in trees:
        tree_meta = _read_metadata(item)
        claimed = check_claims(item.path, _arrays(tree_meta), claimed, bound)
        if target is not None:
            _check_target(item, tree_meta, _item_target(trees, item, target), allow_lossy)
    return _Plan(
        step=step,
        trees=trees,
        json=tuple(i for i in kept if i.kind == "json"),
        data_iter=iters[0] if iters else None,
        skipped=skipped,
    )


def _key(path: tuple[Any, ...]) -> tuple[str, ...]:
    """A tree path as Orbax's metadata names it (dict keys, attribute names, indices)."""
    names = (getattr(k, a) for k in path for a in ("key", "name", "idx") if hasattr(k, a))
    return tuple(str(n) for n in names)


def _check_target(item: OrbaxItem, tree_meta: Any, target: Any, allow_lossy: bool) -> None:
    """Refuses what Orbax would do silently: another shape for a numpy-saved array, or a
    lossy dtype conversion (jaxckpt's rule; ``allow_lossy_cast`` permits it)."""
    import jax

    from jaxckpt.restoring import lossy_cast

    saved = {_key(p): m for p, m in jax.tree_util.tree_flatten_with_path(tree_meta)[0]}
    problems = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        if saved and _key(path) not in saved:
            problems.append(f"{jax.tree_util.keystr(path)}: not in the checkpoint")
            continue
        meta: Any = saved.get(_key(path))
        dtype = getattr(leaf, "dtype", None)
        if type(meta).__name__ != "ArrayMetadata" or dtype is None:
            continue  # not a saved array (scalars keep Orbax's rule), or not a typed target
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            continue  # saved as its key data
        saved_shape, saved_dtype = tuple(meta.shape), np.dtype(meta.dtype)
        if saved_shape != tuple(leaf.shape):
            problems.append(
                f"{jax.tree_util.keystr(path)}: saved {saved_shape}, target {leaf.shape}"
            )
        elif not allow_lossy and lossy_cast(saved_dtype, np.dtype(dtype)):
            problems.append(f"{jax.tree_util.keystr(path)}: saved {saved_dtype}, target {dtype}")
    if problems:
        shown = "\n".join(problems[:20]) + (
            f"\n... {len(problems) - 20} more" if len(problems) > 20 else ""
        )
        raise TreeMismatchError(
            f"Orbax item {item.path} does not fit the target at {len(problems)} paths "
            f"(a lossy dtype: pass allow_lossy_cast=True to convert anyway):\n{shown}"
        )


def _tree_metadata(checkpointer: Any, path: str) -> Any:
    metadata = checkpointer.metadata(path)
    tree_meta = getattr(getattr(metadata, "item_metadata", None), "tree", None)
    return getattr(metadata, "tree", metadata) if tree_meta is None else tree_meta


def _read_metadata(item: OrbaxItem) -> Any:
    """The item's tree metadata (its arrays' claimed shapes and dtypes; no array is read)."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as reader:
        try:
            return _tree_metadata(reader, item.path)
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise ImportSourceError(f"cannot read Orbax checkpoint {item.path}: {_brief(e)}") from e


def _arrays(tree_meta: Any) -> list[tuple[str, Any, Any]]:
    """``(tree path, claimed shape, dtype)`` of every array the metadata describes."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree_meta)[0]
    return [
        (jax.tree_util.keystr(path), meta.shape, meta.dtype)
        for path, meta in leaves
        if type(meta).__name__ == "ArrayMetadata"
    ]


def _brief(e: BaseException) -> str:
    """An error's text on one line, cut to a readable length (Orbax's list every path)."""
    if isinstance(e, RecursionError):
        return "its metadata is nested too deeply to be Orbax's"
    text = " ".join(str(e).split())
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + " ..."


def _restore_tree(item: OrbaxItem, target: Any) -> Any:
    """One PyTree item: into ``target`` through Orbax, else as numpy in the saved nesting."""
    import jax
    import orbax.checkpoint as ocp

    if target is not None:
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
            try:
                return checkpointer.restore(item.path, args=ocp.args.StandardRestore(target))
            except (OSError, RecursionError) as e:
                raise ImportSourceError(
                    f"cannot read Orbax checkpoint {item.path}: {_brief(e)}"
                ) from e
            except (ValueError, KeyError, TypeError) as e:
                raise TreeMismatchError(
                    f"Orbax item {item.path} does not restore into the target: {_brief(e)}"
                ) from e
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        tree_meta = _tree_metadata(checkpointer, item.path)
        scalars = jax.tree.map(lambda m: type(m).__name__ == "ScalarMetadata", tree_meta)
        args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), tree_meta)
        restored = checkpointer.restore(item.path, args=ocp.args.PyTreeRestore(restore_args=args))
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise ImportSourceError(f"cannot read Orbax checkpoint {item.path}: {_brief(e)}") from e
    finally:
        checkpointer.close()
    return jax.tree.map(
        lambda x, is_scalar: x.item() if is_scalar and np.ndim(x) == 0 else np.asarray(x),
        restored,
        scalars,
    )


def _json_item(item: OrbaxItem) -> Any:
    files = [f for f in sorted(os.listdir(item.path)) if f != "commit_success.txt"]
    if len(files) != 1:
        raise ImportSourceError(f"{item.path}: a JSON item holds one file, found {files}")
    return read_json(os.path.join(item.path, files[0]))


def _iterator_state(item: OrbaxItem) -> Any:
    """A grain iterator's state as its ``get_state()`` gave it: bytes or a JSON value.

    grain's Orbax handler writes a ``DataLoader`` iterator's ``bytes`` decoded, and
    a ``DatasetIterator``'s dict as JSON; the ``DataLoader`` state is the one with
    ``last_seen_indices`` and ``last_worker_index``.
    """
    path = os.path.join(item.path, "process_0-of-1.json")
    state = read_json(path)
    if isinstance(state, dict) and {"last_seen_indices", "last_worker_index"} <= state.keys():
        with open(path, "rb") as f:
            return f.read()
    return state


def _load(plan: _Plan, target: Any) -> Imported:
    step, trees = plan.step, plan.trees
    if len(trees) == 1:
        tree = _restore_tree(trees[0], target)
    else:
        tree = {str(i.name): _restore_tree(i, _item_target(trees, i, target)) for i in trees}
    metadata: dict[str, Any] = {}
    items = {str(i.name): _json_item(i) for i in plan.json}
    # A CheckpointManager's metrics are a JSON item named "metrics" (older: in the record).
    found = items.pop("metrics") if isinstance(items.get("metrics"), dict) else step.metrics
    if items:
        metadata["orbax_items"] = items
    if found:
        metadata["orbax_metrics"] = found
    if step.custom_metadata:
        metadata["orbax_custom_metadata"] = step.custom_metadata
    if plan.skipped:
        metadata["orbax_skipped_items"] = list(plan.skipped)
    metrics = {
        str(k): float(v)
        for k, v in found.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    return Imported(
        tree=tree,
        source=f"orbax:{os.path.abspath(step.path)}",
        metadata=metadata,
        metrics=metrics or None,
        process_state=None if plan.data_iter is None else _iterator_state(plan.data_iter),
    )


def import_orbax(
    src: str | os.PathLike[str],
    root: str | os.PathLike[str] | CheckpointManager,
    *,
    target: Any = None,
    steps: int | Iterable[int] | None = None,
    step: int | None = None,
    skip_items: Collection[str] = (),
    allow_lossy_cast: bool = False,
    max_bytes: int | None = None,
    log: Callable[[str], None] | None = None,
    **storage_options: Any,
) -> list[ImportResult]:
    """Saves Orbax checkpoints as committed jaxckpt steps, with Orbax's step numbers.

    Args:
      src: an Orbax ``CheckpointManager`` directory (``<N>/`` or ``<prefix>_<N>/``
        steps), a Flax ``flax.training.checkpoints`` directory (``checkpoint_<N>/``),
        one step directory, or one item directory.
      root: the jaxckpt root (created if needed; local, ``gs://``, ``s3://``), or an
        open :class:`~jaxckpt.CheckpointManager` to import through (the root of an
        open manager of this process is refused: a second writer would fence it).
        A failed import leaves the root as it was (a root it created is removed).
      target: restore through Orbax into this pytree (arrays or
        ``jax.ShapeDtypeStruct``, e.g. ``jax.eval_shape`` of a ``TrainState`` or an
        NNX ``nnx.state``), so the step restores into the same target with jaxckpt.
        None: arrays as numpy, scalars as Python values, in the saved nesting. With
        several PyTree items, a dict with one target per item name.
      steps: the Orbax steps to import; None imports every committed step.
      step: the jaxckpt step of a single imported step; None keeps Orbax's number
        (the newest committed + 1 when the path names none).
      skip_items: names of Composite items to leave out (recorded in the step's
        metadata as ``orbax_skipped_items``).
      allow_lossy_cast: ``target`` may convert saved arrays to dtypes that lose
        values (float32 -> bfloat16); Orbax would, silently.
      max_bytes: the most bytes the arrays of one step may claim (they are held in
        memory); None: this host's memory. Checked on the metadata, before any read.
      log: called with one line per step imported.

    Returns:
      One :class:`ImportResult` per committed step, ascending.

    >>> import tempfile, numpy as np, orbax.checkpoint as ocp, jaxckpt
    >>> src, root = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> with ocp.CheckpointManager(src) as orbax:
    ...     for step in (100, 200):
    ...         _ = orbax.save(step, args=ocp.args.StandardSave({"w": np.full(2, step)}))
    >>> [r.step for r in import_orbax(src, root)]
    [100, 200]
    >>> jaxckpt.CheckpointManager(root).restore(100)["w"]
    array([100, 100])

    Raises:
      ImportSourceError: ``src`` is not an Orbax checkpoint, a chosen step is not
        there, an item cannot be imported (it is named, with the fix), it links out
        of ``src``, or its arrays claim more than ``max_bytes``.
      CheckpointError: an open manager of this process writes ``root``.
      StepAlreadyExistsError: a step is already committed under ``root`` (checked
        for every step before anything is written).
      TreeMismatchError: Orbax cannot restore an item into ``target``, or would
        change an array's shape or convert it lossily (every such path is named).
    """
    src = os.path.abspath(os.fspath(src))  # Orbax reads absolute paths only
    chosen = choose(src, read_source(src), steps)
    if step is not None and len(chosen) != 1:
        raise ValueError(f"step={step} names the step of one import; {src} has {len(chosen)}")
    for found in chosen:
        check_links(src, found.path)
        if step is None:
            check_step_number(found.path, found.step)
    skip = frozenset(skip_items)
    target = None if target is None else concrete_targets(target)
    bound = host_memory() if max_bytes is None else max_bytes
    # Every refusal comes before anything is read or written.
    plans = [_plan(s, skip, target, allow_lossy_cast, bound) for s in chosen]
    if not plans:
        return []

    def load(i: int) -> Imported:
        plan = plans[i]
        if log is not None:
            items = ", ".join(item.label for item in plan.step.items)
            log(f"importing Orbax step {plan.step.step} from {plan.step.path} ({items})")
        return _load(plan, target)

    dests = [step] if step is not None else [s.step for s in chosen]
    return commit_imports(root, dests, load, storage_options)
