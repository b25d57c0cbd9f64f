"""The commit's checks before a marker: every record there, every data object listed.

The primary checks its own records and parts (parsed here) and the other processes'
parts as they summarised them (:mod:`jaxckpt.records._summary`): the listing of the
attempt must hold exactly the data objects the parts name. Only on a mismatch are the
parts read, to name the missing chunk. Imports no jax.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from jaxckpt.errors import CheckpointError
from jaxckpt.records import (
    SELF_CHECKED_VERSION,
    FileDigest,
    ManifestPart,
    PartSummary,
    StepLocation,
    is_manifest_name,
    keys_hash,
    object_keys,
    objects_of,
)
from jaxckpt.storage import Storage


class CommitCheck:
    """The checks of one attempt's commit (``where`` names a key in messages)."""

    def __init__(self, storage: Storage, loc: StepLocation, where: Callable[[str], str]) -> None:
        self.storage, self.loc, self.where = storage, loc, where

    def records(
        self,
        names: Sequence[str],
        read: Mapping[str, bytes | None],
        written: Mapping[str, bytes],
        present: set[str],
    ) -> tuple[dict[str, FileDigest], dict[str, ManifestPart], dict[str, PartSummary]]:
        """Every record of ``names`` is there; returns the marker's ``files`` (the digests of
        the records that do not check themselves), the parts read or written here, parsed,
        and their summaries. A summarised part (not in ``read`` or ``written``) need only
        be listed."""
        loc = self.loc
        files: dict[str, FileDigest] = {}
        parsed: dict[str, ManifestPart] = {}
        summary: dict[str, PartSummary] = {}
        for name in names:
            # a record this process wrote must still be there (a collection of a fenced
            # attempt, a long save outliving gc_grace_s); one read back proves it itself
            data = read[name] if name in read else written.get(name)
            if data is None if name in read else loc.key(name) not in present:
                raise CheckpointError(
                    f"cannot commit step {loc.step}: {self.where(loc.key(name))} is missing"
                )
            if data is None:
                continue  # summarised by the process that wrote it
            if not is_manifest_name(name):
                files[name] = FileDigest.of(data)
                continue
            part = ManifestPart.from_bytes(data, self.where(loc.key(name)))
            parsed[name], summary[name] = part, PartSummary.of(data, part, loc)
            if part.version < SELF_CHECKED_VERSION:  # an older part (cp): the marker vouches
                files[name] = FileDigest.of(data)
        return files, parsed, summary

    def objects(
        self,
        present: set[str],
        part_names: Sequence[str],
        parsed: Mapping[str, ManifestPart],
        others: Sequence[PartSummary],
    ) -> None:
        """The attempt's listing holds exactly the data objects the parts name: those of
        the parts parsed here (their union: a held part names its host's packs too) and
        those the other processes summarised. On a mismatch the parts are read to name
        the missing chunk."""
        loc = self.loc
        keys: set[str] = set()
        for part in parsed.values():
            keys |= object_keys(part, loc)
        count = len(keys) + sum(s.objects for s in others)
        digest = (keys_hash(keys) + sum(s.objects_hash for s in others)) % (1 << 64)
        if objects_of(loc, present) == (count, digest):
            return
        parts = list(parsed.values())
        for name in [n for n in part_names if n not in parsed]:
            data = self.storage.read(loc.key(name))
            if data is not None:
                parts.append(ManifestPart.from_bytes(data, self.where(loc.key(name))))
        self.chunks_present(parts, present)
        raise CheckpointError(
            f"cannot commit step {loc.step}: {self.where(loc.prefix)} holds "
            f"{objects_of(loc, present)[0]} data objects, its manifest parts name {count}"
        )

    def chunks_present(self, parts: Sequence[ManifestPart], present: set[str]) -> None:
        """Every chunk the manifest parts list exists (``present``: the attempt's listing).

        A packed chunk's pack object must exist and its part must record it.
        """
        loc = self.loc
        for part in parts:
            for name, chunks in part.arrays.items():
                for chunk in chunks:
                    key = chunk.address(loc, name).key
                    if key not in present or not part.lists_object(chunk):
                        raise CheckpointError(
                            f"cannot commit step {loc.step}: chunk {chunk.key} of {name} "
                            f"({self.where(key)}) is missing"
                        )
