"""CRC32C of a concatenation from the CRC32Cs of its parts (zlib's ``crc32_combine``
for the Castagnoli polynomial): how every process of the read-once exchange checks a
chunk read in parts by several processes against the manifest.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

__all__ = ["crc32c_combine"]


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``a + b`` from ``crc1 = CRC32C(a)``, ``crc2 = CRC32C(b)`` and ``len(b)``.

    >>> import crc32c
    >>> crc32c_combine(crc32c.crc32c(b"jax"), crc32c.crc32c(b"ckpt"), 4) == crc32c.crc32c(
    ...     b"jaxckpt"
    ... )
    True
    """
    if len2 <= 0:
        return crc1
    return _times(_zeros_operator(len2), crc1) ^ crc2


_POLY = 0x82F63B78  # CRC32C, reflected


def _times(matrix: Sequence[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: Sequence[int]) -> list[int]:
    return [_times(matrix, row) for row in matrix]


@functools.lru_cache(maxsize=256)
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
    """The GF(2) matrix that advances a CRC over ``nbytes`` zero bytes."""
    one_bit = [_POLY] + [1 << n for n in range(31)]
    op = _square(_square(_square(one_bit)))  # one zero byte
    result: list[int] | None = None
    while nbytes:
        if nbytes & 1:
            result = op if result is None else [_times(op, row) for row in result]
        nbytes >>= 1
        if nbytes:
            op = _square(op)
    assert result is not None
    return tuple(result)
