"""Where the copies of each process's local part live: a ring over the job's nodes.

A *node* is a failure domain: the host name, or ``JAXCKPT_NODE_ID`` where set
(several processes of one machine may then play several nodes, as the tests
do). Processes on one node share it. With ``local_replicas=k`` a process's
part lives on its own node and on ``k - 1`` other nodes, chosen by one rule:

1. the distinct nodes, sorted by name, form a ring;
2. process ``p`` on ring position ``i`` sends its replicas to the nodes at
   positions ``i + 1, ..., i + k - 1`` (mod the number of nodes);
3. on each such node the holder is the process at position ``r`` (mod the
   node's process count) among that node's processes, by process index, where
   ``r`` is ``p``'s own position among its node's processes. With one process
   per node that is the node's only process; with several, the load spreads.

The rule is deterministic (every process computes the same answer from the
gathered node names) and pure: this module imports neither jax nor numpy.
So is the choice of the step to heal from what every process holds
(:func:`heal_target`, :func:`fallback`; see ``_peertier``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jaxckpt.errors import PlacementError

NODE_ENV = "JAXCKPT_NODE_ID"


def node_id() -> str:
    """This process's node: ``JAXCKPT_NODE_ID`` if set and not empty, else the host name."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


@dataclass(frozen=True)
class Placement:
    """The copies of every process's part, for ``nodes`` (the node of each process).

    >>> p = Placement(("b", "a", "c", "a"), copies=2)
    >>> p.ring, p.holders(1), p.holders(3), p.holders(0), p.sources(0)
    (('a', 'b', 'c'), (0,), (0,), (2,), (1, 3))

    Raises:
      PlacementError: fewer distinct nodes than ``copies``.
      ValueError: ``copies < 1`` or no processes.
    """

    nodes: tuple[str, ...]
    copies: int

    def __post_init__(self) -> None:
        if self.copies < 1:
            raise ValueError(f"local_replicas must be at least 1, got {self.copies}")
        if not self.nodes:
            raise ValueError("a placement needs at least one process")
        if len(self.ring) < self.copies:
            raise PlacementError(
                f"local_replicas={self.copies} needs {self.copies} distinct nodes, but the job's "
                f"{len(self.nodes)} processes run on {len(self.ring)}: {', '.join(self.ring)} "
                f"(a node is the host name or {NODE_ENV})"
            )

    @property
    def ring(self) -> tuple[str, ...]:
        """The distinct nodes, sorted."""
        return tuple(sorted(set(self.nodes)))

    def on_node(self, node: str) -> tuple[int, ...]:
        """The processes on ``node``, by index."""
        return tuple(p for p, n in enumerate(self.nodes) if n == node)

    def holders(self, process: int) -> tuple[int, ...]:
        """The processes that keep replicas of ``process``'s part (``copies - 1`` of them,
        each on another node), in ring order."""
        ring = self.ring
        node = self.nodes[process]
        rank = self.on_node(node).index(process)
        start = ring.index(node)
        result = []
        for j in range(1, self.copies):
            there = self.on_node(ring[(start + j) % len(ring)])
            result.append(there[rank % len(there)])
        return tuple(result)

    def sources(self, holder: int) -> tuple[int, ...]:
        """The processes whose replicas ``holder`` keeps, by index."""
        return tuple(p for p in range(len(self.nodes)) if holder in self.holders(p))


def place(nodes: Sequence[str], copies: int) -> Placement:
    """The placement of ``copies`` copies of each part over the processes' ``nodes``."""
    return Placement(tuple(nodes), copies)


Held = tuple[int, int, str]
"""A replica a process holds: (step, source process, attempt)."""


def heal_target(
    reports: Sequence[tuple[Iterable[int], Iterable[Held]]],
    step: int | None,
    durable: int | None,
    *,
    below: int | None = None,
) -> int | None:
    """The step to heal, from every process's (own steps, replicas held) report.

    The newest step older than ``below`` (or ``step``) whose every process's
    part is on some process (its own, or a replica), that some process lacks
    on its own root, and that is not older than the newest ``durable`` step;
    else None.

    >>> heal_target([([1, 2], []), ([1], [(2, 0, "a")]), ([1], [(2, 1, "b")])], None, 1)
    >>> heal_target([([1, 2], [(2, 2, "c")]), ([1], [(2, 0, "a")]), ([1], [(2, 1, "b")])], None, 1)
    2
    """
    complete, everywhere = coverage(reports)
    if below is not None:
        complete = {s for s in complete if s < below}
    target = step if step is not None else max(complete, default=None)
    if target is None or target not in complete or target in everywhere:
        return None
    return None if durable is not None and target < durable else target


def coverage(
    reports: Sequence[tuple[Iterable[int], Iterable[Held]]],
) -> tuple[set[int], set[int]]:
    """The steps complete in the union of the local tiers, and those every process holds."""
    parts: dict[int, set[int]] = {}
    everywhere: set[int] | None = None
    for process, (own, held) in enumerate(reports):
        own = set(own)
        for s in own:
            parts.setdefault(s, set()).add(process)
        for s, source, _ in held:
            parts.setdefault(s, set()).add(source)
        everywhere = own if everywhere is None else everywhere & own
    complete = {s for s, ps in parts.items() if len(ps) == len(reports)}
    return complete, everywhere or set()


def fallback(
    reports: Sequence[tuple[Iterable[int], Iterable[Held]]],
    failed: int,
    durable: int | None,
    *,
    asked: bool,
) -> tuple[int | None, str]:
    """After healing step ``failed`` failed: the next step to heal (None: no more) and
    what the restore does instead, said in words for the log.

    >>> reports = [([2, 3], [(2, 1, "a"), (3, 1, "a")]), ([], [(2, 0, "a"), (3, 0, "a")])]
    >>> fallback(reports, 3, None, asked=False)
    (2, 'healing step 2 instead, the next newest step complete across the local tiers')
    >>> fallback([([2, 3], []), ([2], [(3, 0, "a")])], 3, None, asked=False)
    (None, 'the restore reads step 2, which every process holds on its local tier')
    >>> fallback(reports, 3, 1, asked=True)
    (None, 'the restore of step 3 reads the durable root if it holds the step')
    """
    if asked:
        return None, f"the restore of step {failed} reads the durable root if it holds the step"
    nxt = heal_target(reports, None, durable, below=failed)
    if nxt is not None:
        return (
            nxt,
            f"healing step {nxt} instead, the next newest step complete across the local tiers",
        )
    complete, everywhere = coverage(reports)
    older = max((s for s in complete if s < failed), default=None)
    if older is not None and older in everywhere and (durable is None or older >= durable):
        return None, f"the restore reads step {older}, which every process holds on its local tier"
    if durable is not None:
        return None, f"the restore reads the durable root (its newest step is {durable})"
    return None, (
        "no older step is complete across the local tiers and nothing is durable: "
        "there is no step to restore"
    )
