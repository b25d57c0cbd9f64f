"""End-to-end demo: train, crash, resume automatically, then inspect the checkpoints.

    bash scripts/dev.sh demo            # or: python scripts/demo.py [--root DIR]

1. Starts ``scripts/train.py`` (a small Flax NNX transformer on the Python standard
   library's source) with checkpoints under ``--root`` (wiped first).
2. SIGKILLs it once a couple of saves are committed: no chance to clean up.
3. Starts the very same command again: it resumes from the newest committed step and
   finishes the run.
4. Prints what happened, then runs ``jaxckpt ls`` and ``jaxckpt verify --all`` on the root.

Takes about a minute on two slow CPU cores (the second start reuses the first one's
compiled program from a JAX compilation cache in the system temp directory).
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOG_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\] ")
SHOWN = re.compile(r"resumed|fresh start|checkpoint:|step \d+: loss|done at|preempted|corpus")


def train_command(root: Path, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        str(HERE / "train.py"),
        f"--checkpoint_root={root}",
        f"--steps={args.steps}",
        f"--checkpoint_every_steps={args.every}",
        "--checkpoint_keep_last=3",
        "--checkpoint_keep_milestones=1,2,5",
        f"--log_every={max(1, args.every // 2)}",
        f"--compilation_cache={Path(tempfile.gettempdir()) / 'jaxckpt-demo-jax-cache'}",
    ]


def run_training(label: str, cmd: list[str], kill_after_saves: int | None) -> list[str]:
    """Runs the training command, echoing its main log lines.

    With ``kill_after_saves``, SIGKILLs it at the first logged step after that many
    committed saves.
    """
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    messages: list[str] = []
    saves = 0
    killed = False
    for line in proc.stderr:
        message = LOG_PREFIX.sub("", line.rstrip())
        messages.append(message)
        if SHOWN.search(message) or line.startswith(("E", "F", "Traceback")):
            print(f"  [{label}] {message}", flush=True)
        if message.startswith("checkpoint:"):
            saves += 1
        elif kill_after_saves is not None and saves >= kill_after_saves and _loss_step(message):
            kill_after_saves = None  # mid-way to the next save, so some work is lost
            print(f"  [{label}] *** SIGKILL: a simulated crash, no chance to clean up ***")
            proc.send_signal(signal.SIGKILL)
            killed = True
    rc = proc.wait()
    if not killed and rc != 0:
        print("\n".join(messages[-30:]), file=sys.stderr)
        raise SystemExit(f"training failed with exit status {rc}")
    return messages


def jaxckpt_cli(*argv: str) -> int:
    print(f"\n$ jaxckpt {' '.join(argv)}", flush=True)
    return subprocess.call([sys.executable, "-m", "jaxckpt", *argv])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="./demo_ckpt", help="checkpoint root (wiped first)")
    parser.add_argument("--steps", type=int, default=240, help="train until this step")
    parser.add_argument("--every", type=int, default=20, help="save every N steps")
    parser.add_argument("--kill-after", type=int, default=2, help="SIGKILL after N saves")
    args = parser.parse_args()
    root = Path(args.root).resolve()
    if "://" not in args.root and root.exists():
        shutil.rmtree(root)
    cmd = train_command(root, args)
    start = time.monotonic()

    print(f"== 1. train, then crash after {args.kill_after} committed saves")
    first = run_training("run 1", cmd, kill_after_saves=args.kill_after)
    committed_1 = [int(m.group(1)) for m in map(_committed, first) if m]
    losses_1 = {int(m.group(1)): m.group(2) for m in map(_loss_step, first) if m}
    reached = max(losses_1, default=0)

    jaxckpt_cli("ls", str(root))

    print("\n== 2. the same command again: it resumes from the newest committed step")
    second = run_training("run 2", cmd, kill_after_saves=None)
    resumed = next((m for m in map(_resumed, second) if m), None)
    committed_2 = [int(m.group(1)) for m in map(_committed, second) if m]
    losses_2 = {int(m.group(1)): m.group(2) for m in map(_loss_step, second) if m}
    replayed = sorted(set(losses_1) & set(losses_2))
    done = next((m for m in second if m.startswith("done at")), "")

    print("\n== What happened")
    print(f"  run 1 committed steps {committed_1}, logged up to step {reached}, then was killed")
    if resumed:
        print(f"  run 2 resumed from step {resumed.group(1)} (data position {resumed.group(2)})")
    if replayed:
        same = all(losses_1[s] == losses_2[s] for s in replayed)
        pairs = ", ".join(f"step {s}: {losses_1[s]} / {losses_2[s]}" for s in replayed)
        verdict = "identical" if same else "DIFFERENT"
        print(f"  steps redone after the crash have {verdict} losses (run 1 / run 2): {pairs}")
    print(f"  run 2 committed steps {committed_2} and finished at step {args.steps}")
    print(f"  run 2 {done}" if done else "  run 2 did not report its overhead")
    print(f"  wall time of the demo so far: {time.monotonic() - start:.0f} s")

    print("\n== 3. the checkpoints on disk")
    rc = jaxckpt_cli("ls", str(root), "--keep-last=3", "--keep-milestones=1,2,5")
    rc |= jaxckpt_cli("verify", str(root), "--all")
    return rc


def _committed(message: str) -> re.Match[str] | None:
    return re.match(r"checkpoint: step (\d+) committed", message)


def _loss_step(message: str) -> re.Match[str] | None:
    return re.match(r"step (\d+): loss ([\d.]+)", message)


def _resumed(message: str) -> re.Match[str] | None:
    return re.match(r"resumed from step (\d+) \(data position (\d+)\)", message)


if __name__ == "__main__":
    sys.exit(main())
