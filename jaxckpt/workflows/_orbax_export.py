"""A committed jaxckpt step written as an Orbax checkpoint that Orbax and Flax restore.

The step is restored with jaxckpt (every chunk checked against its checksum),
into ``target`` when one is given, and saved with Orbax. Two layouts:

* ``"manager"`` (the default): Orbax's ``CheckpointManager`` with ``StandardSave``,
  ``DEST/<step>/default/``, which ``CheckpointManager(DEST).restore(step,
  args=StandardRestore(target))`` reads, and Flax's legacy
  ``flax.training.checkpoints.restore_checkpoint(DEST/<step>/default, target)``.
  The step's user metadata goes into Orbax's ``custom_metadata``. A step saved with
  ``process_state`` (a data iterator's position) adds the item ``data_iter`` beside
  ``default``, in grain's layout (``process_<i>-of-<n>.json``): a plain
  ``StandardRestore`` still reads the state, and
  ``CheckpointManager(DEST, item_names=("default", "data_iter"))`` with
  ``Composite(default=StandardRestore(t), data_iter=grain.checkpoint.CheckpointRestore(it))``
  restores both.
* ``"flax"``: Flax's legacy ``flax.training.checkpoints`` layout,
  ``DEST/checkpoint_<step>/`` as one PyTree, which ``restore_checkpoint(DEST, target)``
  finds by itself (the newest ``checkpoint_<N>``), and ``StandardCheckpointer().restore``
  reads too. It has no place for a data iterator's state: a step's
  ``process_state`` is left out, with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

import orbax.checkpoint as ocp
from etils import epath

from jaxckpt.errors import StepAlreadyExistsError, UnsupportedLeafError

__all__ = ["OrbaxExportResult", "export_orbax"]

log = logging.getLogger("jaxckpt")

Layout = Literal["manager", "flax"]
LAYOUTS = ("manager", "flax")


@dataclass(frozen=True, kw_only=True)
class OrbaxExportResult:
    """What an Orbax export wrote: the Orbax directory, the step, its item, arrays and bytes."""

    dest: str
    step: int
    path: str
    arrays: int
    nbytes: int


class IteratorStatesHandler(ocp.CheckpointHandler):
    """Every process's data-iterator state as text, in grain's Orbax layout."""

    def save(self, directory: epath.Path, args: IteratorStates) -> None:
        count = len(args.texts)
        for index, text in enumerate(args.texts):
            if text is not None:
                (directory / f"process_{index}-of-{count}.json").write_text(text)

    def restore(self, directory: epath.Path, args: IteratorStates | None = None) -> Any:
        return {p.name: p.read_text() for p in sorted(directory.glob("process_*.json"))}


@ocp.args.register_with_handler(IteratorStatesHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class IteratorStates(ocp.args.CheckpointArgs):
    """The texts of ``process_<i>-of-<n>.json`` by process index (None: none saved)."""

    texts: list[str | None] = dataclasses.field(default_factory=list)


def _iterator_texts(states: list[Any], step: int) -> list[str | None]:
    """What grain's handler writes for each state: a ``DataLoader``'s bytes decoded, a
    ``DatasetIterator``'s dict as JSON (indent 4)."""
    texts: list[str | None] = []
    for process, state in enumerate(states):
        if isinstance(state, bytes):
            try:
                state = state.decode("utf-8")
            except UnicodeDecodeError:
                raise UnsupportedLeafError(
                    f"step {step}: the process_state of process {process} is bytes that are "
                    "not UTF-8 text, which Orbax's data-iterator item (grain's) cannot hold"
                ) from None
        texts.append(
            None
            if state is None
            else state
            if isinstance(state, str)
            else json.dumps(state, indent=4)
        )
    return texts


def _check_leaves(tree: Any, step: int) -> None:
    """Refuses, by path, what Orbax's ``StandardSave`` fails on: strings, empty arrays."""
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    for why, bad in (
        ("a string", [p for p, x in flat if isinstance(x, str | bytes)]),
        ("an empty array", [p for p, x in flat if hasattr(x, "shape") and 0 in x.shape]),
    ):
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise UnsupportedLeafError(
                f"step {step}: leaf {jax.tree_util.keystr(bad[0])}{more} is {why}, which "
                "Orbax's StandardSave does not take; export with a target that leaves it out "
                "and partial=True"
            )


def export_orbax(
    root: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    step: int | None = None,
    target: Any = None,
    partial: bool = False,
    layout: Layout = "manager",
    **storage_options: Any,
) -> OrbaxExportResult:
    """Writes a committed step as an Orbax ``CheckpointManager`` step under ``dest``.

    Args:
      root: the jaxckpt root.
      dest: the Orbax ``CheckpointManager`` directory (created if needed; other
        steps already there are kept).
      step: the step to export; None: the newest committed step.
      target: restore into this pytree first (a ``TrainState``, an NNX state, ...),
        so Orbax saves that structure; None: the saved nesting, arrays as numpy.
      partial: ``target`` names a subset of the saved leaves; only those are exported.
      layout: ``"manager"``: Orbax's ``CheckpointManager`` layout (``dest/<step>/default``,
        read by ``StandardRestore`` and by Flax's reader given that item directory);
        ``"flax"``: Flax's legacy layout (``dest/checkpoint_<step>``, read by
        ``flax.training.checkpoints.restore_checkpoint(dest, target)``).

    Returns:
      The step written and its state's directory: ``dest/<step>/default`` (with
      ``data_iter`` beside it when the step has process states), or
      ``dest/checkpoint_<step>``.

    >>> import tempfile, numpy as np, orbax.checkpoint as ocp, jaxckpt
    >>> root, dest = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> with jaxckpt.CheckpointManager(root) as mgr:
    ...     mgr.save(3, {"w": np.arange(4.0)})
    True
    >>> export_orbax(root, dest).step
    3
    >>> with ocp.CheckpointManager(dest) as orbax:
    ...     orbax.restore(3, args=ocp.args.StandardRestore())["w"]
    array([0., 1., 2., 3.])

    Raises:
      StepNotFoundError: no such committed step under ``root``.
      StepAlreadyExistsError: ``dest`` already holds that step.
      UnsupportedLeafError: a leaf Orbax cannot save (a string, an empty array; the
        path is named): export with a target that leaves it out and ``partial=True``.
      CorruptCheckpointError: a chunk of the step fails its checksum.
    """
    import jax

    from jaxckpt._manager import CheckpointManager

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    with CheckpointManager(root, read_only=True, storage_options=storage_options) as mgr:
        tree = mgr.restore(step, target=target, partial=partial)
        saved = mgr.restored_step
        assert saved is not None
        user = mgr.metadata(saved).user_metadata
        source = f"jaxckpt:{mgr.root}"
        states = mgr.process_states(saved)
    _check_leaves(tree, saved)
    texts = _iterator_texts(states, saved) if any(s is not None for s in states) else None
    dest = os.path.abspath(os.fspath(dest))
    custom = {"exported_from": source, "metadata": user}
    if layout == "flax":
        path = _save_flax(dest, saved, tree, custom, dropped=texts is not None)
    else:
        path = _save_manager(dest, saved, tree, custom, texts)
    arrays = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype")]
    return OrbaxExportResult(
        dest=dest,
        step=saved,
        path=path,
        arrays=len(arrays),
        nbytes=sum(int(getattr(x, "nbytes", 0)) for x in arrays),
    )


def _save_flax(dest: str, step: int, tree: Any, custom: dict[str, Any], dropped: bool) -> str:
    """``dest/checkpoint_<step>``: one PyTree, Flax's legacy layout."""
    path = os.path.join(dest, f"checkpoint_{step}")
    if os.path.lexists(path):
        raise StepAlreadyExistsError(f"{path} already exists; export into another directory")
    if dropped:
        log.warning(
            "step %d: its process_state is not exported: Flax's checkpoint_<N> layout holds "
            "one PyTree (layout='manager' writes it as a data_iter item)",
            step,
        )
    os.makedirs(dest, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree, custom_metadata=custom)
        checkpointer.wait_until_finished()
    return path


def _save_manager(
    dest: str, saved: int, tree: Any, custom: dict[str, Any], texts: list[str | None] | None
) -> str:
    """``dest/<step>/default`` (and ``data_iter``) through Orbax's ``CheckpointManager``."""
    with ocp.CheckpointManager(dest) as orbax:
        if saved in orbax.all_steps():
            raise StepAlreadyExistsError(
                f"Orbax directory {dest} already holds step {saved}; export into another one"
            )
        args: ocp.args.CheckpointArgs = ocp.args.StandardSave(tree)
        if texts is not None:  # "default": a plain StandardRestore still reads the state
            args = ocp.args.Composite(default=args, data_iter=IteratorStates(texts=texts))
        orbax.save(saved, args=args, custom_metadata=custom)
        orbax.wait_until_finished()
    return os.path.join(dest, str(saved), "default")
