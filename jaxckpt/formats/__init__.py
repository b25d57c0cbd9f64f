"""The layouts' writers and readers: how a step's arrays become objects and come back.

A step's chunks are stored in one of two layouts (``CheckpointOptions.layout``):

* ``plain``: each array a zarr v3 array of its own (``zarr.json`` plus one
  object per chunk), written through TensorStore (``_tsio.ArrayWriter``).
* ``packed``: every chunk a byte range of a few pack objects per process
  (``_packed.PackWriter``); the arrays' metadata is in ``tree.json`` only.

Either way a chunk's stored bytes are ``raw || crc32c(raw)``, and where they lie
is answered by :meth:`jaxckpt.records.ChunkRecord.address` (object key, offset,
size) for every reader, verifier, copier and exporter. Code that must know what
a layout *can do* asks its :class:`DataFormat` (from :data:`FORMATS` by name),
never compares names. The table and each layout's cost live in
:mod:`jaxckpt.records` (``_layouts``, ``_layoutcost``), since records name a
part's layout; this face re-exports them. A new layout is one more object in
:data:`FORMATS` with its cost, plus its :class:`StepWriter`
(:mod:`jaxckpt.formats.writers`). The writers and readers import TensorStore and
jax, so their names load lazily: importing this face imports neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxckpt._lazy import lazy_names
from jaxckpt.formats._writer import Planned, StepWriter, Written
from jaxckpt.records import (
    FORMATS,
    NAMES_TEXT,
    PACKED,
    PLAIN,
    DataFormat,
    FormatCost,
    format_named,
    step_format,
)

if TYPE_CHECKING:
    from jaxckpt.formats._chunkread import RegionRequest as RegionRequest
    from jaxckpt.formats._chunkread import plain_leaves as plain_leaves
    from jaxckpt.formats._chunkread import read_regions as read_regions
    from jaxckpt.formats._tsio import ArrayWriter as ArrayWriter
    from jaxckpt.formats._tsio import HostArray as HostArray
    from jaxckpt.formats._tsio import Region as Region
    from jaxckpt.formats._tsio import check_chunks as check_chunks
    from jaxckpt.formats._tsio import chunk_key as chunk_key
    from jaxckpt.formats._tsio import chunks_of as chunks_of
    from jaxckpt.formats._tsio import expected_chunk_count as expected_chunk_count
    from jaxckpt.formats._tsio import full_region as full_region
    from jaxckpt.formats._tsio import read_region as read_region
    from jaxckpt.formats._tsio import region_of as region_of
    from jaxckpt.formats._tsio import snapshot_array as snapshot_array
    from jaxckpt.formats._tsio import zarr_metadata as zarr_metadata

# Writers and readers import TensorStore (and jax): they load on first use.
_LAZY = {
    "RegionRequest": "jaxckpt.formats._chunkread",
    "plain_leaves": "jaxckpt.formats._chunkread",
    "read_regions": "jaxckpt.formats._chunkread",
    "ArrayWriter": "jaxckpt.formats._tsio",
    "HostArray": "jaxckpt.formats._tsio",
    "Region": "jaxckpt.formats._tsio",
    "check_chunks": "jaxckpt.formats._tsio",
    "chunk_key": "jaxckpt.formats._tsio",
    "chunks_of": "jaxckpt.formats._tsio",
    "expected_chunk_count": "jaxckpt.formats._tsio",
    "full_region": "jaxckpt.formats._tsio",
    "read_region": "jaxckpt.formats._tsio",
    "region_of": "jaxckpt.formats._tsio",
    "snapshot_array": "jaxckpt.formats._tsio",
    "zarr_metadata": "jaxckpt.formats._tsio",
}


__getattr__ = lazy_names(__name__, _LAZY, globals())


__all__ = [
    "FORMATS",
    "NAMES_TEXT",
    "PACKED",
    "PLAIN",
    "ArrayWriter",
    "DataFormat",
    "FormatCost",
    "HostArray",
    "Planned",
    "Region",
    "RegionRequest",
    "StepWriter",
    "Written",
    "check_chunks",
    "chunk_key",
    "chunks_of",
    "expected_chunk_count",
    "format_named",
    "full_region",
    "plain_leaves",
    "read_region",
    "read_regions",
    "region_of",
    "snapshot_array",
    "step_format",
    "zarr_metadata",
]
