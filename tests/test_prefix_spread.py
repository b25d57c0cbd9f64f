"""Format 4's hashed key prefixes on a real S3 server (issue 35): where a step's objects
land, that everything reads, copies and deletes them there, and what that costs.

Requests are counted by ``scripts/faultproxy.py`` in front of moto, with no faults.
"""

from __future__ import annotations

import re
import uuid
from collections import Counter
from collections.abc import Iterator

import faultproxy
import numpy as np
import pytest
from benchkit import servers

import jaxckpt
from jaxckpt import cli
from jaxckpt.commit import CommitProtocol, list_attempt
from jaxckpt.formats import _packed
from jaxckpt.records import DATA, SPREAD_SLOTS, StepLocation
from jaxckpt.storage import open_storage

HASHED = re.compile(r"data/[0-9a-f]{2}/(\d+)\.e\d+-\d+-[0-9a-f]+/(packs|manifest)/[^/]+")


class _Counting(faultproxy.FaultProxy):
    """The proxy, counting requests: listings, batch deletes, and the rest by method."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.kinds: Counter[str] = Counter()
        self.paths: list[str] = []

    def _choose(self, method: str, path: str) -> tuple[str | None, float]:
        kind = method
        if method == "POST" and "?delete" in path:
            kind = "DeleteObjects"
        elif method == "GET" and "list-type=" in path:
            kind = "LIST"
        with self._lock:
            self.kinds[kind] += 1
            self.paths.append(f"{kind} {path}")
        return super()._choose(method, path)


@pytest.fixture
def counted(s3_server: servers.Server) -> Iterator[_Counting]:
    proxy = _Counting(s3_server.endpoint)
    yield proxy
    proxy.close()


def leaves(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"l{i:02d}": rng.standard_normal(64).astype(np.float32) for i in range(40)}


def test_a_step_spreads_over_hashed_prefixes_and_its_delete_is_one_batch(
    counted: _Counting, s3_server: servers.Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_packed, "MIN_PACK_BYTES", 1000)  # 40 x 260 stored bytes: ~10 packs
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    options = {"endpoint": counted.endpoint}
    with jaxckpt.CheckpointManager(root, storage_options=options) as mgr:
        for step in (1, 2):
            mgr.save(step, leaves(step))
        mgr.wait()
        storage = open_storage(root)
        protocol = CommitProtocol(storage)
        locs = {s: protocol.require_marker(s).location for s in (1, 2)}
        spread = {
            s: [k for k in list_attempt(storage, locs[s]) if k.startswith(DATA)] for s in locs
        }
        for step, keys in spread.items():
            (part,) = protocol.read_manifest(protocol.require_marker(step))
            assert len(part.packs) >= 8
            names = sorted(locs[step].name_of(k) or "" for k in keys)
            assert names == sorted([*part.packs, "manifest/0.json"])  # packs and part only
            assert all((m := HASHED.fullmatch(k)) and m.group(1) == str(step) for k in keys), keys
            assert len({k.split("/")[1] for k in keys}) >= 6  # 8+ slots of 16: spread
            # its commit listed its own prefix and only the hashed ones its part and packs
            # can have used (the slots of packs 0..n of process 0): those that hold them
            attempt = str(locs[step].attempt)
            listed = [p for p in counted.paths if p.startswith("LIST") and attempt in p]
            assert len(listed) == 1 + len({k.split("/")[1] for k in keys}), listed
        # Nothing else of the root is per step under data/, and the top of the key space is
        # fixed: the steps only follow the hash.
        assert sorted(storage.list(DATA)) == sorted(spread[1] + spread[2])
        assert {k.split("/")[0] for k in storage.list("")} <= {
            "jaxckpt.json",
            "writers",
            "pending",
            "attempts",
            "commits",
            "ledger",
            DATA.rstrip("/"),
        }
        # Read back, verified and copied from there (cp into a local root and back).
        for step in (1, 2):
            restored = mgr.restore(step)
            assert all(np.array_equal(restored[k], v) for k, v in leaves(step).items())
            assert mgr.verify(step).ok
        counted.kinds.clear()
        counted.paths.clear()
        mgr.delete(1)
        mgr.wait_for_deletions()
        assert mgr.steps() == [2]
    # The delete lists the attempt and its 32 hashed prefixes (whatever its number of
    # processes), deletes every key found in one batch, and lists each prefix that held
    # keys twice more (removed, on a local root with its directories; then seen empty).
    held = 1 + len({k.split("/")[1] for k in spread[1]})
    attempt = str(locs[1].attempt)
    listings = [p for p in counted.paths if p.startswith("LIST") and attempt in p]
    assert counted.kinds["DeleteObjects"] == 1, counted.kinds
    prefixes = 1 + len(locs[1].buckets())
    assert prefixes == 1 + SPREAD_SLOTS and locs[1].sealed
    assert len(listings) == prefixes + 2 * held, "\n".join(listings)
    gone = StepLocation(1, locs[1].attempt)  # found by id alone: the same 33 prefixes
    assert list_attempt(storage, gone) == [] and storage.list("attempts/1/") == []
    assert sorted(storage.list(DATA)) == sorted(spread[2])


def test_cp_moves_a_step_into_the_destinations_hashed_prefixes(
    s3_server: servers.Server, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_packed, "MIN_PACK_BYTES", 1000)
    src = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    with jaxckpt.CheckpointManager(src) as mgr:
        mgr.save(3, leaves(3))
    local, back = str(tmp_path / "local"), f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    assert cli.main(["cp", f"{src}:3", local]) == 0
    assert cli.main(["cp", f"{local}:3", back]) == 0
    keys = {}
    for root in (src, local, back):
        storage = open_storage(root)
        loc = CommitProtocol(storage).require_marker(3).location
        names = [loc.name_of(k) for k in list_attempt(storage, loc) if k.startswith(DATA)]
        keys[root] = (loc.attempt, sorted(n or "" for n in names))
        restored = jaxckpt.CheckpointManager(root, read_only=True).restore(3)
        assert all(np.array_equal(restored[k], v) for k, v in leaves(3).items())
    assert len({attempt for attempt, _ in keys.values()}) == 3  # a fresh attempt each
    assert len({tuple(names) for _, names in keys.values()}) == 1  # the same objects
    assert len(keys[src][1]) >= 8
