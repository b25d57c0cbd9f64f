"""The verdict of a resume pre-flight (:func:`jaxckpt.check_resume`): the leaves that
differed and a headline that says which cause the check found.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["CHECKPOINT", "NONDETERMINISTIC", "OK", "LeafMismatch", "ResumeReport"]

OK = "ok"
NONDETERMINISTIC = "nondeterministic"
CHECKPOINT = "checkpoint"


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
