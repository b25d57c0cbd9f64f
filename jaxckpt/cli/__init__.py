"""The ``jaxckpt`` command line: list, inspect, verify, compare, convert and manage checkpoints.

Every command works on a local directory, ``gs://bucket/prefix`` or ``s3://bucket/prefix``
root (endpoints come from the environment, see the README). ``ls``, ``inspect``, ``prune``,
``gc``, ``mark`` and ``plan`` read only the commit protocol's JSON records and never import jax, so
they start fast; ``verify`` opens the root before it imports TensorStore, so a wrong root
fails at once. ``diff``, ``stats``, ``export`` and ``import`` read arrays through jaxckpt's
lazy reader (:func:`jaxckpt.open_step`).

One module per command group (``_ls``, ``_inspect``, ``_verify``, ``_manage``, ``_mark``,
``_analysis``, ``_interop``, ``_plan``) registers its subcommands; ``_output`` holds the
shared tables, units, progress bars and JSON printing.

Errors print one line, ``jaxckpt: error: ...``, on stderr and exit with status 1 (2 for
bad arguments).

>>> main(["plan", "--params", "30B", "--step-seconds", "2.5", "--write-gbps", "1.2",
...       "--every-steps", "1000", "--mtbf-hours", "24", "--gpus", "64",
...       "--gpu-hour-usd", "4"])  # doctest: +ELLIPSIS
checkpoint size ...60.0 GB
save time ...50.0 s
blocking overhead ...2.00 % of training time
...
0
"""

from __future__ import annotations

from jaxckpt.cli._common import split_source as split_source
from jaxckpt.cli._main import main as main
from jaxckpt.cli._main import parser as parser
from jaxckpt.cli._metrics import PromoterMetrics as PromoterMetrics
from jaxckpt.cli._output import Progress as Progress
from jaxckpt.cli._output import human_bytes as human_bytes
from jaxckpt.cli._output import human_duration as human_duration

__all__ = [
    "Progress",
    "PromoterMetrics",
    "human_bytes",
    "human_duration",
    "main",
    "parser",
    "split_source",
]
