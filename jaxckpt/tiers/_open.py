"""Opening the manager's tiers: each by its kind's name (:data:`KINDS`), then joining
them to the job (epochs, the checks that a local root is this job's and this process's
alone, peers).

The kinds themselves (:class:`~jaxckpt.tiers._kinds.OwnTier`,
:class:`~jaxckpt.tiers._kinds.SharedTier`) are in :mod:`jaxckpt.tiers._kinds`; a new
kind is one more class there and its entry in :data:`KINDS` here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import jax

from jaxckpt._options import CheckpointOptions
from jaxckpt.commit import Agreement
from jaxckpt.errors import CheckpointError
from jaxckpt.storage import Storage, open_storage
from jaxckpt.tiers._kinds import OwnTier, SharedTier
from jaxckpt.tiers._tier import Tier

__all__ = ["KINDS", "TIER_NAMES", "join_tiers", "open_tier", "open_tiers"]


KINDS: dict[str, Callable[[Storage, CheckpointOptions], Tier]] = {
    "local": OwnTier,
    "durable": SharedTier,
}
"""The tier kinds by name, nearest first."""
TIER_NAMES = tuple(KINDS)


def open_tier(uri: str | os.PathLike[str], options: CheckpointOptions, name: str) -> Tier:
    """Opens the root ``uri`` as the tier ``name`` (writes nothing).

    Raises:
      ValueError / CheckpointError: ``uri`` is not a root the storage layer accepts.
    """
    if name not in KINDS:
        raise ValueError(f"tier name must be one of {TIER_NAMES}, got {name!r}")
    root = os.fspath(uri)
    return KINDS[name](open_storage(root, **options.storage_kwargs(root)), options)


def open_tiers(root: str | os.PathLike[str], options: CheckpointOptions) -> tuple[Tier, ...]:
    """The manager's tiers, nearest first: ``(durable,)``, or ``(local, durable)`` with
    ``options.local_root``. Every root is opened (and so validated) before any is written.

    Raises:
      CheckpointError: ``local_root`` and ``root`` are the same root.
    """
    durable = open_tier(root, options, "durable")
    if options.local_root is None:
        return (durable,)
    local = open_tier(options.local_root, options, "local")
    if local.uri == durable.uri:
        raise CheckpointError(f"local_root and root are the same root: {durable.uri}")
    return (local, durable)


def join_tiers(tiers: Sequence[Tier], agreement: Agreement, options: CheckpointOptions) -> None:
    """Opens ``tiers`` as the manager's ``options`` say (collective): read-only, each
    root must exist; else each is written and its epoch taken, nearest first, and then
    each joins its peers (an own tier with ``local_replicas > 1``).

    Raises:
      LocalRootInUseError / CheckpointError: see :func:`require_served` and
        :func:`require_own_roots`; PlacementError: fewer nodes than ``local_replicas``.
    """
    durable = tiers[-1]
    require_served(agreement, tiers, durable.uri)
    if options.read_only:
        for tier in tiers:
            tier.open_read_only(durable.uri)
        return
    require_own_roots(agreement, tiers)
    primary = jax.process_index() == options.primary_host
    grace = options.gc_grace_s if options.gc_on_open else None
    behind = options.durable_wait_s if len(tiers) > 1 else None  # a local tier serves it
    if behind is not None and primary:  # its epoch is taken while the local tier is opened
        durable.begin_join(gc_grace_s=grace)
    for tier in tiers:  # an own tier records (or checks) the durable root it serves
        wait_s = None if tier.own else behind
        tier.take_epoch(
            agreement, primary=primary, gc_grace_s=grace, serves=durable.uri, wait_s=wait_s
        )
    for tier in tiers:  # the local tier's peers connect (collective; see _peertier)
        tier.peers.join(agreement, durable)


def require_served(agreement: Agreement, tiers: Iterable[Tier], durable: str) -> None:
    """Refuses an own tier that serves another durable root than ``durable`` (collective:
    every host raises if any host's local root is another job's; see
    :meth:`~jaxckpt.tiers._kinds.OwnTier.check_served`).

    Raises:
      LocalRootInUseError: a local root records another durable root.
    """
    for tier in tiers:  # a shared tier has nothing to check (and agrees nothing)
        tier.check_served(agreement, durable)


def require_own_roots(agreement: Agreement, tiers: Iterable[Tier]) -> None:
    """Refuses an own tier that two processes of this job on one machine would share
    (collective; nothing is written before it passes).

    See :meth:`~jaxckpt.tiers._kinds.OwnTier.check_alone`.

    Raises:
      CheckpointError: two processes have the same host name and local root.
    """
    for tier in tiers:  # a shared tier has nothing to check (and gathers nothing)
        tier.check_alone(agreement)
