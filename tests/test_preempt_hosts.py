"""A preemption notice that reaches one host of a multi-host job stops every host at one step.

Two real JAX processes of the game day's trainer (``scripts/benchkit/gameday_child.py``,
a tiered manager whose save policy includes ``OnPreemption``) train; once both have
trained step 3, SIGTERM goes to process 1 only. Both must save the same step, say
``PREEMPTED`` at it and exit 0, and that step is committed on both local tiers (before:
jaxckpt's own SIGTERM handler replaced JAX's notifier, so process 1 alone saw the
notice; the primary's agreed "no save" left nothing saved, process 1 left the loop and
process 0 waited for it in the next step's collective until it was killed; found by
the game day as a preemption that lost steps).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import pytest
from benchkit import servers

from jaxckpt import _preemption, policy
from jaxckpt.commit import CommitProtocol
from jaxckpt.storage import open_storage

CHILD = Path(__file__).resolve().parents[1] / "scripts" / "benchkit" / "gameday_child.py"
TIMEOUT_S = 240.0

pytestmark = pytest.mark.timeout(300)


def test_sigterm_to_one_host_preempts_every_host_at_one_step(tmp_path: Path) -> None:
    port = servers.free_port()
    events: queue.Queue[tuple[int, list[str]]] = queue.Queue()
    procs = []
    for i in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCKPT_")}
        env.update(JAXCKPT_NODE_ID=f"node{i}", JAX_PLATFORMS="cpu")
        argv = [
            sys.executable,
            str(CHILD),
            "--contender=jaxckpt",
            f"--durable={tmp_path / 'durable'}",
            f"--local={tmp_path / 'node'}",
            "--steps=100000",
            "--every=1000",
            "--step-sleep=0.05",
            "--num-processes=2",
            f"--process-id={i}",
            f"--coordinator=127.0.0.1:{port}",
        ]
        with open(tmp_path / f"child-{i}.log", "wb") as log:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        procs.append(proc)

        def read(i: int = i, proc: subprocess.Popen[str] = proc) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("EV "):
                    events.put((i, line.split()[2:]))

        threading.Thread(target=read, daemon=True).start()
    try:
        trained: set[int] = set()
        preempted: dict[int, int] = {}
        while len(preempted) < 2:
            i, words = events.get(timeout=TIMEOUT_S)
            if words[0] == "STEP" and int(words[1]) >= 3 and i not in trained:
                trained.add(i)
                if trained == {0, 1}:
                    procs[1].send_signal(signal.SIGTERM)  # one host only
            elif words[0] == "PREEMPTED":
                preempted[i] = int(words[1])
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    logs = "\n".join((tmp_path / f"child-{i}.log").read_text()[-2000:] for i in range(2))
    assert codes == [0, 0], logs
    assert preempted[0] == preempted[1], preempted
    step = preempted[0]
    for i in range(2):
        local = CommitProtocol(open_storage(str(tmp_path / f"node{i}")))
        assert step in local.visible_refs(), (i, sorted(local.visible_refs()))


@pytest.mark.parametrize(
    ("save_policy", "jax_syncs", "alike"),
    [
        (policy.EveryNSteps(5), False, True),
        (policy.EveryNSteps(5) | policy.AtSteps([7]), False, True),
        (policy.EveryNSteps(5) | policy.OnPreemption(), True, True),  # JAX's sync point
        (policy.EveryNSteps(5) | policy.OnPreemption(), False, False),  # each its own SIGTERM
        (policy.EveryNSeconds(60.0), True, False),  # each host's own clock
        (policy.EveryNSteps(5) | policy.Adaptive(mtbf_hours=1.0), True, False),
    ],
)
def test_only_a_policy_every_host_answers_alike_skips_the_agreement_per_step(
    monkeypatch: pytest.MonkeyPatch, save_policy: Any, jax_syncs: bool, alike: bool
) -> None:
    """A declined save of several processes agrees its decision only when the hosts could
    answer differently (the test above is the same-step preemption it relies on)."""
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    monkeypatch.setattr(_preemption, "_jax_syncs", lambda: jax_syncs)
    assert _preemption.notices_alike(save_policy) is alike
