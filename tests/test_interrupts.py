"""Ctrl-C interrupts a blocked caller while the I/O it waits for still stalls: in wait()
(also with ``OnPreemption`` in the save policy, whose watcher must not swallow SIGINT) and
in restore() while chunk reads stall.

Each test holds the storage or the write (until released; only a hang outlasts
``triggers.HANG_S``) and sends a process-directed SIGINT (as a terminal does) once the
held call has started and the main thread is blocked inside jaxckpt: it must surface as
``KeyboardInterrupt`` while the call is still held, whatever the machine's load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from triggers import Hold, Interrupter, main_thread_in

import jaxckpt
from jaxckpt import policy
from jaxckpt import storage as _storage
from jaxckpt.formats import _packed as _pack
from jaxckpt.formats import _tsio

pytestmark = pytest.mark.usefixtures("sigint_default")


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_ctrl_c_interrupts_wait_with_on_preemption_in_the_save_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    mgr = jaxckpt.CheckpointManager(
        str(tmp_path / "root"),
        save_policy=policy.EveryNSteps(1) | policy.OnPreemption(),
        layout=layout,
    )
    writer: Any = _tsio.ArrayWriter if layout == "plain" else _pack.PackWriter
    hold = Hold(writer.write)
    in_wait = main_thread_in("wait")
    try:
        monkeypatch.setattr(writer, "write", hold.as_method())
        assert mgr.save(1, {"w": np.arange(4.0)})
        with (
            Interrupter(
                lambda: hold.entered.is_set() and in_wait(), what="the write held"
            ) as ctrl_c,
            pytest.raises(KeyboardInterrupt),
        ):
            mgr.wait()
        assert ctrl_c.sent.is_set() and hold.returned == 0  # interrupted while still held
        assert mgr.preempted(1)  # the notice is kept too: the policy still sees it
    finally:
        hold.release()
        mgr.close()  # commits the step once the write is let go
    assert jaxckpt.CheckpointManager(str(tmp_path / "root"), read_only=True).steps() == [1]


@pytest.mark.parametrize("elsewhere", [False, True], ids=["main", "elsewhere"])
@pytest.mark.parametrize(("layout", "method"), [("plain", "read_buffer"), ("packed", "read_range")])
def test_ctrl_c_interrupts_a_restore_whose_chunk_reads_stall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, method: str, elsewhere: bool
) -> None:
    """``elsewhere``: another thread takes the SIGINT, as the kernel may choose (the main
    thread, waiting for a chunk read, must still see it)."""
    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root, chunk_bytes=4096, layout=layout) as mgr:
        mgr.save(1, {"w": np.arange(4096.0)})
    reader = jaxckpt.CheckpointManager(root, read_only=True)
    read = getattr(_storage.LocalStorage, method)
    hold = Hold(read)
    monkeypatch.setattr(_storage.LocalStorage, method, hold.as_method())
    try:
        # a chunk read only starts inside restore(), so the signal comes while it runs
        with (
            Interrupter(
                hold.entered.is_set, what=f"a held {method}", elsewhere=elsewhere
            ) as ctrl_c,
            pytest.raises(KeyboardInterrupt),
        ):
            reader.restore()
        assert ctrl_c.sent.is_set() and hold.returned == 0  # interrupted while still held
    finally:
        hold.release()
    monkeypatch.setattr(_storage.LocalStorage, method, read)
    np.testing.assert_array_equal(reader.restore()["w"], np.arange(4096.0))
