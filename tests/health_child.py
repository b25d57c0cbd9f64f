"""A run that restores and then ends, for the crash-loop tests (``tests/test_health.py``).

Usage::

    python tests/health_child.py ROOT HOW [--limit N]
        [--coordinator 127.0.0.1:PORT --num-processes P --process-id I]

It opens ``jaxckpt.CheckpointManager(ROOT, crash_loop_limit=N)``, restores the newest
good step and prints ``RESTORED s``, then ends as ``HOW`` says: ``sigkill`` (SIGKILL to
itself: no user code runs), ``exit`` (``os._exit(3)``: no ``close()``, no atexit),
``clean`` (``close()``, then ``CLOSED``) or ``preempted`` (SIGTERM to itself under
``policy.OnPreemption()``, ``mgr.preempted()`` asked as a training loop does, then
SIGKILL). With ``--coordinator`` it first joins a group of real JAX processes (one CPU
device each) and closes cleanly.
"""

from __future__ import annotations

import argparse
import os
import signal


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("how", choices=("sigkill", "exit", "clean", "preempted"))
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    args = parser.parse_args()
    if args.coordinator is not None:
        from jaxgroup import join_group

        join_group(args.coordinator, args.num_processes, args.process_id)

    import jaxckpt

    save_policy = jaxckpt.policy.OnPreemption() if args.how == "preempted" else None
    mgr = jaxckpt.CheckpointManager(
        args.root, crash_loop_limit=args.limit, save_policy=save_policy, save_timeout_s=60
    )
    state = mgr.restore()
    assert int(state["step"]) == mgr.restored_step
    print(f"RESTORED {mgr.restored_step}", flush=True)
    if args.how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.how == "exit":
        os._exit(3)
    if args.how == "preempted":
        os.kill(os.getpid(), signal.SIGTERM)  # the handler sets the flag
        assert mgr.preempted(mgr.restored_step)
        os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    print("CLOSED", flush=True)
    return 0


if __name__ == "__main__":  # the suite imports every module of tests/ for doctests
    raise SystemExit(main())
