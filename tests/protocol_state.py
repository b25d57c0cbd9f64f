"""What a step looks like on storage at each phase of the commit protocol.

The only test module that reads the raw on-storage state of an uncommitted
step. Keys come from ``jaxckpt._commit`` (``step_prefix``, ``arrays_prefix``,
``manifest_key``, ``TREE_FILE``, ...), never from literals, so a layout change
(attempt prefixes, per-attempt pending records) is ported by changing the
*reads* below; the per-phase post-conditions further down are written in terms
of those reads only.

Post-conditions of a save of step ``s`` by ``n`` processes, as
:func:`check_phase` asserts them (``data`` is the set of stored chunk objects,
``all`` every chunk the tree record implies, ``parts`` the manifest parts):

=================  =======  ===========  ============  ==========  ======
phase              pending  data         parts         tree        marker
=================  =======  ===========  ============  ==========  ======
pending_written    save     none         none          no          none
data_started       save     exactly 1    none          yes         none
data_written       save     all          none          yes         none
manifest_written   save     all          own ⊆ parts   yes         none
before_marker      save     all          every proc.   yes         none
marker_written     save     all          every proc.   yes         valid
delete_retracted   delete   all          every proc.   yes         none
=================  =======  ===========  ============  ==========  ======

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

from jaxckpt._commit import (
    ROOT_RECORD,
    TREE_FILE,
    CommitProtocol,
    arrays_prefix,
    manifest_key,
    marker_key,
    pending_key,
    step_prefix,
)
from jaxckpt._phases import PHASES
from jaxckpt._records import CommitMarker, FileDigest, json_record
from jaxckpt._storage import Storage
from jaxckpt.errors import CorruptCheckpointError

SAVE_PHASES = tuple(p for p in PHASES if p != "delete_retracted")
MAX_PROCESSES = 64

# -- raw reads (the part to port when the layout changes) -----------------------


def pending_operation(storage: Storage, step: int) -> str | None:
    """The operation of the step's pending record (``save``/``delete``), None if absent.

    ``torn`` when the record does not parse (a kill while it was being written).
    """
    data = storage.read(pending_key(step))
    if data is None:
        return None
    try:
        return str(json.loads(data)["operation"])
    except (ValueError, KeyError):
        return "torn"


def marker_state(storage: Storage, step: int) -> str | None:
    """``valid``, ``torn`` (present but not a valid marker of ``step``) or None."""
    data = storage.read(marker_key(step))
    if data is None:
        return None
    try:
        marker = CommitMarker.from_bytes(data, marker_key(step))
    except CorruptCheckpointError:
        return "torn"
    return "valid" if marker.step == step else "torn"


def step_objects(storage: Storage, step: int) -> list[str]:
    """Every stored object of the step's data, records included (not the marker)."""
    return storage.list(step_prefix(step))


def has_tree(storage: Storage, step: int) -> bool:
    return storage.read(step_prefix(step) + TREE_FILE) is not None


def manifest_parts(storage: Storage, step: int) -> set[int]:
    """The processes whose manifest part of ``step`` is stored."""
    keys = set(step_objects(storage, step))
    return {p for p in range(MAX_PROCESSES) if step_prefix(step) + manifest_key(p) in keys}


def data_objects(storage: Storage, step: int) -> set[tuple[str, str]]:
    """``(array name, chunk key)`` of every stored chunk object of the step."""
    prefix = arrays_prefix(step)
    found = set()
    for key in storage.list(prefix):
        name, _, chunk = key[len(prefix) :].partition("/")
        if chunk == "c" or chunk.startswith("c/"):
            found.add((name, chunk))
    return found


def expected_data_objects(storage: Storage, step: int) -> set[tuple[str, str]]:
    """Every chunk object the step's tree record implies (zarr's default chunk keys)."""
    data = storage.read(step_prefix(step) + TREE_FILE)
    assert data is not None, f"step {step} has no tree record"
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


def valid_marker_steps(storage: Storage) -> list[int]:
    """Steps with a valid marker that names them; asserts their listed files are intact."""
    steps = []
    for step in CommitProtocol(storage).marker_steps():
        data = storage.read(marker_key(step))
        if data is None:
            continue
        try:
            marker = CommitMarker.from_bytes(data, marker_key(step))
        except CorruptCheckpointError:
            continue  # torn: a crash while the marker was being written
        if marker.step != step:
            continue
        for name, digest in marker.files.items():
            stored = storage.read(step_prefix(step) + name)
            assert stored is not None, f"committed step {step}: {name} is missing"
            assert FileDigest.of(stored) == digest, f"committed step {step}: {name} is altered"
        steps.append(step)
    return sorted(steps)


def stray_objects(storage: Storage, committed: list[int]) -> list[str]:
    """Stored objects other than the root record and the committed steps' objects."""
    allowed = {ROOT_RECORD} | {marker_key(s) for s in committed}
    prefixes = tuple(step_prefix(s) for s in committed)
    return [k for k in storage.list("") if k not in allowed and not k.startswith(prefixes)]


def plant_leftovers(storage: Storage, step: int) -> list[str]:
    """The debris of a save of ``step`` killed while writing its marker; returns its data keys."""
    storage.write(ROOT_RECORD, json_record(created=time.time()))
    storage.write(pending_key(step), json_record(operation="save", started=time.time()))
    storage.write(marker_key(step), b'{"format":"jaxckpt","version":1,"step":')  # torn
    stray = [arrays_prefix(step) + "params.w/c/99/0", step_prefix(step) + "stray.bin"]
    for key in stray:
        storage.write(key, b"\xde\xad\xbe\xef" * 64)
    return stray


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
        assert len(data) == 1, where
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
    and a torn marker counts as ``before_marker`` (the marker write was under
    way). ``none`` means no trace of a save of ``step``.
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
