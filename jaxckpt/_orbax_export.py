"""A committed jaxckpt step written as an Orbax checkpoint Orbax restores.

The step is restored with jaxckpt (every chunk checked against its checksum),
into ``target`` when one is given, and saved with Orbax's own
``CheckpointManager`` and ``StandardSave``: ``DEST/<step>/default/``, the layout
``CheckpointManager(DEST).restore(step, args=StandardRestore(target))`` reads.
The step's user metadata goes into Orbax's ``custom_metadata``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from jaxckpt.errors import StepAlreadyExistsError, UnsupportedLeafError

__all__ = ["OrbaxExportResult", "export_orbax"]


@dataclass(frozen=True, kw_only=True)
class OrbaxExportResult:
    """What an Orbax export wrote: the Orbax directory, the step, its item, arrays and bytes."""

    dest: str
    step: int
    path: str
    arrays: int
    nbytes: int


def _check_leaves(tree: Any, step: int) -> None:
    """Orbax's ``StandardSave`` takes arrays, numbers, bools and None; str is refused here."""
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    bad = [jax.tree_util.keystr(p) for p, x in flat if isinstance(x, str | bytes)]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UnsupportedLeafError(
            f"step {step}: leaf {bad[0]}{more} is a string, which Orbax's StandardSave does "
            "not take; restore with a target that leaves it out and export that"
        )


def export_orbax(
    root: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    step: int | None = None,
    target: Any = None,
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

    Returns:
      The step written and its item directory ``dest/<step>/default``.

    Raises:
      StepNotFoundError: no such committed step under ``root``.
      StepAlreadyExistsError: ``dest`` already holds that step.
      UnsupportedLeafError: a leaf Orbax cannot save (a string; the path is named).
      CorruptCheckpointError: a chunk of the step fails its checksum.
    """
    import jax
    import orbax.checkpoint as ocp

    from jaxckpt import CheckpointManager

    with CheckpointManager(root, read_only=True, storage_options=storage_options) as mgr:
        tree = mgr.restore(step, target=target)
        saved = mgr.restored_step
        assert saved is not None
        user = mgr.metadata(saved).user_metadata
        source = f"jaxckpt:{mgr.root}"
    _check_leaves(tree, saved)
    dest = os.path.abspath(os.fspath(dest))
    with ocp.CheckpointManager(dest) as orbax:
        if saved in orbax.all_steps():
            raise StepAlreadyExistsError(
                f"Orbax directory {dest} already holds step {saved}; export into another one"
            )
        custom = {"exported_from": source, "metadata": user}
        orbax.save(saved, args=ocp.args.StandardSave(tree), custom_metadata=custom)
        orbax.wait_until_finished()
    arrays = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype")]
    return OrbaxExportResult(
        dest=dest,
        step=saved,
        path=os.path.join(dest, str(saved), "default"),
        arrays=len(arrays),
        nbytes=sum(int(getattr(x, "nbytes", 0)) for x in arrays),
    )
