"""A resume pre-flight: prove that a checkpoint of this state resumes bit-exactly.

Before a long run, :func:`check_resume` saves the state, restores it into a target
derived from it (shapes, dtypes, shardings), checks that the restored state equals the
original bit for bit, then runs ``steps`` training steps three times in lockstep, with
the same batches: twice from the original state (the run that never stopped, and its
repeat) and once from the restored state (the resumed run). Every leaf (and every
numeric ``aux`` value, such as the loss) is compared after every step.

The verdict tells the causes apart:

* ``"ok"``: the resumed run matched the uninterrupted one at every step.
* ``"nondeterministic"``: the two runs from the *same* original state already diverged,
  so ``step_fn`` is not a function of ``(state, batch)``: it is non-deterministic, or it
  reads state that is not in ``state`` (a Python counter, an RNG key or a data iterator
  kept in a closure or a global). No checkpoint can make such a run resume exactly.
* ``"checkpoint"``: the restored state differs from the original (a value, a dtype cast,
  a lost or extra leaf), or the resumed run diverged while ``step_fn`` is repeatable.

The report is :mod:`jaxckpt.restoring._resumereport`, the leaf-by-leaf comparison
:mod:`jaxckpt.restoring._compare`.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import jax
import numpy as np

from jaxckpt._options import CheckpointOptions
from jaxckpt.errors import CheckpointError
from jaxckpt.restoring import (
    CHECKPOINT,
    NONDETERMINISTIC,
    OK,
    LeafMismatch,
    ResumeReport,
    compare_trees,
    paths_of,
    restore_notes,
    tree_structure,
)

_SAVED_STEP = 0


# ---------------------------------------------------------------------------- running


def abstract_target(state: Any) -> Any:
    """The restore target a resume would use: ``jax.ShapeDtypeStruct`` with the state's
    shardings for jax arrays; numpy arrays and Python values as they are."""

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=x.sharding, weak_type=getattr(x, "weak_type", False)
            )
        return x

    return jax.tree.map(leaf, state, is_leaf=lambda x: x is None)


def _copy(state: Any) -> Any:
    """A copy ``step_fn`` may donate or mutate without touching ``state``."""

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.device_put(x, x.sharding, may_alias=False)
        if isinstance(x, np.ndarray):
            return x.copy()
        return x

    return jax.tree.map(leaf, state, is_leaf=lambda x: x is None)


def _split_result(result: Any, structure: Any, has_aux: bool | None) -> tuple[Any, Any]:
    """``(state, aux)`` from what ``step_fn`` returned."""
    if has_aux is None:  # a pair whose first element, not the pair, has the state's structure
        has_aux = (
            isinstance(result, tuple)
            and len(result) == 2
            and tree_structure(result) != structure
            and tree_structure(result[0]) == structure
        )
    if has_aux:
        new_state, aux = result
        return new_state, aux
    return result, None


def _batch_source(batches: Any, steps: int) -> Callable[[int, Any], Any]:
    if callable(batches):
        return lambda _i, state: batches(state)
    items = list(batches) if not isinstance(batches, Sequence) else batches
    if len(items) < steps:
        raise ValueError(f"check_resume needs {steps} batches, got {len(items)}")
    return lambda i, _state: items[i]


@contextlib.contextmanager
def _scratch_root(root: str | None) -> Iterator[str]:
    if root is not None:
        yield str(root)
        return
    directory = tempfile.mkdtemp(prefix="jaxckpt-preflight-")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def check_resume(
    step_fn: Callable[[Any, Any], Any],
    state: Any,
    batches: Iterable[Any] | Callable[[Any], Any],
    *,
    steps: int = 10,
    root: str | None = None,
    target: Any = None,
    has_aux: bool | None = None,
    options: CheckpointOptions | None = None,
) -> ResumeReport:
    """Checks that a checkpoint of ``state`` resumes bit-exactly under ``step_fn``.

    Saves ``state``, restores it into ``target`` (default: derived from ``state``:
    shapes, dtypes, shardings), compares it with ``state`` bit for bit, then runs
    ``steps`` steps from the original twice and from the restored state once, with the
    same batches, comparing every leaf and every ``aux`` value after every step. The
    caller's ``state`` is never passed to ``step_fn`` (each run gets a copy), so a
    ``step_fn`` that donates its input is fine and ``state`` stays usable.

    Args:
      step_fn: ``step_fn(state, batch)`` returns the new state, or ``(state, aux)``
        where ``aux`` (e.g. the loss) is compared too.
      state: the train state, as it would be saved.
      batches: at least ``steps`` batches (batch ``i`` feeds step ``i`` of every run), or
        a callable ``batches(state)`` returning the next batch from a run's current
        state (the data position must then live in the state).
      steps: steps to run from each state.
      root: where to save: an empty scratch root on the storage the run will use (the
        step written there is deleted afterwards). Default: a temporary local directory.
        With several processes, call it on every process with a ``root`` they share;
        each process compares the shards it holds.
      target: the restore target the real resume uses (e.g. from ``nnx.eval_shape``
        with shardings attached), to check that code path too.
      has_aux: whether ``step_fn`` returns ``(state, aux)``; None infers it (a pair
        whose first element has the state's tree structure).
      options: manager options (chunk size, storage options); save and retention
        policies are ignored.

    Returns:
      A :class:`ResumeReport`; ``report.ok`` is the answer, ``print(report)`` the story.

    Raises:
      CheckpointError: ``root`` already holds committed steps, or the save failed.
      ValueError: fewer than ``steps`` batches, or ``steps < 1``.

    >>> import jax.numpy as jnp
    >>> def step(state, batch):
    ...     w = state["w"] - 0.1 * batch
    ...     return {"w": w}, jnp.sum(w)
    >>> report = check_resume(step, {"w": jnp.ones(3)}, [jnp.ones(3)] * 4, steps=4)
    >>> report.ok, report.verdict
    (True, 'ok')
    """
    from jaxckpt._manager import CheckpointManager

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    batch_at = _batch_source(batches, steps)
    opts = replace(options or CheckpointOptions(), save_policy=None, retention=None)
    with _scratch_root(root) as uri, CheckpointManager(uri, opts) as mgr:
        if mgr.steps():
            raise CheckpointError(
                f"check_resume needs an empty root, but {mgr.root} has committed steps "
                f"{mgr.steps()[:5]}; pass a scratch root (or none for a temporary one)"
            )
        mgr.save(_SAVED_STEP, state, force=True)
        mgr.wait()
        try:
            want = abstract_target(state) if target is None else target
            lost = _lost_paths(state, want)
            # A lossy cast is restored anyway, so the report can show what it changes.
            restored = (
                None if lost else mgr.restore(_SAVED_STEP, target=want, allow_lossy_cast=True)
            )
        finally:
            mgr.delete(_SAVED_STEP)
        if lost:
            return _report(mgr.root, CHECKPOINT, 0, lost)
        assert restored is not None
        mismatches = compare_trees(0, state, restored)
        notes = restore_notes(state, restored)
        if mismatches:
            return _report(mgr.root, CHECKPOINT, 0, mismatches, notes=notes)
        verdict, done, resumed, repeat = _run(step_fn, state, restored, batch_at, steps, has_aux)
        return _report(mgr.root, verdict, done, resumed, repeat=repeat, notes=notes)


def _lost_paths(state: Any, target: Any) -> list[LeafMismatch]:
    """Leaves of ``state`` a restore into ``target`` would drop, and leaves it would add."""
    saved, wanted = paths_of(state, ""), paths_of(target, "")
    out = [
        LeafMismatch(step=0, path=p, kind="lost", count=1, size=1, detail="not in the target")
        for p in saved
        if p not in wanted
    ]
    out += [
        LeafMismatch(step=0, path=p, kind="extra", count=0, size=0, detail="not in the state")
        for p in wanted
        if p not in saved
    ]
    return out


def _report(
    root: str,
    verdict: str,
    steps: int,
    mismatches: Sequence[LeafMismatch],
    *,
    repeat: Sequence[LeafMismatch] = (),
    notes: Sequence[str] = (),
) -> ResumeReport:
    return ResumeReport(
        ok=verdict == OK,
        verdict=verdict,
        steps=steps,
        mismatches=tuple(mismatches),
        repeat_mismatches=tuple(repeat),
        notes=tuple(notes),
        root=root,
    )


def _run(
    step_fn: Callable[[Any, Any], Any],
    state: Any,
    restored: Any,
    batch_at: Callable[[int, Any], Any],
    steps: int,
    has_aux: bool | None,
) -> tuple[str, int, list[LeafMismatch], list[LeafMismatch]]:
    """Runs original, repeat and resumed in lockstep: (verdict, steps run, mismatches)."""
    structure = tree_structure(state)
    runs = {"original": _copy(state), "repeat": _copy(state), "resumed": restored}
    resumed: list[LeafMismatch] = []
    done = 0
    for i in range(steps):
        out = {}
        for name, current in runs.items():
            result = step_fn(current, batch_at(i, current))
            new_state, aux = _split_result(result, structure, has_aux)
            out[name] = {"state": new_state, "aux": aux}
            runs[name] = new_state
        done = i + 1
        repeat = _compare_step(done, out["original"], out["repeat"])
        if repeat:
            return NONDETERMINISTIC, done, resumed, repeat
        if "resumed" in out:
            resumed = _compare_step(done, out["original"], out["resumed"])
            if resumed:  # the first divergence is the story; keep checking the repeat
                runs.pop("resumed")
    return (CHECKPOINT if resumed else OK), done, resumed, []


def _compare_step(
    step: int, reference: dict[str, Any], other: dict[str, Any]
) -> list[LeafMismatch]:
    out = compare_trees(step, reference["state"], other["state"])
    if reference["aux"] is not None or other["aux"] is not None:
        out += compare_trees(step, reference["aux"], other["aux"], prefix="aux")
    return out
