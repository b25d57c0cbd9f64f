"""Every float option refuses NaN, and infinity where it makes no sense.

NaN compares false with everything: ``save_timeout_s=nan`` made every
``elapsed > timeout`` false and so switched off every deadline.
"""

from __future__ import annotations

import argparse
import math

import pytest

from jaxckpt import CheckpointOptions, ObjectStoreOptions
from jaxckpt.cli._common import seconds
from jaxckpt.planning import Link
from jaxckpt.policy import Adaptive, EveryNSeconds
from jaxckpt.storage._retry import Backoff

NAN, INF = math.nan, math.inf

REFUSED = [
    (CheckpointOptions, "save_timeout_s", NAN),
    (CheckpointOptions, "save_timeout_s", INF),
    (CheckpointOptions, "peer_timeout_s", NAN),
    (CheckpointOptions, "peer_timeout_s", INF),
    (CheckpointOptions, "gc_grace_s", NAN),
    (CheckpointOptions, "gc_grace_s", -INF),
    (ObjectStoreOptions, "retry_deadline_s", NAN),
    (ObjectStoreOptions, "retry_deadline_s", INF),
    (ObjectStoreOptions, "timeout_s", NAN),
    (ObjectStoreOptions, "timeout_s", INF),
    (ObjectStoreOptions, "initial_delay_s", NAN),
    (ObjectStoreOptions, "max_delay_s", NAN),
    (ObjectStoreOptions, "max_delay_s", INF),
    (Backoff, "initial_s", NAN),
    (Backoff, "max_s", NAN),
    (Backoff, "max_s", INF),
    (Backoff, "deadline_s", NAN),
    (Backoff, "deadline_s", INF),
    (Link, "rtt_s", NAN),
    (Link, "rtt_s", INF),
    (Link, "conn_bytes_per_s", NAN),
    (Link, "host_bytes_per_s", INF),
]


@pytest.mark.parametrize(("cls", "name", "value"), REFUSED)
def test_a_float_option_refuses_a_value_without_meaning(cls: type, name: str, value: float) -> None:
    with pytest.raises(ValueError, match=name):
        cls(**{name: value})


def test_an_infinite_grace_keeps_every_attempt_of_the_epoch() -> None:
    """gc_grace_s=inf has a meaning (never collect the current epoch's attempts): kept."""
    assert CheckpointOptions(gc_grace_s=INF).gc_grace_s == INF


@pytest.mark.parametrize("value", [NAN, INF])
def test_policies_refuse_nan_and_infinity(value: float) -> None:
    for make in (lambda: EveryNSeconds(value), lambda: Adaptive(value)):
        with pytest.raises(ValueError, match="finite"):
            make()


@pytest.mark.parametrize("text", ["nan", "inf", "-1"])
def test_cli_seconds_refuse_nan_and_infinity(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        seconds(text)


@pytest.mark.parametrize(
    "args",
    [
        ["promote", "/tmp/a", "/tmp/b", "--interval", "nan"],
        ["promote", "/tmp/a", "/tmp/b", "--parts-timeout", "inf"],
        ["promote", "/tmp/a", "/tmp/b", "--archive-after-hours", "nan"],
    ],
)
def test_cli_time_flags_refuse_nan_and_infinity(args: list[str], capsys) -> None:
    from jaxckpt.cli._main import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag", ["--mtbf-hours", "--step-seconds", "--write-gbps", "--rtt-ms", "--params"]
)
@pytest.mark.parametrize("text", ["nan", "inf"])
def test_plan_numbers_refuse_nan_and_infinity(flag: str, text: str, capsys) -> None:
    from jaxckpt.cli._main import main

    with pytest.raises(SystemExit) as exc:
        main(["plan", flag, text])
    assert exc.value.code == 2
    assert "finite" in capsys.readouterr().err
