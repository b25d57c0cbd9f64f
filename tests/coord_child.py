"""One JAX process (1 CPU device, gloo) of the coordination tests in ``test_coordination.py``.

Usage::

    python tests/coord_child.py --coordinator 127.0.0.1:PORT --num-processes P
        --process-id I --root ROOT --mode {count,fail_save,fail_restore,resume}
        [--save-timeout S]

The state is ``x`` (``8P x 4`` float32, sharded over every process), ``r``
(replicated) and the value leaf ``step``. Modes:

* ``count``: counts this process's coordination-service calls (the client is
  wrapped after ``jax.devices()``) while it opens a manager, saves step 1 and
  restores it; prints ``CALLS open|save|restore N``.
* ``fail_save``: commits step 1; saves step 2 (one process's storage refuses
  it: its test's proxy denies that step's writes) and step 3 (one process's
  state has a leaf that cannot be saved: its local check fails), printing
  ``FAILED <step> <class> <seconds>`` and ``MESSAGE <step> <text>`` for each;
  then commits step 4 (``COMMITTED 4``).
* ``fail_orbax``: commits step 1; saves step 2 while process 1 has no file
  descriptor to spare at the moment Orbax's save creates its event loop (a real
  ``EMFILE`` between Orbax's first collective and the next; the limit is back
  right after), printing ``FAILED``/``MESSAGE`` like ``fail_save``; then
  commits step 3.
* ``fail_snapshot``: commits step 1; saves step 2 while process 1's handler fails
  after its snapshots (the others have taken theirs and handed their write over), printing
  ``FAILED``/``MESSAGE`` like ``fail_save``; then commits step 3.
* ``fail_restore``: restores the newest step, 1 (one process cannot read its
  data), and prints ``FAILED`` and ``MESSAGE`` like ``fail_save``.
* ``resume``: the README resume loop: restores the newest restorable step
  ``s`` (``RESTORED s``; 0 on an empty root), then saves ``s + 1`` and ``s + 2``
  (``COMMITTED``).

Protocol lines go to stdout: ``READY``, the lines above, ``DONE``.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import sys
import time
from typing import Any

import numpy as np
from jaxgroup import join_group


def _say(text: str) -> None:
    print(text, flush=True)


class _Counting:
    """Delegates to the coordination-service client, counting calls by method."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return call


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--root", required=True)
    p.add_argument(
        "--mode",
        choices=(
            "count",
            "fail_save",
            "fail_check",
            "fail_orbax",
            "fail_snapshot",
            "fail_restore",
            "resume",
        ),
    )
    p.add_argument("--save-timeout", type=float, default=60.0)
    args = p.parse_args()
    join_group(args.coordinator, args.num_processes, args.process_id)

    import jax

    jax.devices()  # the CPU backend takes the real client; jaxckpt reads it at call time
    from jax._src import distributed

    counting = _Counting(distributed.global_state.client)
    distributed.global_state.client = counting

    import jaxckpt

    n = jax.process_count()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))

    def state(step: int) -> dict[str, Any]:
        full = np.arange(8 * n * 4, dtype=np.float32).reshape(8 * n, 4) + step
        sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return {
            "x": jax.make_array_from_callback(full.shape, sharded, lambda i: full[i]),
            "r": jax.make_array_from_callback((4,), replicated, lambda i: np.ones(4)[i] * step),
            "step": step,
        }

    def counted() -> str:
        """The calls since the last count: the total, then by method."""
        total = sum(counting.calls.values())
        detail = ",".join(f"{k}={v}" for k, v in sorted(counting.calls.items()))
        counting.calls.clear()
        return f"{total} {detail}"

    counted()
    mgr = jaxckpt.CheckpointManager(args.root, save_timeout_s=args.save_timeout)
    _say("READY")
    if args.mode == "count":
        _say(f"CALLS open {counted()}")
        mgr.save(1, state(1))
        mgr.wait()
        _say(f"CALLS save {counted()}")
        restored = mgr.restore()
        assert restored["step"] == 1, restored
        _say(f"CALLS restore {counted()}")
    elif args.mode == "fail_save":
        mgr.save(1, state(1))
        mgr.wait()
        _say("COMMITTED 1")
        for step in (2, 3):  # 2: a proxy denies one process's writes; 3: a bad leaf on one
            bad = {"bad": object()} if step == 3 and jax.process_index() == 1 else {}
            _failing(
                jaxckpt, step, lambda s=step, b=bad: (mgr.save(s, {**state(s), **b}), mgr.wait())
            )
        mgr.save(4, state(4))
        mgr.wait()
        _say("COMMITTED 4")
    elif args.mode in ("fail_orbax", "fail_snapshot"):
        mgr.save(1, state(1))
        mgr.wait()
        _say("COMMITTED 1")
        if jax.process_index() == 1:
            if args.mode == "fail_orbax":
                _no_descriptors_for_orbax_once()
            else:
                _handler_fails_once()
        _failing(jaxckpt, 2, lambda: (mgr.save(2, state(2)), mgr.wait()))
        mgr.save(3, state(3))
        mgr.wait()
        _say("COMMITTED 3")
    elif args.mode == "fail_restore":
        _failing(jaxckpt, 1, mgr.restore)
    else:
        step = 0
        if mgr.latest_step() is not None:
            step = mgr.restore()["step"]
        _say(f"RESTORED {step}")
        for s in (step + 1, step + 2):
            mgr.save(s, state(s))
            mgr.wait()
            _say(f"COMMITTED {s}")
    mgr.close()
    _say("DONE")
    return 0


def _handler_fails_once() -> None:
    """The handler's next save fails after its snapshots and its write's hand-over."""
    from jaxckpt.saving import _handler

    async_save = _handler.ZarrHandler.async_save

    async def failing(self: Any, directory: Any, args: Any) -> Any:
        _handler.ZarrHandler.async_save = async_save
        await async_save(self, directory, args)
        raise OSError(28, "No space left on device (injected after the snapshots)")

    _handler.ZarrHandler.async_save = failing  # type: ignore[method-assign]


def _no_descriptors_for_orbax_once() -> None:
    """The next event loop Orbax's save creates meets a file-descriptor limit of what
    is open now (a real EMFILE: epoll and the loop's self-pipe); the limit is restored
    right after that one call."""
    from orbax.checkpoint._src import asyncio_utils

    run_sync = asyncio_utils.run_sync

    def starved(coro: Any) -> Any:
        asyncio_utils.run_sync = run_sync
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))
        try:
            return run_sync(coro)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    asyncio_utils.run_sync = starved


def _failing(jaxckpt: Any, step: int, run: Any) -> None:
    """Runs ``run``, which must raise a CheckpointError: prints which, when, and its text."""
    start = time.monotonic()
    try:
        run()
    except jaxckpt.CheckpointError as e:
        _say(f"FAILED {step} {type(e).__name__} {time.monotonic() - start:.1f}")
        _say(f"MESSAGE {step} " + " ".join(str(e).split()))
    else:
        _say(f"UNEXPECTED success {step}")


if __name__ == "__main__":
    sys.exit(main())
