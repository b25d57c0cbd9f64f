"""Data formats of a step's arrays: one object per format, the set defined once.

A step's chunks are stored in one of two formats (``CheckpointOptions.layout``):

* ``plain``: each array a zarr v3 array of its own (``zarr.json`` plus one
  object per chunk), written through TensorStore (``_tsio.ArrayWriter``).
* ``packed``: every chunk a byte range of a few pack objects per process
  (``_pack.PackWriter``); the arrays' metadata is in ``tree.json`` only.

Either way a chunk's stored bytes are ``raw || crc32c(raw)``, and where they lie
is answered by :meth:`jaxckpt.records._step.ChunkRecord.address` (object key, offset,
size) for every reader, verifier, copier and exporter. Code that must know what
a format *can do* asks its :class:`DataFormat` here (from :data:`FORMATS` by
name), never compares names; what a format costs (objects and requests of a save
and a restore) is its ``cost`` (:class:`FormatCost`, :mod:`jaxckpt.records._layoutcost`).
A new format is one more object in :data:`FORMATS` with its cost, plus its
:class:`StepWriter` (:mod:`jaxckpt.formats.writers`). This package's ``__init__``
imports nothing of jaxckpt's but the writer Protocol and the (pure) cost model,
and neither jax nor numpy.
"""

from __future__ import annotations

from jaxckpt.formats._writer import Planned, StepWriter, Written
from jaxckpt.records._layoutcost import FormatCost
from jaxckpt.records._layouts import (
    FORMATS,
    NAMES_TEXT,
    PACKED,
    PLAIN,
    DataFormat,
    format_named,
    step_format,
)

__all__ = [
    "FORMATS",
    "NAMES_TEXT",
    "PACKED",
    "PLAIN",
    "DataFormat",
    "FormatCost",
    "Planned",
    "StepWriter",
    "Written",
    "format_named",
    "step_format",
]
