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
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from jaxckpt._options import CheckpointOptions
from jaxckpt._tree import flatten, path_str
from jaxckpt.errors import CheckpointError

OK = "ok"
NONDETERMINISTIC = "nondeterministic"
CHECKPOINT = "checkpoint"

_SAVED_STEP = 0


@dataclass(frozen=True, kw_only=True)
class LeafMismatch:
    """One leaf that differs between two states at one step.

    Attributes:
      step: 0 for the restored state itself, ``i`` for the state after ``i`` steps.
      path: the tree path (``jax.tree_util.keystr`` text); ``aux`` values are
        prefixed with ``aux``.
      kind: ``value``, ``dtype``, ``shape``, ``type``, ``lost`` (in the original, not
        in the other), ``extra`` (the other way round) or ``structure``.
      count: elements that differ (bit for bit; NaNs with equal bits are equal).
      size: elements in the leaf.
      max_abs_diff: largest absolute difference among them (None if not numeric).
      max_rel_diff: largest ``|a - b| / |a|`` among them (None if not numeric).
      detail: the dtypes, shapes, types or values involved.
    """

    step: int
    path: str
    kind: str
    count: int
    size: int
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    detail: str = ""

    def __str__(self) -> str:
        where = "restored state" if self.step == 0 else f"step {self.step}"
        text = f"{where}: {self.path}: {self.kind}"
        if self.kind in ("value", "dtype") and self.size:
            text += f", {self.count} of {self.size} elements differ"
        if self.max_abs_diff is not None:
            text += f", max |diff| {self.max_abs_diff:.3g}"
        return text + (f" ({self.detail})" if self.detail else "")


@dataclass(frozen=True, kw_only=True)
class ResumeReport:
    """The result of :func:`check_resume`; ``str(report)`` is a readable summary.

    Attributes:
      ok: the resumed run matched the uninterrupted run bit for bit at every step.
      verdict: ``"ok"``, ``"nondeterministic"`` (``step_fn`` is not repeatable from
        the same state and batches) or ``"checkpoint"`` (the checkpoint round trip
        changed the state or the resumed run).
      steps: steps run (fewer than asked when a run diverged early).
      mismatches: resumed run against uninterrupted run, at the first step where they
        differ (step 0: the restored state itself).
      repeat_mismatches: the uninterrupted run against its repeat, at the first step
        where they differ.
      notes: differences that are not failures by themselves (shardings, weak types).
      root: where the state was saved.
    """

    ok: bool
    verdict: str
    steps: int
    mismatches: tuple[LeafMismatch, ...]
    repeat_mismatches: tuple[LeafMismatch, ...]
    notes: tuple[str, ...]
    root: str

    @property
    def first_divergent_step(self) -> int | None:
        """The first step where the resumed run differs, or None."""
        return self.mismatches[0].step if self.mismatches else None

    def __str__(self) -> str:
        lines = [f"check_resume: {_HEADLINES[self.verdict](self)}"]
        shown = self.repeat_mismatches if self.verdict == NONDETERMINISTIC else self.mismatches
        lines += [f"  {m}" for m in shown[:20]]
        if len(shown) > 20:
            lines.append(f"  ... and {len(shown) - 20} more leaves")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _headline_ok(r: ResumeReport) -> str:
    return (
        f"OK: the restored state is bit-identical and {r.steps} resumed steps matched the "
        f"uninterrupted run bit for bit (round trip through {r.root})"
    )


def _headline_nondeterministic(r: ResumeReport) -> str:
    step = r.repeat_mismatches[0].step
    return (
        f"FAILED (step_fn is not repeatable): two runs from the same state with the same "
        f"batches diverged at step {step}, before any checkpoint was involved. step_fn is "
        "non-deterministic or reads state that is not in `state` (a Python counter, an "
        "RNG key or a data iterator in a closure or global); a resumed run cannot "
        f"reproduce it. Move that state into `state`. {_size_hint(r.repeat_mismatches)}"
    ).rstrip()


def _headline_checkpoint(r: ResumeReport) -> str:
    step = r.mismatches[0].step
    if step == 0 and any(m.kind in ("lost", "extra") for m in r.mismatches):
        return (
            "FAILED (checkpoint): the restore target does not have the saved state's "
            "leaves, so a resume would lose or invent state"
        )
    if step == 0:
        return (
            f"FAILED (checkpoint): the state restored from {r.root} differs from the "
            "state that was saved"
        )
    return (
        f"FAILED (checkpoint): the restored state is bit-identical, but the resumed run "
        f"diverged at step {step} while step_fn is repeatable from the original state: "
        "something besides the values differs (see the notes: sharding, weak type), or "
        "step_fn treats the restored arrays differently"
    )


_HEADLINES: dict[str, Callable[[ResumeReport], str]] = {
    OK: _headline_ok,
    NONDETERMINISTIC: _headline_nondeterministic,
    CHECKPOINT: _headline_checkpoint,
}


def _size_hint(mismatches: Sequence[LeafMismatch]) -> str:
    rel = [m.max_rel_diff for m in mismatches if m.max_rel_diff is not None]
    if not rel or len(rel) < len(mismatches):
        return ""
    if max(rel) < 1e-4:
        return "(The differences are tiny, as from non-deterministic floating-point reductions.)"
    return "(The differences are large, as from state kept outside `state`.)"


# -------------------------------------------------------------------------- comparing


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _host(x: Any) -> np.ndarray:
    """The values this process holds: the whole array, or its own unique shards."""
    if _is_key(x):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        shards = sorted(
            (str(s.index), np.asarray(s.data).ravel())
            for s in x.addressable_shards
            if s.replica_id == 0
        )
        return np.concatenate([d for _, d in shards]) if shards else np.empty(0, x.dtype)
    return np.asarray(x)


def _numeric_diff(a: np.ndarray, b: np.ndarray) -> tuple[float | None, float | None]:
    """Largest ``|a - b|`` and ``|a - b| / |a|`` (inf at NaNs); Nones if not numeric."""
    wide = np.complex128 if np.dtype(a.dtype).kind == "c" else np.float64
    try:
        da, db = a.astype(wide), b.astype(wide)
    except (TypeError, ValueError):
        return None, None
    if da.size == 0:
        return 0.0, 0.0
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        diff = np.abs(da - db)
        rel = diff / np.abs(da)
    finite = np.where(np.isnan(diff), np.inf, diff)
    return float(np.max(finite)), float(np.max(np.where(np.isnan(rel), np.inf, rel)))


def _compare_arrays(step: int, path: str, a: Any, b: Any) -> LeafMismatch | None:
    if _is_key(a) != _is_key(b) or (_is_key(a) and a.dtype != b.dtype):
        return LeafMismatch(
            step=step,
            path=path,
            kind="dtype",
            count=int(np.size(a)),
            size=int(np.size(a)),
            detail=f"{a.dtype} vs {b.dtype}",
        )
    ha, hb = _host(a), _host(b)
    if ha.shape != hb.shape:
        return LeafMismatch(
            step=step,
            path=path,
            kind="shape",
            count=ha.size,
            size=ha.size,
            detail=f"{ha.shape} vs {hb.shape}",
        )
    if ha.dtype != hb.dtype:
        return LeafMismatch(
            step=step,
            path=path,
            kind="dtype",
            count=ha.size,
            size=ha.size,
            max_abs_diff=_numeric_diff(ha, hb)[0],
            detail=f"{ha.dtype} vs {hb.dtype}",
        )
    if ha.dtype.itemsize == 0 or ha.size == 0:
        return None
    bytes_a = np.ascontiguousarray(ha).reshape(-1).view(np.uint8).reshape(ha.size, -1)
    bytes_b = np.ascontiguousarray(hb).reshape(-1).view(np.uint8).reshape(hb.size, -1)
    differ = np.any(bytes_a != bytes_b, axis=1)
    count = int(differ.sum())
    if not count:
        return None
    abs_diff, rel_diff = _numeric_diff(ha.reshape(-1)[differ], hb.reshape(-1)[differ])
    return LeafMismatch(
        step=step,
        path=path,
        kind="value",
        count=count,
        size=ha.size,
        max_abs_diff=abs_diff,
        max_rel_diff=rel_diff,
        detail=str(ha.dtype),
    )


def _same_value(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def _compare_leaf(step: int, path: str, a: Any, b: Any) -> LeafMismatch | None:
    if _is_array(a) and _is_array(b):
        return _compare_arrays(step, path, a, b)
    if _is_array(a) or _is_array(b):
        detail = f"{type(a).__name__} vs {type(b).__name__}"
        return LeafMismatch(step=step, path=path, kind="type", count=1, size=1, detail=detail)
    if _same_value(a, b):
        return None
    numeric = isinstance(a, int | float) and isinstance(b, int | float)
    return LeafMismatch(
        step=step,
        path=path,
        kind="value" if type(a) is type(b) else "type",
        count=1,
        size=1,
        max_abs_diff=abs(float(a) - float(b)) if numeric else None,
        detail=f"{a!r} vs {b!r}",
    )


def _by_path(tree: Any, prefix: str) -> dict[str, Any]:
    flat, _ = flatten(tree)
    return {prefix + (path_str(p) if p or not prefix else ""): leaf for p, leaf in flat}


def compare_trees(step: int, reference: Any, other: Any, *, prefix: str = "") -> list[LeafMismatch]:
    """Every leaf of ``other`` that differs from ``reference`` (bits, dtype, shape, type)."""
    ref, got = _by_path(reference, prefix), _by_path(other, prefix)
    out: list[LeafMismatch] = []
    for path, a in ref.items():
        if path not in got:
            size = int(np.size(a)) if _is_array(a) else 1
            out.append(LeafMismatch(step=step, path=path, kind="lost", count=size, size=size))
            continue
        mismatch = _compare_leaf(step, path, a, got[path])
        if mismatch is not None:
            out.append(mismatch)
    for path in got.keys() - ref.keys():
        out.append(LeafMismatch(step=step, path=path, kind="extra", count=0, size=0))
    if not out and _structure(reference) != _structure(other):
        detail = f"{_structure(reference)} vs {_structure(other)}"
        out.append(
            LeafMismatch(
                step=step,
                path=prefix or "<root>",
                kind="structure",
                count=0,
                size=0,
                detail=detail[:300],
            )
        )
    return out


def _notes(original: Any, restored: Any) -> list[str]:
    notes = []
    ref, got = _by_path(original, ""), _by_path(restored, "")
    for path, a in ref.items():
        b = got.get(path)
        if not isinstance(a, jax.Array) or not isinstance(b, jax.Array):
            continue
        if getattr(a, "weak_type", False) != getattr(b, "weak_type", False):
            notes.append(
                f"{path}: weakly typed when saved, not when restored (type "
                "promotion in step_fn may differ; make it a strongly typed array)"
            )
        if not a.sharding.is_equivalent_to(b.sharding, a.ndim):
            notes.append(f"{path}: sharding {a.sharding} saved, {b.sharding} restored")
    return notes


# ---------------------------------------------------------------------------- running


def abstract_target(state: Any) -> Any:
    """The restore target a resume would use: ``jax.ShapeDtypeStruct`` with the state's
    shardings for jax arrays; numpy arrays and Python values as they are."""

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
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
            and _structure(result) != structure
            and _structure(result[0]) == structure
        )
    if has_aux:
        new_state, aux = result
        return new_state, aux
    return result, None


def _structure(tree: Any) -> Any:
    return jax.tree.structure(tree, is_leaf=lambda x: x is None)


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
    from jaxckpt import CheckpointManager

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
        notes = _notes(state, restored)
        if mismatches:
            return _report(mgr.root, CHECKPOINT, 0, mismatches, notes=notes)
        verdict, done, resumed, repeat = _run(step_fn, state, restored, batch_at, steps, has_aux)
        return _report(mgr.root, verdict, done, resumed, repeat=repeat, notes=notes)


def _lost_paths(state: Any, target: Any) -> list[LeafMismatch]:
    """Leaves of ``state`` a restore into ``target`` would drop, and leaves it would add."""
    saved, wanted = _by_path(state, ""), _by_path(target, "")
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
    structure = _structure(state)
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
