"""Where a save commits, by tier kind: on every host (a root of each host's own) or
once for the job (a shared root, by the primary).

A tier's kind supplies its :class:`CommitPoint` (``tier.commit_point``); the save
session asks it who begins a step's attempt, which attempt and tree record the hosts
agree on, and who removes a failed attempt, instead of branching on the kind.
"""

from __future__ import annotations

from typing import Protocol

import jax

from jaxckpt.commit import Agreement
from jaxckpt.records import StepLocation

__all__ = ["EVERY_HOST", "ONCE_FOR_THE_JOB", "CommitPoint"]


class CommitPoint(Protocol):
    """Who commits a step of a tier, and what the hosts agree on before they write."""

    per_host: bool
    """Every host commits a copy of its own (its arrays keep every index it addresses)."""

    def begins(self, *, primary: bool) -> bool:
        """Whether this process begins (announces) the step's attempt."""
        ...

    def agree(
        self, agreement: Agreement, loc: StepLocation, tree: bytes
    ) -> tuple[StepLocation, bytes]:
        """The attempt and tree record this process writes, agreed with the others."""
        ...

    def abandons(self, *, primary: bool) -> bool:
        """Whether this process removes the attempt of a failed save."""
        ...


class _EveryHost:
    """Each host commits its own root: its own attempt, the primary's tree record."""

    per_host = True

    def begins(self, *, primary: bool) -> bool:
        return True

    def agree(
        self, agreement: Agreement, loc: StepLocation, tree: bytes
    ) -> tuple[StepLocation, bytes]:
        if jax.process_count() > 1:  # every local copy holds the primary's tree record
            tree = agreement.agree("tree", tree.decode()).encode()
        return loc, tree

    def abandons(self, *, primary: bool) -> bool:
        return True


class _OnceForTheJob:
    """The primary commits the job's one root: one attempt for the job, the primary's."""

    per_host = False

    def begins(self, *, primary: bool) -> bool:
        return primary

    def agree(
        self, agreement: Agreement, loc: StepLocation, tree: bytes
    ) -> tuple[StepLocation, bytes]:
        return StepLocation(loc.step, agreement.agree("attempt", loc.attempt)), tree

    def abandons(self, *, primary: bool) -> bool:
        # On several hosts the primary's commit decides; a failed part is collected.
        return primary and jax.process_count() == 1


EVERY_HOST: CommitPoint = _EveryHost()
ONCE_FOR_THE_JOB: CommitPoint = _OnceForTheJob()
