"""The run ledger: what a training job's checkpoints cost it, recorded where they live.

Modules, bottom up: ``_events`` (keys and events, checked when read), ``_writer``
(batched, bounded objects written by a background thread), ``_startup`` (process start
time, JAX's compilation cache), ``_executables`` (each process's compiled step),
``_monitor`` (``jax.monitoring`` under Orbax's names and Prometheus), ``_run`` (the
manager's hooks), ``_read`` (reading a ledger back), ``_runs`` (one run's figures),
``_report`` (goodput and badput; :func:`report`), ``_plot`` (the timeline picture).
"""

from __future__ import annotations

from jaxckpt.ledger._events import LEDGER as LEDGER
from jaxckpt.ledger._events import LedgerObject as LedgerObject
from jaxckpt.ledger._events import ledger_key as ledger_key
from jaxckpt.ledger._read import RunEvents as RunEvents
from jaxckpt.ledger._read import read_ledger as read_ledger
from jaxckpt.ledger._report import Badput as Badput
from jaxckpt.ledger._report import Report as Report
from jaxckpt.ledger._report import Restart as Restart
from jaxckpt.ledger._report import report as report
from jaxckpt.ledger._run import RunLedger as RunLedger


def plot(rep: Report, path: str) -> None:
    """Draws ``rep``'s timeline to ``path`` (``.png`` or ``.html``; needs matplotlib)."""
    from jaxckpt.ledger._plot import plot as draw  # matplotlib only when asked

    draw(rep, path)


__all__ = [
    "LEDGER",
    "Badput",
    "LedgerObject",
    "Report",
    "Restart",
    "RunEvents",
    "RunLedger",
    "ledger_key",
    "plot",
    "read_ledger",
    "report",
]
