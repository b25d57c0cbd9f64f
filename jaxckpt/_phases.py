"""Named phases of a save and a delete, for crash tests and tracing.

Setting ``JAXCKPT_PAUSE_AT=<phase>`` makes the process print
``JAXCKPT_PHASE <phase> <step>`` to stderr and sleep for
``JAXCKPT_PAUSE_S`` seconds (default 60) when it reaches that phase, so a
test can SIGKILL it at a precise point of the protocol. Unset, this costs one
dictionary lookup per phase.
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


def reached(phase: str, step: int) -> None:
    """Marks that the current save or delete of ``step`` reached ``phase``."""
    target = os.environ.get("JAXCKPT_PAUSE_AT")
    if target is None or target != phase:
        return
    print(f"JAXCKPT_PHASE {phase} {step}", file=sys.stderr, flush=True)
    time.sleep(float(os.environ.get("JAXCKPT_PAUSE_S", "60")))
