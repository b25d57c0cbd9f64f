"""Reading a chunk again before calling it corrupt.

A byte flipped in transit (a NIC, a proxy, a TLS offload bug) fails a chunk's
CRC32C in one response and not in the next, while damage that is stored fails
every read. So a chunk that fails its size or CRC32C check is read twice more
before it is reported: once more the way it was read (on an object store,
jaxckpt's direct HTTP reads when they are on), then through TensorStore's
kvstore (its own connections and retries). The first copy that passes is used,
with a warning; only when all three fail is the chunk corrupt (the message lists
each read's finding when they differ). A chunk that is missing, or records that fail their
checksum, are not chunks in transit and are handled by their callers.

Imports neither jax nor the tree modules.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import tensorstore as ts

from jaxckpt.records import ChunkAddress, ChunkRecord, StepLocation, chunk_problem
from jaxckpt.storage import Storage, tensorstore_backed

log = logging.getLogger("jaxckpt")

READS = 3
"""How often a chunk is read before it is called corrupt (the first read included)."""


def reread_chunk(
    storage: Storage,
    loc: StepLocation,
    address: ChunkAddress,
    record: ChunkRecord,
    problem: str,
    *,
    where: str,
) -> tuple[bytes | np.ndarray | None, str]:
    """Reads a chunk that failed its check again; returns ``(good copy, "")`` or ``(None, why)``.

    Args:
      storage: the step's root.
      loc: the step's attempt.
      address: where the chunk is stored (``record.address``).
      record: the chunk's manifest record.
      problem: what the first read found (``checksum mismatch``, a size difference).
      where: the chunk, for messages (step, tree path, chunk key).

    Returns:
      A copy that passes its check and ``""``; or None and the problem of every
      read, to be reported as corruption.
    """
    problems = [problem]
    for how, read in (("again", _read_again), ("through TensorStore", _read_tensorstore)):
        try:
            data = read(storage, loc, address)
        except Exception as e:  # StorageError, a TensorStore ValueError: report it beside
            problems.append(f"cannot read {how}: {e}")
            continue
        found = "missing" if data is None else chunk_problem(data, record)
        if found is None:
            log.warning(
                "%s: %s on one read, read again intact (%s): a transfer error, not damage",
                where,
                problem,
                how,
            )
            return data, ""
        problems.append(found)
    if len(set(problems)) == 1:
        return None, problem  # the same every time: what the caller reports
    return None, f"{problem} (read {READS} times: {'; '.join(problems)})"


def _read_again(
    storage: Storage, loc: StepLocation, address: ChunkAddress
) -> bytes | np.ndarray | None:
    return address.read(storage)


def _read_tensorstore(storage: Storage, loc: StepLocation, address: ChunkAddress) -> bytes | None:
    specs = tensorstore_backed(storage)
    context = ts.Context(specs.context_spec())
    directory, _, name = address.key.rpartition("/")  # under the attempt or a hashed prefix
    kv = ts.KvStore.open(specs.kvstore_spec(directory + "/"), context=context).result()
    options: dict[str, Any] = {}
    if not address.whole:
        options["byte_range"] = slice(address.offset, address.offset + address.size)
    result = kv.read(name, **options).result()
    return bytes(result.value) if result.state == "value" else None
