"""Per-process state (a data iterator's position), committed with a step's arrays.

``save(step, state, process_state=...)`` takes this process's own value: ``bytes``
(grain's ``DataLoader`` iterator state), ``str``, or a JSON value (a
``DatasetIterator.get_state()`` dict). It is encoded here into a small record
carried inside the process's manifest part (``"process_state"``), which the
commit marker already covers with a CRC32C: every path that copies a step's
parts (promotion, peer replicas, ``jaxckpt cp``) carries it unchanged, and it
is committed by the same marker as the arrays. The record has its own size
and CRC32C too, so a damaged one is named on its own.

Reading back: :class:`RestoredStates` (this process's value of the step a
restore returned) and :func:`read_process_states` (every process's values of
a step, for an elastic iterator). This module imports no jax at import time.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jaxckpt import errors
from jaxckpt.errors import CheckpointError, CorruptCheckpointError, UnsupportedLeafError
from jaxckpt.records._jsonvalue import json_problem
from jaxckpt.records._step import crc32c, dumps

if TYPE_CHECKING:
    from jaxckpt.commit import Agreement
    from jaxckpt.restoring import Selection

MAX_PROCESS_STATE_BYTES = 1 << 20
"""The largest ``process_state`` one process may save per step (encoded: bytes as they
are, a str as UTF-8, anything else as canonical JSON). Every process's record is read by
every restore, so it is for positions and small counters; data that grows belongs in the
state tree as arrays."""

KINDS = ("bytes", "str", "json")


def encode(value: Any, *, step: int, process: int) -> dict[str, Any] | None:
    """The manifest record of ``value`` (None: nothing to save).

    Raises:
      UnsupportedLeafError: ``value`` is neither bytes, str nor JSON-serialisable.
      CheckpointError: its encoding is over :data:`MAX_PROCESS_STATE_BYTES`.
    """
    if value is None:
        return None
    where = f"step {step}: process_state of process {process}"
    if isinstance(value, bytes | bytearray | memoryview):
        kind, raw = "bytes", bytes(value)
        data: Any = base64.b64encode(raw).decode("ascii")
    elif isinstance(value, str):
        kind, raw, data = "str", value.encode("utf-8"), value
    else:
        value = plain_numbers(value)  # numpy scalars: the Python numbers they equal
        problem = json_problem(value)
        if problem is not None:
            raise UnsupportedLeafError(
                f"{where} must be bytes, str or JSON that comes back unchanged (dicts of "
                f"str keys, lists, str, int, float, bool, None): {problem}"
            )
        try:
            raw = dumps(value)
        except (TypeError, ValueError) as e:
            raise UnsupportedLeafError(
                f"{where} must be bytes, str or JSON-serialisable (a dict of str keys, lists, "
                f"numbers, str, bool, None), got {type(value).__name__}: {e}"
            ) from e
        kind, data = "json", json.loads(raw)
    if len(raw) > MAX_PROCESS_STATE_BYTES:
        raise CheckpointError(
            f"{where} is {len(raw):,} bytes; at most MAX_PROCESS_STATE_BYTES="
            f"{MAX_PROCESS_STATE_BYTES:,} per process (it is read by every restore): keep a "
            "position in it and save larger per-process data as arrays of the state"
        )
    return {"kind": kind, "data": data, "size": len(raw), "crc32c": crc32c(raw)}


def plain_numbers(value: Any) -> Any:
    """``value`` with numpy scalars (``np.int64``, ``np.float32``, ``np.bool_``: what a
    data iterator's state often holds) as the Python numbers they equal; else unchanged."""
    try:
        return _plain(value)
    except RecursionError:
        return value  # too deep to walk here: the JSON encoder decides


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    item = getattr(value, "item", None)
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == () and item:
        return item()
    return value


def decode(record: Any, what: str) -> Any:
    """The value a record holds, checked against its size and CRC32C.

    Raises:
      CorruptCheckpointError: malformed, or it fails its size or checksum (``what`` named).
    """
    if not isinstance(record, Mapping) or record.get("kind") not in KINDS:
        raise CorruptCheckpointError(f"{what} is not a process_state record")
    kind = record["kind"]
    data: Any = record.get("data")
    size = record.get("size")
    if (
        isinstance(size, bool)
        or not isinstance(size, int)
        or not 0 <= size <= MAX_PROCESS_STATE_BYTES
    ):
        raise CorruptCheckpointError(  # the bound holds on read too, before anything is decoded
            f"{what} claims {size!r} bytes; at most MAX_PROCESS_STATE_BYTES="
            f"{MAX_PROCESS_STATE_BYTES:,}"
        )
    if isinstance(data, str) and len(data) > 4 * (MAX_PROCESS_STATE_BYTES // 3 + 1):
        raise CorruptCheckpointError(
            f"{what} holds {len(data):,} characters; at most MAX_PROCESS_STATE_BYTES="
            f"{MAX_PROCESS_STATE_BYTES:,} bytes"
        )
    value, raw = data, b""
    try:
        if kind == "bytes":
            value = raw = base64.b64decode(data, validate=True)
        elif kind == "str":
            raw = data.encode("utf-8")
        else:
            raw = dumps(data)
    except (TypeError, ValueError, AttributeError, binascii.Error) as e:
        raise CorruptCheckpointError(f"{what} is malformed ({e})") from e
    if len(raw) != record.get("size") or crc32c(raw) != record.get("crc32c"):
        raise CorruptCheckpointError(f"{what} does not match its checksum")
    return value


@dataclass(frozen=True)
class RestoredStates:
    """The process states of the step a ``restore()`` returned, by saving process."""

    step: int | None = None
    num_processes: int = 1
    records: Mapping[int, Any] = field(default_factory=dict)

    def own(self, process: int, process_count: int) -> Any:
        """This process's value (None: none saved, or no restore yet).

        Raises:
          CheckpointError: the step was saved by another number of processes, with states.
          CorruptCheckpointError: the record fails its checksum.
        """
        if self.step is None or not self.records:
            return None
        if self.num_processes != process_count:
            raise CheckpointError(
                f"step {self.step} was saved by {self.num_processes} processes with a "
                f"process_state each; this job has {process_count}, so no saved state is this "
                f"process's own: read them all with process_states({self.step}) and "
                "redistribute them (e.g. an elastic data iterator)"
            )
        record = self.records.get(process)
        what = f"step {self.step}: process_state of process {process}"
        return None if record is None else decode(record, what)


def read_process_states(selection: Selection, agreement: Agreement, step: int) -> list[Any]:
    """Every process's ``process_state`` of ``step``, by process index (None where that
    process saved none); collective on several processes.

    The shared (durable) tier holds every process's part; it is read when it holds the
    step (the primary's answer). A step only on the local tiers is gathered from every
    host's own part, which needs the job that saved it (the same process count).

    Raises:
      StepNotFoundError: no tier holds ``step``.
      CheckpointError: only local copies of a step saved by another number of processes.
      CorruptCheckpointError: a part or a record fails its checksum.
    """
    import jax

    shared = next((t for t in selection.tiers if not t.own), None)
    held = shared is not None and shared.holds(step)
    if shared is not None and agreement.agree("process-states-shared", held):
        marker = shared.marker(step)
        parts = shared.protocol.read_manifest(marker)
        records = {p.process: p.process_state for p in parts if p.process_state is not None}
        return _values(step, marker.num_processes, records)
    tier = selection.holder(step)
    count = jax.process_count()
    mine: list[Any] = [None, None]  # [error class, message] or [None, this process's record]
    try:
        marker = tier.marker(step)
        if marker.num_processes != count:
            raise CheckpointError(
                f"step {step} is only on the local tiers (under {tier.uri}) of a job of "
                f"{marker.num_processes} processes; this job has {count}: read it where it "
                "is durable (promote it first)"
            )
        own = [p for p in tier.protocol.read_manifest(marker) if p.process_state is not None]
        mine[1] = next((p.process_state for p in own if p.process == jax.process_index()), None)
    except CheckpointError as e:  # every host learns of it, none waits for it
        mine = [type(e).__name__, str(e)]
    gathered = agreement.gather(f"process-states-{step}", mine)
    for kind, message in gathered:
        if kind is not None:
            raise getattr(errors, kind, CheckpointError)(message)
    return _values(step, count, {p: record for p, (_, record) in enumerate(gathered)})


def _values(step: int, num_processes: int, records: Mapping[int, Any]) -> list[Any]:
    out: list[Any] = [None] * num_processes
    for process, record in records.items():
        if record is not None and 0 <= process < num_processes:
            out[process] = decode(record, f"step {step}: process_state of process {process}")
    return out


class ProcessStateAccess:
    """What a :class:`jaxckpt.CheckpointManager`'s restores returned, and the per-process
    state of its steps (a base class of the manager, which sets ``_select`` and
    ``_agreement`` and passes each restore's result through :meth:`_restored`)."""

    _select: Selection
    _agreement: Agreement
    _restored_states: RestoredStates = RestoredStates()
    restored_step: int | None = None
    """The step the last ``restore()`` returned (None before any; see ``restore``)."""

    def _restored(self, restored: tuple[int, Any, RestoredStates]) -> Any:
        """Records which step a restore returned, and its process states; returns the state."""
        self.restored_step, state, self._restored_states = restored
        return state

    @property
    def restored_process_state(self) -> Any:
        """This process's ``process_state`` of the step the last ``restore()`` returned
        (None before any restore, or when this process saved none with that step).

        Raises:
          CheckpointError: the step was saved by another number of processes (with
            process states): read them all with :meth:`process_states` and redistribute.
          CorruptCheckpointError: the saved record fails its checksum.
        """
        import jax

        return self._restored_states.own(jax.process_index(), jax.process_count())

    def process_states(self, step: int) -> list[Any]:
        """Every process's ``process_state`` of ``step``, by process index (None where a
        process saved none): what an elastic data iterator redistributes when the job's
        process count changed. On several processes this is collective.

        Raises:
          StepNotFoundError: no such committed step.
          CheckpointError: the step is only on local tiers of a job of another size.
          CorruptCheckpointError: a record fails its checksum.
        """
        from jaxckpt.records._keys import check_step

        return read_process_states(self._select, self._agreement, check_step(step))
