"""The data layouts of a step's arrays, as records describe them: one object per layout.

``plain`` (a zarr v3 array per leaf) or ``packed`` (byte ranges of a few pack
objects per process): what a manifest part's ``layout`` names and what readers
may assume of it, with its cost model (:mod:`jaxckpt.records._layoutcost`). The
writers and readers of each layout live in :mod:`jaxckpt.formats`, which
re-exports this table. Imports neither jax nor numpy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from jaxckpt.records._layoutcost import FormatCost, PackedCost, PlainCost


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
