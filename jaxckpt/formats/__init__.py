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
and a restore) is its ``cost`` (:class:`FormatCost`, :mod:`jaxckpt.formats._cost`).
A new format is one more object in :data:`FORMATS` with its cost, plus its
:class:`StepWriter` (:mod:`jaxckpt.formats.writers`). This package's ``__init__``
imports nothing of jaxckpt's but the writer Protocol and the (pure) cost model,
and neither jax nor numpy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from jaxckpt.formats._cost import FormatCost, PackedCost, PlainCost
from jaxckpt.formats._writer import Planned, StepWriter, Written

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


@dataclass(frozen=True, kw_only=True)
class DataFormat:
    """One data format: its name and what readers may assume of it."""

    name: str
    """As ``CheckpointOptions.layout`` and a manifest part's ``layout`` spell it."""
    zarr_arrays: bool
    """Each array is a zarr v3 array of its own (``zarr.json`` plus one object per
    chunk) that TensorStore and zarr-python open directly. When False, the arrays'
    metadata lives in ``tree.json`` only and every chunk is read at its address."""
    raw_chunks: bool
    """Every chunk is raw little-endian bytes plus a CRC32C trailer, whatever the
    manifest part says about its codecs."""
    description: str
    cost: FormatCost
    """Its objects and requests per save and restore (what ``jaxckpt plan`` models)."""


PLAIN = DataFormat(
    name="plain",
    zarr_arrays=True,
    raw_chunks=False,
    description="one zarr v3 array per leaf, one object per chunk",
    cost=PlainCost(),
)
PACKED = DataFormat(
    name="packed",
    zarr_arrays=False,
    raw_chunks=True,
    description="every chunk a byte range of a few pack objects per process",
    cost=PackedCost(),
)

FORMATS: Mapping[str, DataFormat] = {f.name: f for f in (PLAIN, PACKED)}
"""Every data format, by name: what options validation and record parsing accept."""
NAMES_TEXT = " or ".join(repr(name) for name in FORMATS)
"""The formats' names for messages: ``'plain' or 'packed'``."""


def format_named(name: str) -> DataFormat:
    """The data format called ``name``.

    Raises:
      ValueError: no format has that name.
    """
    found = FORMATS.get(name)
    if found is None:
        raise ValueError(f"layout must be one of {tuple(FORMATS)}, got {name!r}")
    return found


def step_format(names: Iterable[str]) -> DataFormat:
    """The format of a step whose manifest parts name ``names``: plain only when all do."""
    found = [format_named(n) for n in names]
    return next((f for f in found if f is not PLAIN), PLAIN)
