"""What a step looks like on storage at each phase of the commit protocol.

The only test module that reads the raw on-storage state of an uncommitted
step. Keys come from ``jaxckpt.records._keys`` (``StepLocation``, ``manifest_name``,
the key parsers), never from literals, so a layout change is ported by changing
the *reads* below; the per-phase post-conditions further down are written in
terms of those reads only.

Post-conditions of a save of step ``s`` by ``n`` processes, as
:func:`check_phase` asserts them (``data`` is the set of stored chunk objects,
``all`` every chunk the tree record implies, ``parts`` the manifest parts):

=================  =======  ===========  ============  ==========  ======
phase              pending  data         parts         tree        marker
=================  =======  ===========  ============  ==========  ======
pending_written    save     none         none          no          none
data_started       save     1 or more    none          yes         none
data_written       save     all          none          yes         none
manifest_written   save     all          own ⊆ parts   yes         none
before_marker      save     all          every proc.   yes         none
marker_written     save     all          every proc.   yes         valid
delete_retracted   delete   all          every proc.   yes         none
=================  =======  ===========  ============  ==========  ======

A data object is a chunk object (``plain``) or a pack object (``packed``, where
``all`` is the packs ``pack_count`` plans for the tree's chunk bytes). At
``data_started`` the first one is durable and others in flight may be too.

With one process ``manifest_written`` and ``before_marker`` look the same on
storage; a two-process test (``test_multihost.py``) tells them apart: the
primary reaches ``before_marker`` only after every process's part is durable.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxckpt.commit import PHASES, list_attempt
from jaxckpt.errors import CorruptCheckpointError
from jaxckpt.records import (
    ATTEMPTS,
    DATA,
    PENDING,
    ROOT_RECORD,
    TRAILER_BYTES,
    WRITERS,
    CommitMarker,
    FileDigest,
    ManifestPart,
    StepLocation,
    is_latest_hint,
    is_temp_key,
    json_record,
    manifest_name,
    new_attempt,
    pack_count,
    pack_name,
    parse_data_key,
    parse_marker_key,
    parse_pending_key,
)
from jaxckpt.storage import Storage

SAVE_PHASES = tuple(p for p in PHASES if p != "delete_retracted")
MAX_PROCESSES = 64
PLANTED_EPOCH = 0  # plant_leftovers writes an attempt of this epoch; no real writer has it

# -- raw reads (the part to port when the layout changes) -----------------------
#
# Layout 4: a save is one attempt, ``attempts/<step>/<attempt>/`` and its packs and
# manifest parts under hashed prefixes ``data/<hh>/<step>.<attempt>/``, announced by
# ``pending/<step>/<attempt>.json`` and committed by ``commits/<step>.e<epoch>.json``.
# The tests here run one writer at a time, so a step has at most one attempt
# besides the planted debris of an earlier writer (epoch 0), which is ignored.


def _attempt(storage: Storage, step: int) -> StepLocation | None:
    """The (one) attempt of ``step`` by a real writer, from its pending record or data."""
    keys = storage.list(f"{PENDING}{step}/") + storage.list(f"{ATTEMPTS}{step}/")
    found = {parse_pending_key(k) or parse_data_key(k) for k in keys}
    found |= {loc for k in storage.list(DATA) if (loc := parse_data_key(k)) and loc.step == step}
    locs = {loc for loc in found if loc is not None and loc.epoch != PLANTED_EPOCH}
    marker = _marker(storage, step)
    if marker is not None and marker[1] is not None:
        locs.add(marker[1].location)
    assert len(locs) <= 1, f"step {step} has several attempts: {sorted(map(str, locs))}"
    return next(iter(locs), None)


def _marker(storage: Storage, step: int) -> tuple[str, CommitMarker | None] | None:
    """The step's marker key and the marker (None when it does not parse), or None."""
    keys = [k for k in storage.list("commits/") if (r := parse_marker_key(k)) and r.step == step]
    assert len(keys) <= 1, f"step {step} has several markers: {keys}"
    if not keys:
        return None
    data = storage.read(keys[0])
    if data is None:
        return None
    try:
        marker = CommitMarker.from_bytes(data, keys[0])
    except CorruptCheckpointError:
        return keys[0], None
    return keys[0], marker if marker.step == step else None


def pending_operation(storage: Storage, step: int) -> str | None:
    """The operation of the step's pending record (``save``/``delete``), None if absent.

    ``torn`` when the record does not parse (a kill while it was being written).
    """
    loc = _attempt(storage, step)
    data = storage.read(loc.pending_key) if loc is not None else None
    if data is None:
        return None
    try:
        return str(json.loads(data)["operation"])
    except (ValueError, KeyError):
        return "torn"


def marker_state(storage: Storage, step: int) -> str | None:
    """``valid``, ``torn`` (present but not a valid marker of ``step``) or None."""
    found = _marker(storage, step)
    if found is None:
        return None
    return "valid" if found[1] is not None else "torn"


def step_objects(storage: Storage, step: int) -> list[str]:
    """Every stored object of the step's attempt, records included (not the marker)."""
    loc = _attempt(storage, step)
    return list_attempt(storage, loc) if loc is not None else []


def has_tree(storage: Storage, step: int) -> bool:
    loc = _attempt(storage, step)
    return loc is not None and storage.read(loc.tree_key) is not None


def manifest_parts(storage: Storage, step: int) -> set[int]:
    """The processes whose manifest part of ``step`` is stored."""
    loc = _attempt(storage, step)
    keys = set(step_objects(storage, step))
    if loc is None:
        return set()
    return {p for p in range(MAX_PROCESSES) if loc.key(manifest_name(p)) in keys}


def data_objects(storage: Storage, step: int) -> set[tuple[str, str]]:
    """``(array name, chunk key)`` of every stored chunk object of the step
    (packed layout: ``("packs", name)`` of every pack object)."""
    loc = _attempt(storage, step)
    if loc is None:
        return set()
    prefix = loc.arrays_prefix
    names = [loc.name_of(k) or "" for k in list_attempt(storage, loc)]
    found = {("packs", n.removeprefix("packs/")) for n in names if n.startswith("packs/")}
    for key in storage.list(prefix):
        name, _, chunk = key[len(prefix) :].partition("/")
        if chunk == "c" or chunk.startswith("c/"):
            found.add((name, chunk))
    return found


def expected_data_objects(storage: Storage, step: int) -> set[tuple[str, str]]:
    """Every chunk object the step's tree record implies (zarr's default chunk keys).

    A packed step (one with any pack object) written by one process: its pack
    objects, as many as ``pack_count`` of the chunk bytes the tree implies.
    """
    loc = _attempt(storage, step)
    data = storage.read(loc.tree_key) if loc is not None else None
    assert data is not None, f"step {step} has no tree record"
    assert loc is not None
    if any(name == "packs" for name, _ in data_objects(storage, step)):
        stored = 0
        for leaf in json.loads(data)["leaves"]:
            if leaf["kind"] != "value" and math.prod(leaf["shape"]):
                cells = math.prod(
                    -(-d // c) for d, c in zip(leaf["shape"], leaf["chunk_shape"], strict=True)
                )
                itemsize = np.dtype(jnp.dtype(leaf["dtype"])).itemsize
                stored += math.prod(leaf["shape"]) * itemsize + TRAILER_BYTES * cells
        return {("packs", pack_name(0, k)[len("packs/") :]) for k in range(pack_count(stored))}
    expected = set()
    for leaf in json.loads(data)["leaves"]:
        if leaf["kind"] == "value":
            continue
        shape, chunks = leaf["shape"], leaf["chunk_shape"]
        if not shape:
            expected.add((leaf["name"], "c"))
            continue
        if math.prod(shape) == 0:
            continue
        grid = [range(-(-d // c)) for d, c in zip(shape, chunks, strict=True)]
        for index in itertools.product(*grid):
            expected.add((leaf["name"], "c/" + "/".join(map(str, index))))
    return expected


def valid_markers(storage: Storage) -> dict[int, CommitMarker]:
    """Valid markers that name their step; asserts the files they list are intact."""
    markers = {}
    for key in storage.list("commits/"):
        ref = parse_marker_key(key)
        data = storage.read(key) if ref is not None else None
        if ref is None or data is None:
            continue
        try:
            marker = CommitMarker.from_bytes(data, key)
        except CorruptCheckpointError:
            continue
        if marker.step != ref.step:
            continue
        for name, digest in marker.files.items():
            stored = storage.read(marker.location.key(name))
            assert stored is not None, f"committed step {ref.step}: {name} is missing"
            assert FileDigest.of(stored) == digest, f"committed step {ref.step}: {name} is altered"
        for name in marker.manifest_names():  # format 4: parts that check themselves
            if name not in marker.files:
                stored = storage.read(marker.location.key(name))
                assert stored is not None, f"committed step {ref.step}: {name} is missing"
                ManifestPart.from_bytes(stored, name, self_checked=True)  # else: altered
        markers[ref.step] = marker
    return dict(sorted(markers.items()))


def valid_marker_steps(storage: Storage) -> list[int]:
    return list(valid_markers(storage))


def stray_objects(storage: Storage, committed: list[int]) -> list[str]:
    """Stored objects other than root records, epochs, hints, the run ledger (``ledger/``,
    the job's own record) and the committed steps' objects.

    A local create-only write's hidden temp file (``commits/.<marker>.<unix>-<hex>.tmp``)
    left by a writer killed inside that write is not counted: it is never read
    or listed as a step, and garbage collection removes it only once it is
    ``TEMP_GRACE_S`` old, because a fresh one may belong to a live writer.
    """
    markers = {s: m for s, m in valid_markers(storage).items() if s in committed}
    allowed = {ROOT_RECORD} | {m.key for m in markers.values()}
    allowed.update(k for m in markers.values() for k in list_attempt(storage, m.location))
    return [
        k
        for k in storage.list("")
        if k not in allowed
        and not k.startswith((WRITERS, "ledger/"))
        and not is_latest_hint(k)
        and not is_temp_key(k)
    ]


def plant_leftovers(storage: Storage, step: int) -> list[str]:
    """The debris of a save of ``step`` by an earlier writer killed before its marker.

    Returns its keys: an attempt of epoch 0, which every real writer's epoch fences.
    """
    loc = StepLocation(step, new_attempt(PLANTED_EPOCH))
    storage.write(ROOT_RECORD, json_record(created=time.time()))
    storage.write(loc.pending_key, json_record(operation="save", started=time.time()))
    stray = [loc.arrays_prefix + "params.w/c/99/0", loc.prefix + "stray.bin"]
    for key in stray:
        storage.write(key, b"\xde\xad\xbe\xef" * 64)
    return [loc.pending_key, *stray]


# -- post-conditions (in terms of the reads above) -------------------------------


def describe(storage: Storage, step: int) -> dict[str, Any]:
    """The facts the post-conditions look at, for assertion messages."""
    tree = has_tree(storage, step)
    return {
        "pending": pending_operation(storage, step),
        "marker": marker_state(storage, step),
        "tree": tree,
        "data": len(data_objects(storage, step)),
        "all data": len(expected_data_objects(storage, step)) if tree else None,
        "parts": sorted(manifest_parts(storage, step)),
        "objects": len(step_objects(storage, step)),
    }


def check_phase(
    storage: Storage, step: int, phase: str, *, processes: int = 1, process: int = 0
) -> None:
    """Asserts the post-condition of ``phase`` (see the module docstring).

    Args:
      process: the process that reached ``phase`` (its own part must exist).
    """
    assert phase in PHASES, phase
    facts = describe(storage, step)
    where = f"step {step} at {phase}: {facts}"
    everyone = set(range(processes))
    expected_op = "delete" if phase == "delete_retracted" else "save"
    assert facts["pending"] == expected_op, where
    assert facts["marker"] == ("valid" if phase == "marker_written" else None), where
    if phase == "pending_written":
        assert facts["objects"] == 0, where
        return
    assert facts["tree"], where
    data = data_objects(storage, step)
    if phase == "data_started":
        assert processes == 1, "data_started is checked on one process only"
        # The first data object is durable; others of the uploads in flight may be too.
        assert data and data <= expected_data_objects(storage, step), where
    else:
        assert data == expected_data_objects(storage, step), where
    parts = manifest_parts(storage, step)
    if phase in ("data_started", "data_written"):
        assert parts == set(), where
    elif phase == "manifest_written":
        assert process in parts and parts <= everyone, where
    else:
        assert parts == everyone, where


def observed_phase(storage: Storage, step: int) -> str:
    """The latest save phase whose post-condition storage shows (one process).

    ``manifest_written`` stands for ``before_marker`` too (they look the same),
    and a torn marker (impossible now that create-only writes are atomic, but
    reported rather than hidden) counts as ``before_marker``. ``none`` means no
    trace of a save of ``step``.
    """
    marker = marker_state(storage, step)
    if marker == "valid":
        return "marker_written"
    if marker == "torn":
        return "before_marker"
    if manifest_parts(storage, step):
        return "manifest_written"
    data = data_objects(storage, step)
    if data and has_tree(storage, step) and data == expected_data_objects(storage, step):
        return "data_written"
    if data:
        return "data_started"
    if pending_operation(storage, step) in ("save", "torn"):
        return "pending_written"
    return "none"


def observed_phases(storage: Storage, step: int) -> frozenset[str]:
    """Every save phase whose post-condition storage shows as the latest (one process):
    :func:`observed_phase`, and ``data_started`` too where the step's data is one object
    (its first object durable is all of it durable)."""
    observed = observed_phase(storage, step)
    if observed == "data_written" and len(expected_data_objects(storage, step)) == 1:
        return frozenset({"data_started", observed})
    return frozenset({observed})


# After a kill that followed the announcement of phase X (None: none yet), the
# phases storage may show: X itself or the next one, whose action may be durable
# although its announcement was never printed. before_marker has no storage action
# of its own, so after manifest_written the marker may already be there.
AFTER_ANNOUNCED: dict[str | None, frozenset[str]] = {
    None: frozenset({"none", "pending_written"}),
    "pending_written": frozenset({"pending_written", "data_started"}),
    "data_started": frozenset({"data_started", "data_written"}),
    "data_written": frozenset({"data_written", "manifest_written"}),
    "manifest_written": frozenset({"manifest_written", "before_marker", "marker_written"}),
    "before_marker": frozenset({"manifest_written", "before_marker", "marker_written"}),
    "marker_written": frozenset({"marker_written"}),
}
