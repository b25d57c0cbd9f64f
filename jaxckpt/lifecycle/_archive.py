"""Archiving: chosen durable steps re-encoded with zstd into an archive root
(``jaxckpt cp --compress``, ``jaxckpt promote --archive``), written as an operator.
"""

from __future__ import annotations

import logging
import time

from jaxckpt import policy
from jaxckpt.commit import CommitProtocol
from jaxckpt.errors import CheckpointError, StepAlreadyExistsError
from jaxckpt.records import ARCHIVED, FAILED, PromotionResult

log = logging.getLogger("jaxckpt")


def archive_once(
    durable: CommitProtocol,
    archive: CommitProtocol,
    *,
    older_than_s: float,
    select: policy.RetentionPolicy | None = None,
    level: int = 3,
    now: float | None = None,
) -> list[PromotionResult]:
    """Re-encodes chosen durable steps with zstd into an archive root (``cp --compress``).

    A durable step is archived when it was committed more than ``older_than_s``
    seconds ago, ``select`` keeps it (e.g. ``KeepMilestones()``; None: every
    step) and the archive does not hold it yet. The archive is written as an
    operator (no epoch of its own), each step committed with the usual marker.
    """
    from jaxckpt.tools import copy_step

    now = time.time() if now is None else now
    committed = durable.committed()
    chosen = set(committed)
    if select is not None:
        infos = [
            policy.StepInfo(step=s, metrics=dict(m.metrics) or None, pinned=m.keep)
            for s, m in committed.items()
        ]
        chosen = set(select.keep(infos)) | {s for s, m in committed.items() if m.keep}
    archived = archive.visible_refs()
    results = []
    for step in sorted(chosen - set(archived)):
        marker = committed[step]
        if now - marker.time < older_than_s:
            continue
        start = time.monotonic()
        try:
            nbytes = copy_step(durable, archive, marker, compress="zstd", level=level)
        except StepAlreadyExistsError:
            continue
        except (CheckpointError, OSError) as e:
            log.error("archiving step %d to %s failed: %s", step, archive.where(), e)
            results.append(PromotionResult(step=step, outcome=FAILED, error=str(e)))
            continue
        seconds = time.monotonic() - start
        log.info(
            "archived step %d to %s: %d bytes in %.2fs", step, archive.where(), nbytes, seconds
        )
        results.append(PromotionResult(step=step, outcome=ARCHIVED, nbytes=nbytes, seconds=seconds))
    return results
