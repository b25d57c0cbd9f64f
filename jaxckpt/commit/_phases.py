"""Named phases of a save and a delete, for crash tests and tracing.

Environment variables (read at each phase, so a process can arm them late):

* ``JAXCKPT_PAUSE_AT=<phase>[,<phase>...]``: on reaching one of these phases
  the process prints ``JAXCKPT_PHASE <phase> <step>`` to stderr and pauses for
  up to ``JAXCKPT_PAUSE_S`` seconds (default 60), so a test can SIGKILL it at a
  precise point of the protocol.
* ``JAXCKPT_RESUME_DIR=<dir>``: makes pauses resumable. A paused process
  creates ``<dir>/<phase>-<step>.reached`` and resumes as soon as
  ``<dir>/<phase>-<step>.resume`` exists (a file created beforehand lets that
  step pass without stopping).
* ``JAXCKPT_TRACE=1``: prints ``JAXCKPT_TRACE <phase> <step>`` to stderr at
  every phase, right after the action the phase names, without pausing.

Unset, this costs two dictionary lookups per phase.
"""

from __future__ import annotations

import os
import sys
import time

PHASES = (
    "pending_written",  # intent record durable, no data yet
    "data_started",  # the first chunk of the first array written
    "data_written",  # every chunk of this process written
    "manifest_written",  # this process's manifest part durable
    "before_marker",  # every record durable, marker not yet written
    "marker_written",  # marker durable, pending record not yet removed
    "delete_retracted",  # during a delete: marker removed, data still there
)
TIER_PHASES = (
    # a save to a local tier: the promotion request written, the local marker not yet
    # (between manifest_written and before_marker)
    "promotion_requested",
    # local_replicas > 1: this process's part is durable on its own local root and
    # being sent to its replica holders (between manifest_written and the local marker)
    "replicating",
)
PUBLISH_PHASES = (
    # published weights (and ``jaxckpt export``): one shard file complete under its
    # temporary name, the index not yet written
    "shard_written",
)

_POLL_S = 0.02


def watched(phase: str | None = None) -> bool:
    """Whether reaching ``phase`` (None: any phase) is traced or paused at.

    A save whose phases are watched makes each phase's action durable before
    it announces the phase, in the order of :data:`PHASES`; unwatched, it
    overlaps actions that need no order (the first chunk with the rest, the
    tree record with the chunks).
    """
    if os.environ.get("JAXCKPT_TRACE"):
        return True
    targets = os.environ.get("JAXCKPT_PAUSE_AT")
    return targets is not None and (phase is None or phase in targets.split(","))


def reached(phase: str, step: int) -> None:
    """Marks that the current save or delete of ``step`` reached ``phase``."""
    if os.environ.get("JAXCKPT_TRACE"):
        print(f"JAXCKPT_TRACE {phase} {step}", file=sys.stderr, flush=True)
    targets = os.environ.get("JAXCKPT_PAUSE_AT")
    if targets is None or phase not in targets.split(","):
        return
    print(f"JAXCKPT_PHASE {phase} {step}", file=sys.stderr, flush=True)
    pause_s = float(os.environ.get("JAXCKPT_PAUSE_S", "60"))
    resume_dir = os.environ.get("JAXCKPT_RESUME_DIR")
    if not resume_dir:
        time.sleep(pause_s)
        return
    base = os.path.join(resume_dir, f"{phase}-{step}")
    with open(base + ".reached", "w"):
        pass
    deadline = time.monotonic() + pause_s
    while not os.path.exists(base + ".resume") and time.monotonic() < deadline:
        time.sleep(_POLL_S)
