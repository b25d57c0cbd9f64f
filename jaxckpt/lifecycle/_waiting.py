"""What waits for promotion: the steps local retention keeps for it (a bounded backlog),
and the error of requested steps that can no longer become durable."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from jaxckpt.commit import CommitProtocol
from jaxckpt.errors import SaveFailedError

if TYPE_CHECKING:
    from jaxckpt.lifecycle._nopromotion import NoPromotion
    from jaxckpt.lifecycle._promotion import Promotion

__all__ = ["lost_steps_error", "superseded_for_room", "within_backlog"]

log = logging.getLogger("jaxckpt")


def within_backlog(promotion: Promotion, backlog: int | None) -> set[int]:
    """The steps waiting for promotion that local retention keeps: every one not durable
    yet, but only the newest ``backlog`` (None: all). An older one is superseded: its
    request is withdrawn (said in the log), and retention deletes it as its rule says.
    So a durable root that is down or falling behind cannot fill the local tier (on the
    game day two 503 storms filled a node's disk with waiting steps: every save, and
    every restart's first save, failed with ENOSPC until the storm ended); the newest
    waiting step is promoted once the root answers."""
    waiting = sorted(promotion.pending_steps())
    if backlog is None or len(waiting) <= backlog:
        return set(waiting)
    superseded = waiting[:-backlog]
    for step in superseded:
        promotion.withdraw(step)
    log.warning(
        "steps %s superseded before their promotion to %s by the newer %s (at most "
        "promote_backlog=%d steps wait under %s): their requests are withdrawn",
        superseded,
        promotion.uri,
        waiting[-backlog:],
        backlog,
        promotion.local.where(),
    )
    return set(waiting[-backlog:])


def superseded_for_room(
    promotion: Promotion | NoPromotion, newest: int | None, where: str
) -> set[int]:
    """The steps waiting for promotion older than ``newest`` (the newest committed step of
    the own tier ``where``, which is full), their requests withdrawn. Kept besides the
    newest, they took the room the next save needed: on the game day a storm stalled
    promotion on a full node, and every save failed until the job crashed (41 steps lost).
    The newest step is promoted instead, once the durable root answers."""
    older = {s for s in promotion.pending_steps() if newest is not None and s < newest}
    for step in sorted(older):
        promotion.withdraw(step)
    if older:
        log.warning(
            "steps %s superseded before their promotion by the newer %s: %s is full",
            sorted(older),
            newest,
            where,
        )
    return older


def lost_steps_error(local: CommitProtocol, uri: str, lost: list[int]) -> SaveFailedError:
    """The error of steps requested for promotion that can no longer become durable."""
    return SaveFailedError(
        f"steps {lost} were committed under {local.where()} but can no longer "
        f"be promoted to {uri}: their local copies were removed or damaged "
        "before promotion (see the log); they are not durable"
    )
