"""Tests for the arithmetic behind ``jaxckpt plan``."""

from __future__ import annotations

import math

import pytest

import jaxckpt
from jaxckpt.planning import PlanResult, object_plan, plan
from jaxckpt.policy import daly_interval

ARTICLE = {
    "params": 30e9,
    "bytes_per_param": 2,
    "step_seconds": 2.5,
    "write_gbps": 1.2,
    "every_steps": 1000,
    "mtbf_hours": 24,
    "gpus": 64,
    "gpu_hour_usd": 4,
}


def test_article_example() -> None:
    # 30B params in bf16 written at 1.2 GB/s: 60 GB, 50 s of stall per 2,500 s of training.
    result = plan(**ARTICLE)  # type: ignore[arg-type]
    assert result.to_dict() == pytest.approx(
        {
            "checkpoint_gb": 60.0,
            "save_seconds": 50.0,
            "overhead_percent": 2.0,
            "optimal_interval_steps": 1162,  # Daly: 2906.15 s / 2.5 s
            "checkpoints": 725,  # 504 h / 2.5 s = 725,760 steps
            "idle_gpu_hours": 725 * 50 * 64 / 3600,  # 644.4
            "idle_cost_usd": 725 * 50 * 64 / 3600 * 4,  # $2,577.78
            "expected_lost_minutes_per_failure": (1250 + 50) / 60,  # 21.7 min
        }
    )
    assert result.optimal_interval_steps == round(daly_interval(50, 24 * 3600) / 2.5)


def test_to_dict_has_exactly_the_documented_keys() -> None:
    assert list(plan(**ARTICLE).to_dict()) == [  # type: ignore[arg-type]
        "checkpoint_gb",
        "save_seconds",
        "overhead_percent",
        "optimal_interval_steps",
        "checkpoints",
        "idle_gpu_hours",
        "idle_cost_usd",
        "expected_lost_minutes_per_failure",
    ]


def test_async_blocking_replaces_save_time_for_stall_and_daly() -> None:
    result = plan(**ARTICLE, async_blocking_seconds=2.0)  # type: ignore[arg-type]
    assert result.save_seconds == pytest.approx(50.0)
    assert result.overhead_percent == pytest.approx(100 * 2 / 2500)
    assert result.idle_gpu_hours == pytest.approx(725 * 2 * 64 / 3600)
    assert result.optimal_interval_steps == round(daly_interval(2.0, 24 * 3600) / 2.5)
    # A failure still loses the write: the save is durable only once written.
    assert result.expected_lost_minutes_per_failure == pytest.approx((1250 + 50) / 60)


@pytest.mark.parametrize(
    ("changes", "key", "expected"),
    [
        ({"every_steps": 500}, "overhead_percent", 4.0),
        ({"every_steps": 100}, "overhead_percent", 20.0),
        ({"bytes_per_param": 4}, "checkpoint_gb", 120.0),
        ({"write_gbps": 0.6}, "save_seconds", 100.0),
        ({"run_hours": 1}, "checkpoints", 1),  # 1,440 steps
        ({"run_hours": 168, "every_steps": 1}, "checkpoints", 241920),
        ({"mtbf_hours": 0.005}, "optimal_interval_steps", 7),  # δ >= 2M: τ = M = 18 s
        ({"async_blocking_seconds": 0.0}, "optimal_interval_steps", 1),
    ],
)
def test_plan_table(changes: dict[str, float], key: str, expected: float) -> None:
    result = plan(**{**ARTICLE, **changes})  # type: ignore[arg-type]
    assert result.to_dict()[key] == pytest.approx(expected)


@pytest.mark.parametrize(
    "changes",
    [
        {"params": 0},
        {"step_seconds": -1},
        {"write_gbps": float("nan")},
        {"every_steps": 0},
        {"every_steps": 2.5},
        {"gpus": 0},
        {"mtbf_hours": 0},
        {"gpu_hour_usd": float("inf")},
        {"run_hours": 0},
        {"async_blocking_seconds": -1},
    ],
)
def test_plan_rejects_bad_arguments(changes: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        plan(**{**ARTICLE, **changes})  # type: ignore[arg-type]


def test_plan_result_validates() -> None:
    fields = plan(**ARTICLE).to_dict()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="idle_cost_usd"):
        PlanResult(**{**fields, "idle_cost_usd": -1.0})  # type: ignore[arg-type]


def test_format_text() -> None:
    text = plan(**ARTICLE).format_text()  # type: ignore[arg-type]
    for expected in [
        "60.0 GB",
        "50.0 s",
        "2.00 % of training time",
        "725",
        "644.4 GPU-hours",
        "$2,578",
        "21.7 min",
        "every 1,162 steps",
    ]:
        assert expected in text


# -- objects and requests per checkpoint, per layout ----------------------------------------


def test_object_plan_of_the_issue_example() -> None:
    # 70B parameters with Adam moments (12 bytes each), 2,200 leaves, FSDP over 256 GPUs.
    p = object_plan(checkpoint_bytes=70e9 * 12, leaves=2200, devices=256, checkpoints=1000)
    plain, packed = p["plain"], p["packed"]
    records = 6 + 32  # pending, tree, 2 group records, hint, marker; a manifest per host
    assert plain.objects_per_checkpoint == 2200 * 256 + 2200 + records  # ~563,000 chunks
    # 26.25 GB per host in packs of at most 64 MiB + 64 KiB (CheckpointOptions.max_object_bytes).
    cap = jaxckpt.CheckpointOptions().max_object_bytes
    assert packed.objects_per_checkpoint == 32 * math.ceil(840e9 / 32 / cap) + records
    assert packed.objects_per_checkpoint == 32 * 391 + records
    # Writes + deletes + LIST pages at $0.005 / 1,000, the read-backs at $0.0004 / 1,000.
    writes = plain.objects_per_checkpoint + 1 + (-(-(2200 * 256 + 2200) // 1000) + 2)
    assert plain.requests_per_checkpoint == writes + 1 + 33
    assert plain.request_cost_usd == pytest.approx((writes * 0.005 + 34 * 0.0004) / 1000)
    assert plain.request_cost_usd == pytest.approx(2.83, abs=0.01)
    assert plain.run_request_cost_usd == pytest.approx(1000 * plain.request_cost_usd)
    assert plain.request_seconds == pytest.approx(writes / 1000)  # > 9 minutes at 1,000/s
    assert packed.request_cost_usd < 0.07 and packed.request_seconds < 12.7  # 1/45 of plain


def test_object_plan_splits_large_shards_and_packs_small_states() -> None:
    big = object_plan(checkpoint_bytes=10 * 8 * (200 << 20), leaves=10, devices=8)
    assert big["plain"].objects_per_checkpoint == 10 * 8 * 4 + 10 + 7  # 200 MiB shards: 4 chunks
    # one host, 16,000 MiB in packs of at most 64 MiB (the default cap): 250 packs
    assert big["packed"].objects_per_checkpoint == 250 + 7
    capped = object_plan(
        checkpoint_bytes=10 * 8 * (200 << 20), leaves=10, devices=8, max_object_bytes=8 << 30
    )
    assert capped["packed"].objects_per_checkpoint == 16 + 7  # objects_in_flight packs
    small = object_plan(checkpoint_bytes=6.4e6, leaves=200, devices=8)
    assert small["packed"].objects_per_checkpoint == 2 + 7  # 6.4 MB: two packs of >= 4 MiB
    assert small["plain"].objects_per_checkpoint == 200 * 8 + 200 + 7


@pytest.mark.parametrize(
    ("field", "value"),
    [("leaves", 0), ("devices", 1.5), ("checkpoint_bytes", 0.0), ("write_usd_per_1000", -1.0)],
)
def test_object_plan_rejects_bad_values(field: str, value: float) -> None:
    args = {"checkpoint_bytes": 1e9, "leaves": 10, "devices": 8, field: value}
    with pytest.raises(ValueError, match=field):
        object_plan(**args)  # type: ignore[arg-type]
