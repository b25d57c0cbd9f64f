"""The replica placement rule (jaxckpt.tiers._placement) as pure tables."""

from __future__ import annotations

import pytest

from jaxckpt import PlacementError
from jaxckpt.tiers._placement import NODE_ENV, node_id, place


@pytest.mark.parametrize(
    ("nodes", "copies", "holders"),
    [
        (("a",), 1, [()]),
        (("a", "b", "c", "d"), 2, [(1,), (2,), (3,), (0,)]),
        (("a", "b", "c", "d"), 3, [(1, 2), (2, 3), (3, 0), (0, 1)]),
        (("d", "c", "b", "a"), 2, [(3,), (0,), (1,), (2,)]),  # the ring is sorted by name
        # two processes per node: the holder is the same rank on the next node
        (("a", "a", "b", "b"), 2, [(2,), (3,), (0,), (1,)]),
        # uneven nodes: ranks wrap around a smaller node
        (("a", "a", "a", "b"), 2, [(3,), (3,), (3,), (0,)]),
    ],
)
def test_holders_are_the_next_nodes_on_the_ring(nodes, copies, holders):
    placement = place(nodes, copies)
    assert [placement.holders(p) for p in range(len(nodes))] == holders
    for p in range(len(nodes)):
        copies_on = [nodes[p], *(nodes[h] for h in placement.holders(p))]
        assert len(set(copies_on)) == copies  # every copy on a distinct node
        for h in placement.holders(p):
            assert p in placement.sources(h)


def test_fewer_nodes_than_copies_is_refused_naming_them():
    with pytest.raises(PlacementError, match=r"local_replicas=3 needs 3 distinct nodes.* a, b"):
        place(["a", "b", "a", "b"], 3)
    with pytest.raises(ValueError, match="at least 1"):
        place(["a"], 0)


def test_node_id_is_the_environment_variable_or_the_host_name(monkeypatch):
    import socket

    monkeypatch.setenv(NODE_ENV, "rack3-node7")
    assert node_id() == "rack3-node7"
    monkeypatch.setenv(NODE_ENV, "")
    assert node_id() == socket.gethostname()
