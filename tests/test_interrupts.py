"""Ctrl-C takes effect within about a second: in wait() (also with ``OnPreemption`` in the
save policy, whose watcher must not swallow SIGINT) and in restore() while chunk reads stall.

Each test sends a process-directed SIGINT (as a terminal does) from a timer thread once
the main thread is blocked inside jaxckpt, while the storage or the write holds for
``HOLD_S``; it must surface as ``KeyboardInterrupt`` long before the hold ends.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import jaxckpt
from jaxckpt import policy
from jaxckpt import storage as _storage
from jaxckpt.formats import _packed as _pack
from jaxckpt.formats import _tsio

HOLD_S = 20.0
PROMPT_S = 5.0  # "about a second", with room for a loaded machine


def _interrupt_soon(delay_s: float = 0.5) -> threading.Timer:
    timer = threading.Timer(delay_s, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def _held(method: Any, release: threading.Event) -> Any:
    def held(*args: Any, **kwargs: Any) -> Any:
        release.wait(HOLD_S)
        return method(*args, **kwargs)

    return held


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_ctrl_c_interrupts_wait_with_on_preemption_in_the_save_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    release = threading.Event()
    mgr = jaxckpt.CheckpointManager(
        str(tmp_path / "root"),
        save_policy=policy.EveryNSteps(1) | policy.OnPreemption(),
        layout=layout,
    )
    writer: Any = _tsio.ArrayWriter if layout == "plain" else _pack.PackWriter
    try:
        monkeypatch.setattr(writer, "write", _held(writer.write, release))
        assert mgr.save(1, {"w": np.arange(4.0)})
        start = time.monotonic()
        timer = _interrupt_soon()
        with pytest.raises(KeyboardInterrupt):
            mgr.wait()
        assert time.monotonic() - start < PROMPT_S
        assert mgr.preempted(1)  # the notice is kept too: the policy still sees it
        timer.join()
    finally:
        release.set()
        mgr.close()  # commits the step once the write is let go
    assert jaxckpt.CheckpointManager(str(tmp_path / "root"), read_only=True).steps() == [1]


@pytest.mark.parametrize(("layout", "method"), [("plain", "read_buffer"), ("packed", "read_range")])
def test_ctrl_c_interrupts_a_restore_whose_chunk_reads_stall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, method: str
) -> None:
    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root, chunk_bytes=4096, layout=layout) as mgr:
        mgr.save(1, {"w": np.arange(4096.0)})
    release = threading.Event()
    reader = jaxckpt.CheckpointManager(root, read_only=True)
    read = getattr(_storage.LocalStorage, method)
    monkeypatch.setattr(_storage.LocalStorage, method, _held(read, release))
    try:
        start = time.monotonic()
        timer = _interrupt_soon()
        with pytest.raises(KeyboardInterrupt):
            reader.restore()
        assert time.monotonic() - start < PROMPT_S
        timer.join()
    finally:
        release.set()
    monkeypatch.setattr(_storage.LocalStorage, method, read)
    np.testing.assert_array_equal(reader.restore()["w"], np.arange(4096.0))
