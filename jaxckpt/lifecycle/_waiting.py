"""What waits for promotion: the steps local retention keeps for it (a bounded backlog),
and the error of requested steps that can no longer become durable."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from jaxckpt.commit import CommitProtocol
from jaxckpt.errors import SaveFailedError

if TYPE_CHECKING:
    from jaxckpt.lifecycle._promotion import Promotion

__all__ = ["lost_steps_error", "within_backlog"]

log = logging.getLogger("jaxckpt")


def within_backlog(promotion: Promotion, backlog: int | None, full: int | None = None) -> set[int]:
    """The steps waiting for promotion that local retention keeps: every one not durable
    yet, but only the newest ``backlog`` (None: all). An older one is superseded: its
    request is withdrawn (said in the log), and retention deletes it as its rule says.
    So a durable root that is down or falling behind cannot fill the local tier (on the
    game day two 503 storms filled a node's disk with waiting steps: every save, and
    every restart's first save, failed with ENOSPC until the storm ended); the newest
    waiting step is promoted once the root answers.

    ``full``: the newest committed step of the local tier, which is full; the waiting
    steps older than it are superseded too. Kept besides it, they took the room the next
    save needed: on the game day a storm stalled promotion on a full node, and every save
    failed until the job crashed (41 steps lost)."""
    waiting = sorted(promotion.pending_steps())
    kept = waiting if backlog is None else waiting[max(0, len(waiting) - backlog) :]
    kept = kept if full is None else [s for s in kept if s >= full]
    superseded = [s for s in waiting if s not in kept]
    if not superseded:
        return set(kept)
    for step in superseded:
        promotion.withdraw(step)
    log.warning(
        "steps %s superseded before their promotion to %s by the newer %s (%s): their "
        "requests are withdrawn",
        superseded,
        promotion.uri,
        kept if full is None else [full],
        f"at most promote_backlog={backlog} steps wait under {promotion.local.where()}"
        if full is None
        else f"{promotion.local.where()} is full",
    )
    return set(kept)


def lost_steps_error(local: CommitProtocol, uri: str, lost: list[int]) -> SaveFailedError:
    """The error of steps requested for promotion that can no longer become durable."""
    return SaveFailedError(
        f"steps {lost} were committed under {local.where()} but can no longer "
        f"be promoted to {uri}: their local copies were removed or damaged "
        "before promotion (see the log); they are not durable"
    )
