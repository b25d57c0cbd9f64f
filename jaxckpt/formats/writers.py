"""Each data format's writer: the one place a save turns a format into a :class:`StepWriter`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from jaxckpt.formats import FORMATS, PACKED, PLAIN, DataFormat, StepWriter
from jaxckpt.formats._packed import PackWriter
from jaxckpt.records import SPREAD_SLOTS, store_writes_per_s

if TYPE_CHECKING:
    from jaxckpt._options import CheckpointOptions
    from jaxckpt.tiers import Tier


def _plain(tier: Tier, options: CheckpointOptions, budget_uri: str) -> StepWriter:
    return tier.arrays  # the tier's TensorStore context and in-flight bound (``_tsio``)


def _packed(tier: Tier, options: CheckpointOptions, budget_uri: str) -> StepWriter:
    return PackWriter(
        tier.storage,
        max_object_bytes=options.max_object_bytes,
        uploads=options.objects_in_flight,
        writes_per_s=store_writes_per_s(budget_uri, prefixes=SPREAD_SLOTS),
    )


WRITERS: Mapping[str, Callable[[Tier, CheckpointOptions, str], StepWriter]] = {
    PLAIN.name: _plain,
    PACKED.name: _packed,
}
"""Every format's writer factory, by format name."""
assert set(WRITERS) == set(FORMATS), "every data format needs a writer"


def step_writer(
    data_format: DataFormat,
    tier: Tier,
    options: CheckpointOptions,
    *,
    budget_uri: str | None = None,
) -> StepWriter:
    """The writer of ``data_format`` for one tier's saves. ``budget_uri``: the root whose
    write rate sizes the packs (the durable root, which a local tier's packs reach
    unchanged through promotion); default the tier's own."""
    return WRITERS[data_format.name](tier, options, budget_uri or tier.storage.uri)
