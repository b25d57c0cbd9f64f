"""Tests for jaxckpt.policy: tables per policy, plus property tests of retention invariants."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxckpt import policy
from jaxckpt.policy import (
    Adaptive,
    AnyKeep,
    AnySave,
    AtSteps,
    EveryNSeconds,
    EveryNSteps,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepMilestones,
    OnPreemption,
    RetentionPolicy,
    SaveContext,
    SavePolicy,
    StepInfo,
    daly_interval,
    decide_retention,
)

POLICY_PY = Path(__file__).resolve().parent.parent / "jaxckpt" / "policy.py"


def ctx(
    step: int,
    *,
    now: float = 0.0,
    last_step: int | None = None,
    last_time: float | None = None,
    preempted: bool = False,
    blocking: tuple[float, ...] = (),
) -> SaveContext:
    return SaveContext(
        step=step,
        now=now,
        last_saved_step=last_step,
        last_save_time=last_time,
        preempted=preempted,
        blocking_seconds=blocking,
    )


def infos(steps: Sequence[int], pinned: Sequence[int] = ()) -> list[StepInfo]:
    return [StepInfo(step=s, pinned=s in pinned) for s in steps]


def test_public_surface() -> None:
    assert sorted(policy.__all__) == [
        "Adaptive",
        "AllHealthy",
        "AnyHealthy",
        "AnyKeep",
        "AnySave",
        "AtSteps",
        "ComposableHealth",
        "ComposableRetention",
        "ComposableSave",
        "EveryNSeconds",
        "EveryNSteps",
        "FiniteMetrics",
        "HealthPolicy",
        "Healthy",
        "KeepBest",
        "KeepEvery",
        "KeepLast",
        "KeepMilestones",
        "MetricSpike",
        "OnPreemption",
        "RetentionDecision",
        "RetentionPolicy",
        "SaveContext",
        "SavePolicy",
        "StepInfo",
        "daly_interval",
        "decide_retention",
        "health_from",
        "retention_from",
    ]


def test_policy_module_imports_no_heavy_dependencies() -> None:
    # Loaded by path: jaxckpt/__init__.py may import jax, policy.py itself must not.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('isolated_policy', {str(POLICY_PY)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules[spec.name] = module\n"
        "spec.loader.exec_module(module)\n"
        "module.decide_retention(module.KeepLast(1) | module.KeepMilestones(), [])\n"
        "heavy = [m for m in ('jax', 'numpy', 'tensorstore') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------------------------------------ save side


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step": -1}, "step"),
        ({"step": 1.5}, "step"),
        ({"step": 1, "last_saved_step": -2}, "last_saved_step"),
        ({"step": 1, "blocking_seconds": (1.0, -1.0)}, "blocking_seconds"),
        ({"step": 1, "blocking_seconds": (math.inf,)}, "blocking_seconds"),
    ],
)
def test_save_context_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"now": 0.0, "last_saved_step": None, "last_save_time": None}
    with pytest.raises(ValueError, match=message):
        SaveContext(**{**base, **kwargs})  # type: ignore[arg-type]


def test_save_context_normalises_blocking_seconds_to_float_tuple() -> None:
    c = SaveContext(
        step=1,
        now=0,
        last_saved_step=None,
        last_save_time=None,
        blocking_seconds=[1, 2],  # type: ignore[arg-type]
    )
    assert c.blocking_seconds == (1.0, 2.0)


@pytest.mark.parametrize(
    ("policy_", "context", "expected"),
    [
        # EveryNSteps: multiples of n, aligned to 0, never re-saving the saved step.
        (EveryNSteps(10), ctx(0), True),
        (EveryNSteps(10), ctx(10), True),
        (EveryNSteps(10), ctx(15), False),
        (EveryNSteps(10), ctx(20, last_step=15), True),
        (EveryNSteps(10), ctx(20, last_step=20), False),
        (EveryNSteps(1000), ctx(1234, last_step=1000), False),
        (EveryNSteps(1000), ctx(2000, last_step=1234), True),
        (EveryNSteps(1), ctx(7, last_step=6), True),
        # EveryNSeconds: elapsed wall time since the last save; first call saves.
        (EveryNSeconds(60), ctx(1, now=5.0), True),
        (EveryNSeconds(60), ctx(2, now=59.9, last_time=0.0), False),
        (EveryNSeconds(60), ctx(2, now=60.0, last_time=0.0), True),
        (EveryNSeconds(0.5), ctx(2, now=100.4, last_time=100.0), False),
        # AtSteps.
        (AtSteps([5, 1, 5]), ctx(5), True),
        (AtSteps({5}), ctx(6), False),
        (AtSteps((0,)), ctx(0), True),
        (AtSteps((5,)), ctx(5, last_step=5), False),
        # OnPreemption: only the flag the manager sets.
        (OnPreemption(), ctx(3), False),
        (OnPreemption(), ctx(3, preempted=True), True),
        (OnPreemption(), ctx(3, last_step=3, preempted=True), True),
        # Unions.
        (EveryNSteps(10) | OnPreemption(), ctx(3, preempted=True), True),
        (EveryNSteps(10) | OnPreemption(), ctx(3), False),
        (EveryNSteps(10) | AtSteps([3]), ctx(3), True),
        (EveryNSteps(10) | AtSteps([3]), ctx(10), True),
    ],
)
def test_save_policies(policy_: SavePolicy, context: SaveContext, expected: bool) -> None:
    assert policy_.should_save(context) is expected


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: EveryNSteps(0), "n must be"),
        (lambda: EveryNSteps(2.5), "n must be"),  # type: ignore[arg-type]
        (lambda: EveryNSteps(True), "n must be"),
        (lambda: EveryNSeconds(0), "seconds"),
        (lambda: EveryNSeconds(-1), "seconds"),
        (lambda: EveryNSeconds(math.nan), "seconds"),
        (lambda: AtSteps([1, -1]), "AtSteps"),
        (lambda: Adaptive(0), "mtbf_hours"),
        (lambda: Adaptive(24, max_overhead=0), "max_overhead"),
        (lambda: Adaptive(24, max_overhead=1.5), "max_overhead"),
        (lambda: AnySave(policies=()), "at least one"),
    ],
)
def test_save_policy_constructors_validate(factory: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        factory()


def test_save_union_flattens_and_keeps_order() -> None:
    a, b, c = EveryNSteps(10), OnPreemption(), AtSteps([3])
    assert (a | b) | c == a | (b | c) == AnySave(policies=(a, b, c))
    assert AnySave(policies=(AnySave(policies=(a, b)), c)).policies == (a, b, c)


def test_save_union_accepts_plain_protocol_implementations() -> None:
    class Always:
        def should_save(self, ctx: SaveContext) -> bool:
            return True

    always = Always()
    assert isinstance(always, SavePolicy)
    assert (always | EveryNSteps(10)).policies == (always, EveryNSteps(10))  # __ror__
    assert (EveryNSteps(10) | always).should_save(ctx(3))
    with pytest.raises(TypeError, match="save policy"):
        EveryNSteps(10) | object()  # type: ignore[operator]


# ------------------------------------------------------------------------- Daly / Adaptive


@pytest.mark.parametrize(
    ("delta", "mtbf", "expected"),
    [
        # δ/2M = 1/100: √(2δM)·(1 + 1/30 + 1/900) − δ = 20·931/900 − 2.
        (2.0, 100.0, 841 / 45),
        (1.0, 50.0, 841 / 90),
        # δ/2M = 1/4: 2·(1 + 1/6 + 1/36) − 1 = 25/18.
        (1.0, 2.0, 25 / 18),
        # δ/2M = 1/144: 600·(1 + 1/36 + 1/1296) − 50.
        (50.0, 3600.0, 600 * 1333 / 1296 - 50),
        # 60 GB at 1.2 GB/s, MTBF one day: √8,640,000·(1 + √(50/172800)/3 + …) − 50.
        (50.0, 86400.0, 2906.15),
        # δ >= 2M: τ = M.
        (10.0, 5.0, 5.0),
        (20.0, 5.0, 5.0),
        (0.0, 100.0, 0.0),
    ],
)
def test_daly_interval_hand_computed(delta: float, mtbf: float, expected: float) -> None:
    assert daly_interval(delta, mtbf) == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize(("delta", "mtbf"), [(-1.0, 10.0), (1.0, 0.0), (math.nan, 1.0)])
def test_daly_interval_rejects_bad_arguments(delta: float, mtbf: float) -> None:
    with pytest.raises(ValueError):
        daly_interval(delta, mtbf)


@pytest.mark.parametrize(
    ("mtbf_hours", "max_overhead", "delta", "expected"),
    [
        (24.0, 0.02, 50.0, 2906.15),  # Daly wins over the 2500 s cap.
        (1.0, 0.02, 50.0, 2500.0),  # Daly says 567 s; 50 s blocking must stay <= 2 %.
        (1.0, 0.10, 50.0, 600 * 1333 / 1296 - 50),  # with a 10 % cap Daly wins again.
        (1.0, 0.01, 50.0, 5000.0),
    ],
)
def test_adaptive_interval_is_daly_with_overhead_cap(
    mtbf_hours: float, max_overhead: float, delta: float, expected: float
) -> None:
    adaptive = Adaptive(mtbf_hours, max_overhead=max_overhead)
    assert adaptive.interval_seconds(delta) == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize(
    ("context", "expected"),
    [
        (ctx(1, now=0.0), True),  # nothing measured, nothing saved: save to measure.
        (ctx(9, now=1.0, last_step=1, last_time=0.0), True),  # still no measurement.
        (ctx(9, now=1.0, blocking=(50.0,)), True),  # run has not saved yet.
        (ctx(9, now=2499.0, last_step=1, last_time=0.0, blocking=(50.0,)), False),
        (ctx(9, now=2500.0, last_step=1, last_time=0.0, blocking=(50.0,)), True),
        # Median, not mean: one slow first save (compilation) does not stretch the interval.
        (ctx(9, now=2500.0, last_step=1, last_time=0.0, blocking=(900.0, 50.0, 50.0)), True),
        (ctx(9, now=2500.0, last_step=1, last_time=0.0, blocking=(50.0, 60.0)), False),
        (ctx(9, now=2750.0, last_step=1, last_time=0.0, blocking=(50.0, 60.0)), True),
    ],
)
def test_adaptive_should_save(context: SaveContext, expected: bool) -> None:
    assert Adaptive(1.0).should_save(context) is expected


@given(
    delta=st.floats(0.001, 1e4),
    mtbf_hours=st.floats(0.01, 1e4),
    max_overhead=st.floats(0.001, 1.0),
)
def test_adaptive_never_exceeds_overhead_cap(
    delta: float, mtbf_hours: float, max_overhead: float
) -> None:
    interval = Adaptive(mtbf_hours, max_overhead=max_overhead).interval_seconds(delta)
    assert delta / interval <= max_overhead * (1 + 1e-12)
    assert interval >= daly_interval(delta, mtbf_hours * 3600)


# ------------------------------------------------------------------------- retention side


@pytest.mark.parametrize(
    ("policy_", "steps", "expected"),
    [
        (KeepLast(2), [5, 1, 3], {3: ("KeepLast(2)",), 5: ("KeepLast(2)",)}),
        (KeepLast(5), [1, 2], {1: ("KeepLast(5)",), 2: ("KeepLast(5)",)}),
        (KeepLast(1), [], {}),
        (
            KeepEvery(10),
            [5, 10, 15, 20, 0],
            {0: ("KeepEvery(10)",), 10: ("KeepEvery(10)",), 20: ("KeepEvery(10)",)},
        ),
        (KeepMilestones(), [], {}),
        (KeepMilestones(), [0], {}),
        (
            KeepMilestones(),
            [3, 7, 12, 60],
            {
                3: ("milestone 1", "milestone 2"),
                7: ("milestone 5",),
                12: ("milestone 10",),
                60: ("milestone 20", "milestone 50"),
            },
        ),
        (
            KeepMilestones((1,)),
            [0, 1, 2, 9, 10, 11, 99, 100, 101],
            {1: ("milestone 1",), 10: ("milestone 10",), 100: ("milestone 100",)},
        ),
        (
            KeepMilestones((5, 2, 1, 2)),  # order and duplicates do not matter
            [1000, 2000, 3000, 4000, 5000],
            {
                1000: tuple(f"milestone {m}" for m in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)),
                2000: ("milestone 2000",),
                5000: ("milestone 5000",),
            },
        ),
    ],
)
def test_step_rules(
    policy_: RetentionPolicy, steps: list[int], expected: dict[int, tuple[str, ...]]
) -> None:
    assert policy_.keep(infos(steps)) == expected


def test_keep_milestones_over_every_ten_steps() -> None:
    kept = KeepMilestones((1, 2, 5)).keep(infos(range(10, 20001, 10)))
    assert sorted(kept) == [10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]


def _metric_steps(losses: dict[int, float | None]) -> list[StepInfo]:
    return [
        StepInfo(step=s, metrics=None if v is None else {"loss": v, "acc": -v})
        for s, v in losses.items()
    ]


@pytest.mark.parametrize(
    ("policy_", "losses", "expected"),
    [
        (KeepBest(2, "loss"), {1: 3.0, 2: 1.0, 3: 2.0, 4: 5.0}, [2, 3]),
        (KeepBest(2, "loss", mode="max"), {1: 3.0, 2: 1.0, 3: 2.0, 4: 5.0}, [1, 4]),
        (KeepBest(1, "acc", mode="max"), {1: 3.0, 2: 1.0, 3: 2.0}, [2]),
        (KeepBest(2, "loss"), {1: None, 2: 4.0, 3: None}, [2]),  # no metric: not kept
        (KeepBest(2, "loss"), {1: math.nan, 2: 4.0, 3: 5.0}, [2, 3]),  # NaN: not kept
        (KeepBest(1, "loss"), {1: 1.0, 2: 1.0, 3: 2.0}, [2]),  # ties go to the newer step
        (KeepBest(3, "missing"), {1: 1.0, 2: 2.0}, []),
    ],
)
def test_keep_best(policy_: KeepBest, losses: dict[int, float | None], expected: list[int]) -> None:
    kept = policy_.keep(_metric_steps(losses))
    assert sorted(kept) == expected
    reason = f"KeepBest({policy_.n}, {policy_.metric}, {policy_.mode})"
    assert all(r == (reason,) for r in kept.values())


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: KeepLast(0), "k must be"),
        (lambda: KeepEvery(0), "n must be"),
        (lambda: KeepMilestones(()), "series"),
        (lambda: KeepMilestones((0, 1)), "series"),
        (lambda: KeepBest(0, "loss"), "n must be"),
        (lambda: KeepBest(1, ""), "metric"),
        (lambda: KeepBest(1, "loss", mode="median"), "mode"),  # type: ignore[arg-type]
        (lambda: AnyKeep(policies=()), "at least one"),
        (lambda: StepInfo(step=-1), "step"),
    ],
)
def test_retention_constructors_validate(factory: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        factory()


def test_keep_union_merges_reasons_and_flattens() -> None:
    union = KeepLast(2) | KeepEvery(10) | KeepMilestones((1,))
    assert isinstance(union, AnyKeep)
    assert len(union.policies) == 3
    assert union.keep(infos([1, 10, 15, 20])) == {
        1: ("milestone 1",),
        10: ("KeepEvery(10)", "milestone 10"),
        15: ("KeepLast(2)",),
        20: ("KeepLast(2)", "KeepEvery(10)"),
    }
    with pytest.raises(TypeError, match="retention policy"):
        KeepLast(1) | 3  # type: ignore[operator]


@pytest.mark.parametrize(
    ("policy_", "steps", "pinned", "protected", "keep", "delete"),
    [
        (
            None,
            [3, 1, 2],
            [],
            [],
            {s: ("no retention policy",) for s in (1, 2)} | {3: ("no retention policy", "newest")},
            (),
        ),
        (None, [], [], [], {}, ()),
        (KeepLast(1), [1, 2, 3], [], [], {3: ("KeepLast(1)", "newest")}, (1, 2)),
        (
            KeepEvery(10),
            [10, 20, 25],
            [],
            [],
            {10: ("KeepEvery(10)",), 20: ("KeepEvery(10)",), 25: ("newest",)},
            (),
        ),
        (
            KeepEvery(10),
            [10, 15, 17],
            [15],
            [],
            {10: ("KeepEvery(10)",), 15: ("pinned",), 17: ("newest",)},
            (),
        ),
        (
            KeepLast(1),
            [1, 2, 3],
            [2],
            [1, 99],
            {1: ("in use",), 2: ("pinned",), 3: ("KeepLast(1)", "newest")},
            (),
        ),
        (
            KeepLast(1),
            [1, 2, 3],
            [3],
            [3],
            {3: ("KeepLast(1)", "newest", "pinned", "in use")},
            (1, 2),
        ),
    ],
)
def test_decide_retention(
    policy_: RetentionPolicy | None,
    steps: list[int],
    pinned: list[int],
    protected: list[int],
    keep: dict[int, tuple[str, ...]],
    delete: tuple[int, ...],
) -> None:
    decision = decide_retention(policy_, infos(steps, pinned), protected=protected)
    assert decision.keep == keep
    assert list(decision.keep) == sorted(decision.keep)
    assert decision.delete == delete


def test_decide_retention_ignores_steps_a_policy_invents() -> None:
    class Bogus:
        def keep(self, steps: Sequence[StepInfo]) -> dict[int, tuple[str, ...]]:
            return {99: ("bogus",), 1: ("bogus",)}

    decision = decide_retention(Bogus(), infos([1, 2, 3]))
    assert decision.keep == {1: ("bogus",), 3: ("newest",)}
    assert decision.delete == (2,)


def test_decide_retention_rejects_duplicate_steps() -> None:
    with pytest.raises(ValueError, match="unique"):
        decide_retention(KeepLast(1), infos([1, 2, 2]))


def test_retention_decision_rejects_overlap() -> None:
    with pytest.raises(ValueError, match="both"):
        policy.RetentionDecision(keep={1: ("x",)}, delete=(1,))


def _incremental(
    retention: RetentionPolicy, arrivals: Sequence[StepInfo]
) -> tuple[list[int], set[int]]:
    """Adds steps one at a time, deleting after each; returns what is left and milestones."""
    on_disk: list[StepInfo] = []
    milestone_steps: set[int] = set()
    for info in arrivals:
        on_disk.append(info)
        decision = decide_retention(retention, on_disk)
        on_disk = [i for i in on_disk if i.step in decision.keep]
        assert milestone_steps <= set(decision.keep), "a milestone step was deleted"
        milestone_steps |= {
            s for s, why in decision.keep.items() if any(r.startswith("milestone") for r in why)
        }
    return [i.step for i in on_disk], milestone_steps


def test_every_10_steps_to_20000_with_last_3_and_milestones() -> None:
    save = EveryNSteps(10)
    arrivals: list[StepInfo] = []
    for step in range(1, 20001):
        last = arrivals[-1].step if arrivals else None
        if save.should_save(ctx(step, last_step=last)):
            arrivals.append(StepInfo(step=step))
    assert len(arrivals) == 2000
    left, _ = _incremental(KeepLast(3) | KeepMilestones((1, 2, 5)), arrivals)
    assert left == [10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 19980, 19990, 20000]


# ------------------------------------------------------------------ retention properties

step_lists = st.lists(st.integers(0, 10**7), min_size=1, max_size=60, unique=True)
series_st = st.lists(st.integers(1, 9), min_size=1, max_size=4)
rules = st.one_of(
    st.builds(KeepLast, st.integers(1, 6)),
    st.builds(KeepMilestones, series_st),
    st.builds(KeepEvery, st.integers(1, 1000)),
    st.builds(
        lambda n, mode: KeepBest(n, "loss", mode=mode),
        st.integers(1, 4),
        st.sampled_from(["min", "max"]),
    ),
)
retention_policies = st.one_of(
    rules, st.lists(rules, min_size=1, max_size=3).map(lambda rs: AnyKeep(policies=tuple(rs)))
)


@st.composite
def step_infos(draw: st.DrawFn, *, with_pins: bool = True) -> list[StepInfo]:
    steps = draw(step_lists)
    return [
        StepInfo(
            step=s,
            metrics=draw(st.none() | st.builds(lambda v: {"loss": v}, st.integers(0, 5))),
            pinned=with_pins and draw(st.booleans()),
        )
        for s in steps
    ]


@given(retention=st.none() | retention_policies, steps=step_infos())
def test_newest_and_pinned_are_always_kept(
    retention: RetentionPolicy | None, steps: list[StepInfo]
) -> None:
    decision = decide_retention(retention, steps)
    assert max(i.step for i in steps) in decision.keep
    assert {i.step for i in steps if i.pinned} <= set(decision.keep)
    assert sorted([*decision.keep, *decision.delete]) == sorted(i.step for i in steps)
    assert list(decision.delete) == sorted(decision.delete)


@given(k=st.integers(1, 6), series=series_st, steps=step_infos())
def test_kept_set_is_logarithmic(k: int, series: list[int], steps: list[StepInfo]) -> None:
    decision = decide_retention(KeepLast(k) | KeepMilestones(series), steps)
    digits = len(str(max(i.step for i in steps)))
    pinned = sum(i.pinned for i in steps)
    assert len(decision.keep) <= k + len(set(series)) * digits + pinned


@given(retention=retention_policies, steps=step_infos())
def test_retention_is_idempotent(retention: RetentionPolicy, steps: list[StepInfo]) -> None:
    first = decide_retention(retention, steps)
    survivors = [i for i in steps if i.step in first.keep]
    second = decide_retention(retention, survivors)
    assert second.keep == first.keep
    assert second.delete == ()


@given(retention=retention_policies, steps=step_infos(), seed=st.randoms())
def test_retention_ignores_input_order(
    retention: RetentionPolicy, steps: list[StepInfo], seed: random.Random
) -> None:
    shuffled = list(steps)
    seed.shuffle(shuffled)
    assert decide_retention(retention, shuffled) == decide_retention(retention, steps)


@settings(max_examples=200)
@given(k=st.integers(1, 4), series=series_st, steps=step_infos(with_pins=False))
def test_milestones_stay_kept_as_steps_arrive(
    k: int, series: list[int], steps: list[StepInfo]
) -> None:
    retention = KeepLast(k) | KeepMilestones(series)
    arrivals = sorted(steps, key=lambda i: i.step)
    left, milestone_steps = _incremental(retention, arrivals)
    assert milestone_steps <= set(left)
    # Deleting as we go ends where deciding once over every step would.
    assert left == sorted(decide_retention(retention, arrivals).keep)


@given(retention=retention_policies, steps=step_infos(with_pins=False))
def test_incremental_retention_matches_batch(
    retention: RetentionPolicy, steps: list[StepInfo]
) -> None:
    arrivals = sorted(steps, key=lambda i: i.step)
    left, _ = _incremental(retention, arrivals)
    assert left == sorted(decide_retention(retention, arrivals).keep)
