"""What a local tier records about the durable root it serves (``tier.json``).

A local root is written by one job: its steps are promoted to, and resumed
beside, that job's durable root. Two jobs given the same ``local_root`` would
otherwise take each other's steps (a restore resuming from the other job's
step, a promoter copying them into the wrong durable root). So the first
tiered writer of a local root writes, create-only, ``tier.json`` naming the
durable root's URI; every tiered manager (read-only too) and ``jaxckpt
promote`` compare it with their own durable root before anything else is
written, and refuse another. A local root written before the record existed
has none: the first tiered writer adopts it. Imports no jax.
"""

from __future__ import annotations

import contextlib
import time

from jaxckpt.errors import CorruptCheckpointError, LocalRootInUseError
from jaxckpt.records._keys import TIER_RECORD
from jaxckpt.records._step import json_record, load_json_record
from jaxckpt.storage import PreconditionFailed, Storage


def served_by(local: Storage) -> str | None:
    """The durable root's URI the local root ``local`` records, or None (no record yet).

    Raises:
      CorruptCheckpointError: the record is there but unreadable.
    """
    data = local.read(TIER_RECORD)
    if data is None:
        return None
    where = f"{local.uri.rstrip('/')}/{TIER_RECORD}"
    durable = load_json_record(data, where).get("durable")
    if not isinstance(durable, str):
        raise CorruptCheckpointError(f"{where} names no durable root")
    return durable


def refusal(local: Storage, durable_uri: str) -> str | None:
    """Why ``local`` may not serve ``durable_uri`` (it serves another), or None."""
    serves = served_by(local)
    if serves is None or serves == durable_uri:
        return None
    return (
        f"local root {local.uri} serves the durable root {serves}, not {durable_uri}: "
        "another job uses this local root; give this job a local root of its own"
    )


def check_serves(local: Storage, durable_uri: str) -> None:
    """Raises unless ``local`` serves ``durable_uri`` or records no durable root.

    Raises:
      LocalRootInUseError: it serves another durable root.
    """
    reason = refusal(local, durable_uri)
    if reason is not None:
        raise LocalRootInUseError(reason)


def claim(local: Storage, durable_uri: str) -> None:
    """Records (create-only) that ``local`` serves ``durable_uri``; checks it if recorded.

    Two jobs claiming one new local root at once: one record wins, the other is refused.

    Raises:
      LocalRootInUseError: it serves another durable root.
    """
    check_serves(local, durable_uri)
    record = json_record(durable=durable_uri, created=time.time())
    with contextlib.suppress(PreconditionFailed):  # recorded meanwhile: checked below
        local.write(TIER_RECORD, record, exclusive=True)
    check_serves(local, durable_uri)
