"""What a commit needs to know of a manifest part without reading it: its summary.

A save's processes each send the primary a :class:`PartSummary` of the part they
wrote (through the coordination service, a few dozen bytes), instead of the primary
downloading and parsing every part before the marker: the part's size and CRC32C
(the marker's ``parts_crc32c`` covers them), the chunk bytes it lists, and its data
objects as a count and an order-independent hash of their keys. The primary sums
the counts and hashes of every part and compares them with one listing of the
attempt (:func:`objects_of`), so a pack or chunk object gone before the marker
(an attempt collected under a long save) still stops the commit.

Imports neither jax nor numpy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from jaxckpt.errors import CorruptCheckpointError
from jaxckpt.records._keys import StepLocation, is_temp_key
from jaxckpt.records._step import ManifestPart, crc32c, dumps

_MOD = 1 << 64


def keys_hash(keys: Iterable[str]) -> int:
    """An order-independent 64-bit hash of a set of keys (the sum of each key's hash), so
    the hashes of disjoint sets add up to the hash of their union."""
    total = 0
    for key in keys:
        total += int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return total % _MOD


def object_keys(part: ManifestPart, loc: StepLocation) -> set[str]:
    """The keys (relative to the root) of the data objects ``part`` says its process wrote:
    its packs and the chunks it stored as objects of their own."""
    keys = {loc.key(pack) for pack in part.packs}
    for name, chunks in part.arrays.items():
        keys.update(c.address(loc, name).key for c in chunks if c.whole_object)
    return keys


@dataclass(frozen=True, kw_only=True)
class PartSummary:
    """A manifest part as the commit checks it: digest, chunk bytes, data objects."""

    size: int
    crc32c: int
    nbytes: int
    objects: int
    """How many data objects the part names."""
    objects_hash: int
    """:func:`keys_hash` of their keys."""

    @classmethod
    def of(cls, data: bytes, part: ManifestPart, loc: StepLocation) -> PartSummary:
        """The summary of ``part``, stored as ``data``, of the attempt ``loc``."""
        keys = object_keys(part, loc)
        return cls(
            size=len(data),
            crc32c=crc32c(data),
            nbytes=part.nbytes,
            objects=len(keys),
            objects_hash=keys_hash(keys),
        )

    def to_json(self) -> list[int]:
        return [self.size, self.crc32c, self.nbytes, self.objects, self.objects_hash]

    @classmethod
    def from_json(cls, value: Any, what: str) -> PartSummary:
        """A summary another process sent.

        Raises:
          CorruptCheckpointError: not five non-negative integers.
        """
        if (
            not isinstance(value, list)
            or len(value) != 5
            or not all(type(v) is int and 0 <= v < _MOD for v in value)
        ):
            raise CorruptCheckpointError(f"{what}: malformed part summary {value!r:.200}")
        size, crc, nbytes, objects, objects_hash = value
        return cls(size=size, crc32c=crc, nbytes=nbytes, objects=objects, objects_hash=objects_hash)


def parts_crc32c(names: Sequence[str], summaries: Sequence[PartSummary]) -> int:
    """The marker's ``parts_crc32c``: CRC32C of ``[[name, size, crc32c], ...]`` in order."""
    return crc32c(dumps([[n, s.size, s.crc32c] for n, s in zip(names, summaries, strict=True)]))


def is_record(loc: StepLocation, key: str) -> bool:
    """Whether a key listed under the attempt ``loc`` is one of its records (tree record,
    manifest parts, zarr metadata), not a data object."""
    name = loc.name_of(key) or key  # under the attempt, or (format 4) a hashed prefix
    return (
        name == "tree.json" or name.startswith("manifest/") or name.rsplit("/")[-1] == ("zarr.json")
    )


def objects_of(loc: StepLocation, listed: Iterable[str]) -> tuple[int, int]:
    """``(count, keys_hash)`` of the data objects among the keys listed under ``loc``."""
    keys = [k for k in listed if not is_record(loc, k) and not is_temp_key(k)]
    return len(keys), keys_hash(keys)
