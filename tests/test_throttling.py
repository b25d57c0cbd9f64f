"""A store that throttles for longer than the old retry budget slows a save and a restore
down; it does not fail them (issue 35).

moto behind ``scripts/faultproxy.py``, which answers every request with ``503 SlowDown``
until :data:`STORM_S` seconds after both calls began: longer than the ~16-18 s after which
six attempts of 0.5-8 s gave up. Retries are bounded by the deadline (the manager's
``save_timeout_s``), so both calls go on through the storm and finish once it ends, with
the right step, bit-exact.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import faultproxy
import numpy as np
import pytest
from benchkit import servers
from triggers import HANG_S

import jaxckpt

STORM_S = 25.0
OLD_BUDGET_S = 18.0  # six attempts, 0.5-8 s apart: a full storm failed a save after this
# Windows of at most 2 s: a call finishes within ~2 s of the storm's end (8 s by default).
OPTIONS = {"max_delay_s": 2.0}


@pytest.fixture
def proxy(s3_server: servers.Server) -> Iterator[faultproxy.FaultProxy]:
    proxy = faultproxy.FaultProxy(s3_server.endpoint)
    yield proxy
    proxy.close()


def _storm(proxy: faultproxy.FaultProxy, began: list[threading.Event]) -> threading.Thread:
    """Every request answered ``503 SlowDown`` from now until STORM_S seconds after each
    of the calls has begun (each sets its event): however late a loaded machine starts
    one, it meets a storm longer than the old budget."""
    proxy.plan = faultproxy.FaultPlan(throttle=1.0)

    def end() -> None:
        for event in began:
            event.wait(HANG_S)
        time.sleep(STORM_S)
        proxy.plan = faultproxy.NO_FAULTS

    thread = threading.Thread(target=end, name="storm", daemon=True)
    thread.start()
    return thread


def test_a_storm_longer_than_the_old_retry_budget_slows_a_save_and_a_restore(
    proxy: faultproxy.FaultProxy, s3_server: servers.Server
) -> None:
    """One storm over a save of step 2 and a restore of step 1 (another manager) at once."""
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    options = {**OPTIONS, "endpoint": proxy.endpoint}
    rng = np.random.default_rng(0)
    first = {f"w{i}": rng.standard_normal(64 << 10, dtype=np.float32) for i in range(4)}
    second = {k: v + 1 for k, v in first.items()}
    restored: dict[str, object] = {}
    seconds: dict[str, float] = {}

    began = {"save": threading.Event(), "restore": threading.Event()}

    def restore(reader: jaxckpt.CheckpointManager) -> None:
        start = time.monotonic()
        began["restore"].set()
        restored.update(reader.restore(1))
        seconds["restore"] = time.monotonic() - start

    with (
        jaxckpt.CheckpointManager(root, storage_options=options) as mgr,
        jaxckpt.CheckpointManager(root, storage_options=options, read_only=True) as reader,
    ):
        mgr.save(1, first)
        mgr.wait()
        storm = _storm(proxy, list(began.values()))
        restoring = threading.Thread(target=restore, args=(reader,))
        restoring.start()
        start = time.monotonic()
        began["save"].set()
        mgr.save(2, second)
        mgr.wait()  # raises if the save failed
        seconds["save"] = time.monotonic() - start
        restoring.join(timeout=300)
        storm.join(HANG_S)
        assert not restoring.is_alive() and mgr.steps() == [1, 2]
    assert proxy.snapshot()["throttle"] > 0
    assert min(seconds.values()) > OLD_BUDGET_S, seconds  # both went on through the storm
    assert sorted(restored) == sorted(first)
    for name, value in first.items():
        np.testing.assert_array_equal(np.asarray(restored[name]), value, err_msg=name)
    with jaxckpt.CheckpointManager(root, storage_options=options, read_only=True) as mgr:
        assert mgr.latest_step() == 2
        again = mgr.restore()
    for name, value in second.items():
        np.testing.assert_array_equal(np.asarray(again[name]), value, err_msg=name)
