"""Storage used by a three-week run under two retention policies. Pure arithmetic, no I/O.

A run of 504 hours at 2.5 s per step (725,760 steps) saves a 60 GB state every 1,000
steps, using :class:`jaxckpt.policy.EveryNSteps`. After every save, retention runs with
:func:`jaxckpt.policy.decide_retention` and its deletions happen; the new checkpoint is
written before the old ones are deleted, so peak storage counts both.

Run ``python scripts/simulate_retention.py`` to print the markdown table (it is also kept in
``scripts/simulate_retention.md``).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

RUN_HOURS = 504
STEP_SECONDS = 2.5
EVERY_STEPS = 1000
CHECKPOINT_GB = 60.0


def _load_policy() -> ModuleType:
    """Loads jaxckpt/policy.py by path, so the jaxckpt package (and jax) is not imported."""
    name = "_jaxckpt_policy_for_simulation"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parent.parent / "jaxckpt" / "policy.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


policy = _load_policy()


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """What one retention policy did over the run."""

    name: str
    written: int
    deleted: int
    kept: tuple[int, ...]
    peak_checkpoints: int

    @property
    def peak_gb(self) -> float:
        return self.peak_checkpoints * CHECKPOINT_GB

    @property
    def final_gb(self) -> float:
        return len(self.kept) * CHECKPOINT_GB


def total_steps() -> int:
    """Steps in the run: 504 h × 3600 s / 2.5 s = 725,760."""
    return round(RUN_HOURS * 3600 / STEP_SECONDS)


def save_steps() -> list[int]:
    """Steps at which :class:`jaxckpt.policy.EveryNSteps` saves during the run."""
    save = policy.EveryNSteps(EVERY_STEPS)
    steps: list[int] = []
    for step in range(1, total_steps() + 1):
        last = steps[-1] if steps else None
        ctx = policy.SaveContext(
            step=step, now=step * STEP_SECONDS, last_saved_step=last, last_save_time=None
        )
        if save.should_save(ctx):
            steps.append(step)
    return steps


def simulate(name: str, retention: object | None, saves: list[int]) -> SimResult:
    """Applies ``retention`` (None keeps all) after each of ``saves``, deleting as it goes."""
    on_disk: list[int] = []
    deleted = peak = 0
    for step in saves:
        on_disk.append(step)
        peak = max(peak, len(on_disk))
        infos = [policy.StepInfo(step=s) for s in on_disk]
        decision = policy.decide_retention(retention, infos)
        deleted += len(decision.delete)
        on_disk = sorted(decision.keep)
    return SimResult(
        name=name, written=len(saves), deleted=deleted, kept=tuple(on_disk), peak_checkpoints=peak
    )


def scenarios() -> list[SimResult]:
    """The two policies compared in BUILD.md."""
    saves = save_steps()
    return [
        simulate("keep all", None, saves),
        simulate(
            "last 3 + milestones (1, 2, 5)",
            policy.KeepLast(3) | policy.KeepMilestones((1, 2, 5)),
            saves,
        ),
    ]


def _size(gb: float) -> str:
    return f"{gb / 1000:,.2f} TB" if gb >= 1000 else f"{gb:,.0f} GB"


def render(results: list[SimResult]) -> str:
    """Formats the results as a markdown table with a one-line header."""
    lines = [
        f"Run: {RUN_HOURS} h at {STEP_SECONDS} s/step = {total_steps():,} steps; "
        f"a {CHECKPOINT_GB:.0f} GB checkpoint every {EVERY_STEPS:,} steps.",
        "",
        "| retention | checkpoints written | deleted | kept at end | peak storage "
        "| final storage |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.written:,} | {r.deleted:,} | {len(r.kept):,} "
            f"| {_size(r.peak_gb)} | {_size(r.final_gb)} |"
        )
    for r in results:
        if len(r.kept) < 50:
            lines += ["", f"Kept at the end by {r.name}: {', '.join(str(s) for s in r.kept)}."]
    return "\n".join(lines)


def main() -> None:
    print(render(scenarios()))


if __name__ == "__main__":
    main()
