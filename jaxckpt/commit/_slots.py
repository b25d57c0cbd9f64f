"""Which of an attempt's hashed prefixes a commit lists: only the slots it can have used.

Format 4 spreads an attempt's packs and manifest parts over :data:`SPREAD_SLOTS` hashed
prefixes (:mod:`jaxckpt.records._keys`): process *p*'s part lies in slot *p* mod 32 and
its pack *k* in slot (*p* + *k*) mod 32, its packs numbered from 0. A commit that knows
every part (written here, or summarised by its process: a summary counts the data
objects, so the packs, the part names) lists the attempt's own prefix and the slots of
those parts and packs only: one hashed prefix for a one-process save, all 32 from 32
processes (or packs) on. A part it must read (``cp``, promotion), or a held part, which
may name another host's packs, makes it list all 32, as a deletion or a collection
always does: a partial attempt's summaries may be missing. Imports no jax.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from jaxckpt.records import SPREAD_SLOTS, TREE_FILE, ManifestPart, PartSummary, pack_name

_OWN_PART = re.compile(r"manifest/(\d+)\.json")


def commit_names(
    part_names: Sequence[str],
    written: Mapping[str, bytes],
    summaries: Mapping[str, PartSummary],
    where: Callable[[str], str] = str,
) -> list[str] | None:
    """Names of the objects whose prefixes hold everything ``part_names`` can name: the
    tree record, the parts, and the packs each wrote (by its part written here, else by
    its summary's count); None when a part is neither (list every slot). ``where``
    names a part in messages.

    >>> summary = PartSummary(size=1, crc32c=0, nbytes=1, objects=2, objects_hash=0)
    >>> commit_names(["manifest/1.json"], {}, {"manifest/1.json": summary})
    ['tree.json', 'manifest/1.json', 'packs/1.0.bin', 'packs/1.1.bin']
    >>> commit_names(["manifest/1.json"], {}, {}) is None  # a part read here: all 32
    True
    >>> commit_names(["manifest/1.held.json"], {}, {"manifest/1.held.json": summary}) is None
    True
    """
    names = [TREE_FILE]
    for name in part_names:
        names.append(name)
        if name in written:
            names.extend(ManifestPart.from_bytes(written[name], where(name)).packs)
            continue
        m = _OWN_PART.fullmatch(name)
        if m is None or name not in summaries:
            return None
        process = int(m.group(1))
        packs = min(summaries[name].objects, SPREAD_SLOTS)  # 32 cover every slot
        names.extend(pack_name(process, index) for index in range(packs))
    return names
