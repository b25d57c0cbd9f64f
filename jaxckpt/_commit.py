"""The commit-marker protocol. Imports no jax, so listing tools start fast.

Layout under a root (keys are relative to the root)::

    jaxckpt.json                      root record (format, version)
    pending/<step>.json               intent: a save or delete of <step> is under way
    steps/<step>/arrays/<name>/...    zarr v3 arrays (one per array leaf)
    steps/<step>/arrays/zarr.json     zarr v3 group, so zarr-python can open the arrays
    steps/<step>/manifest/<proc>.json chunks written by process <proc>, with CRC32C
    steps/<step>/tree.json            the tree: paths, array metadata, non-array values
    commits/<step>.json               the commit marker, written last

A save writes ``pending``, then data, then the manifest parts and the tree
record (each durable before the next phase), then creates the marker with a
create-only write, then removes ``pending``. A delete writes ``pending``,
removes the marker, then the data, then ``pending``. So at every instant a
step is either committed (a valid marker) or partial (data without a valid
marker, always announced by a ``pending`` record), and partial steps are
garbage-collected. Nothing relies on rename.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from jaxckpt import policy
from jaxckpt._phases import reached
from jaxckpt._records import (
    CommitMarker,
    FileDigest,
    ManifestPart,
    json_record,
    load_json_record,
)
from jaxckpt._storage import PreconditionFailed, Storage
from jaxckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NotACheckpointRootError,
    StepAlreadyExistsError,
    StepNotFoundError,
    UncommittedStepError,
    UnsupportedFormatError,
)

log = logging.getLogger("jaxckpt")

ROOT_RECORD = "jaxckpt.json"
TREE_FILE = "tree.json"


def step_prefix(step: int) -> str:
    return f"steps/{step}/"


def arrays_prefix(step: int) -> str:
    return f"steps/{step}/arrays/"


def marker_key(step: int) -> str:
    return f"commits/{step}.json"


def pending_key(step: int) -> str:
    return f"pending/{step}.json"


def manifest_key(process: int) -> str:
    return f"manifest/{process}.json"


def _step_from_key(key: str, directory: str) -> int | None:
    name = key[len(directory) + 1 :]
    stem = name[: -len(".json")] if name.endswith(".json") else ""
    return int(stem) if stem.isdigit() else None


@dataclass(frozen=True, kw_only=True)
class PartialStep:
    """A step with data or a pending record but no valid commit marker."""

    step: int
    operation: str
    started: float | None
    reason: str

    def expired(self, grace_s: float, now: float) -> bool:
        """Older than ``grace_s`` (a step of unknown age always is)."""
        return self.started is None or now - self.started >= grace_s


class CommitProtocol:
    """Reads and writes the protocol's records on one :class:`Storage` root."""

    def __init__(self, storage: Storage, *, list_workers: int = 16) -> None:
        self.storage = storage
        self._list_workers = list_workers

    def where(self, key: str = "") -> str:
        """The full URI of ``key``, for messages."""
        return f"{self.storage.uri.rstrip('/')}/{key}"

    # -- root ---------------------------------------------------------------

    def ensure_root(self, *, create: bool) -> None:
        """Checks the root record; with ``create``, writes it if absent.

        Raises:
          NotACheckpointRootError: no root record and not ``create``.
          UnsupportedFormatError: the root was written by a newer format.
        """
        data = self.storage.read(ROOT_RECORD)
        if data is None:
            if not create:
                raise NotACheckpointRootError(
                    f"{self.storage.uri} is not a jaxckpt root (no {ROOT_RECORD})"
                )
            with contextlib.suppress(PreconditionFailed):  # another process created it
                self.storage.write(ROOT_RECORD, json_record(created=time.time()), exclusive=True)
            data = self.storage.read(ROOT_RECORD) or b""
        load_json_record(data, self.where(ROOT_RECORD))

    # -- committed steps ----------------------------------------------------

    def read_marker(self, step: int) -> CommitMarker | None:
        """The step's valid marker, or None when absent or torn.

        Raises:
          UnsupportedFormatError: the marker has a newer format version.
        """
        data = self.storage.read(marker_key(step))
        if data is None:
            return None
        try:
            marker = CommitMarker.from_bytes(data, self.where(marker_key(step)))
        except UnsupportedFormatError:
            raise
        except CorruptCheckpointError as e:
            log.warning("ignoring invalid commit marker: %s", e)
            return None
        return marker if marker.step == step else None

    def marker_steps(self) -> list[int]:
        """Steps that have a marker object (valid or not), from one listing."""
        keys = self.storage.list("commits/")
        steps = (_step_from_key(k, "commits") for k in keys)
        return sorted(s for s in steps if s is not None)

    def committed(self) -> dict[int, CommitMarker]:
        """Every committed step with its validated marker, ascending."""
        steps = self.marker_steps()
        markers = self._map(self.read_marker, steps)
        return {s: m for s, m in zip(steps, markers, strict=True) if m is not None}

    def require_marker(self, step: int) -> CommitMarker:
        """The marker of a committed step.

        Raises:
          UncommittedStepError: the step has data but no valid marker.
          StepNotFoundError: no such step.
        """
        marker = self.read_marker(step)
        if marker is not None:
            return marker
        if self.storage.read(pending_key(step)) is not None:
            raise UncommittedStepError(
                f"step {step} under {self.storage.uri} is partial (no valid commit marker)"
            )
        steps = sorted(self.committed())
        raise StepNotFoundError(
            f"step {step} not found under {self.storage.uri}; committed steps: {_brief(steps)}"
        )

    # -- writing a step -----------------------------------------------------

    def begin_save(self, step: int) -> None:
        """Announces a save of ``step``, clearing leftovers of a partial one.

        Raises:
          StepAlreadyExistsError: ``step`` is committed.
        """
        if self.read_marker(step) is not None:
            raise StepAlreadyExistsError(f"step {step} already exists under {self.storage.uri}")
        self.storage.write(pending_key(step), json_record(operation="save", started=time.time()))
        self.storage.delete(marker_key(step))  # a torn marker from a crashed attempt
        self.storage.delete_prefix(step_prefix(step))
        reached("pending_written", step)

    def write_manifest_part(self, part: ManifestPart) -> None:
        self.storage.write(step_prefix(part.step) + manifest_key(part.process), part.to_bytes())

    def write_tree(self, step: int, tree: bytes) -> None:
        self.storage.write(step_prefix(step) + TREE_FILE, tree)

    def read_step_file(self, marker: CommitMarker, name: str) -> bytes:
        """Reads a file listed in the marker and checks its size and CRC32C.

        Raises:
          CorruptCheckpointError: missing or altered.
        """
        key = step_prefix(marker.step) + name
        data = self.storage.read(key)
        expected = marker.files.get(name)
        if data is None or expected is None:
            raise CorruptCheckpointError(f"step {marker.step}: {self.where(key)} is missing")
        if FileDigest.of(data) != expected:
            raise CorruptCheckpointError(
                f"step {marker.step}: {self.where(key)} does not match its checksum"
            )
        return data

    def read_manifest(self, marker: CommitMarker) -> list[ManifestPart]:
        names = sorted(n for n in marker.files if n.startswith("manifest/"))
        return [
            ManifestPart.from_bytes(self.read_step_file(marker, n), self.where(n)) for n in names
        ]

    def commit(
        self,
        step: int,
        *,
        num_processes: int,
        metrics: dict[str, float] | None = None,
        keep: bool = False,
    ) -> CommitMarker:
        """Writes the commit marker once every process's manifest part is present.

        Raises:
          CheckpointError: a manifest part or the tree record is missing.
          StepAlreadyExistsError: another writer committed this step first.
        """
        names = [TREE_FILE] + [manifest_key(p) for p in range(num_processes)]
        files: dict[str, FileDigest] = {}
        nbytes = 0
        for name in names:
            key = step_prefix(step) + name
            data = self.storage.read(key)
            if data is None:
                raise CheckpointError(f"cannot commit step {step}: {self.where(key)} is missing")
            files[name] = FileDigest.of(data)
            if name.startswith("manifest/"):
                nbytes += ManifestPart.from_bytes(data, self.where(key)).nbytes
        marker = CommitMarker(
            step=step,
            time=time.time(),
            num_processes=num_processes,
            files=files,
            nbytes=nbytes,
            metrics=dict(metrics or {}),
            keep=keep,
        )
        reached("before_marker", step)
        try:
            self.storage.write(marker_key(step), marker.to_bytes(), exclusive=True)
        except PreconditionFailed as e:
            raise StepAlreadyExistsError(
                f"step {step} was committed by another writer under {self.storage.uri}"
            ) from e
        reached("marker_written", step)
        self.storage.delete(pending_key(step))
        return marker

    # -- deleting and garbage collection ------------------------------------

    def delete(self, step: int) -> None:
        """Deletes a step: retract the marker first, then the data."""
        self.storage.write(pending_key(step), json_record(operation="delete", started=time.time()))
        self.storage.delete(marker_key(step))
        reached("delete_retracted", step)
        self.storage.delete_prefix(step_prefix(step))
        self.storage.delete(pending_key(step))

    def partial_steps(self) -> list[PartialStep]:
        """Steps with a pending record or a torn marker and no valid marker."""
        pending = self.storage.list("pending/")
        candidates: dict[int, str] = {}
        for key in pending:
            step = _step_from_key(key, "pending")
            if step is not None:
                candidates[step] = "pending record without a valid commit marker"
        for step in self.marker_steps():
            candidates.setdefault(step, "invalid commit marker")
        result = []
        for step, reason in sorted(candidates.items()):
            if self.read_marker(step) is not None:
                continue
            operation, started = "unknown", None
            raw = self.storage.read(pending_key(step))
            if raw is not None:
                try:
                    record = load_json_record(raw, self.where(pending_key(step)))
                    operation, started = record.get("operation", "unknown"), record.get("started")
                except CheckpointError:
                    pass
            result.append(
                PartialStep(step=step, operation=operation, started=started, reason=reason)
            )
        return result

    def collect_garbage(
        self, *, older_than_s: float = 0.0, partials: Sequence[PartialStep] | None = None
    ) -> list[int]:
        """Removes partial steps whose pending record is older than ``older_than_s``.

        Stale pending records of committed steps (a crash between the marker and
        the cleanup) and temporary files of crashed create-only writes are
        removed too. Returns the partial steps removed.

        Args:
          partials: the result of :meth:`partial_steps`, if the caller has it.
        """
        now = time.time()
        removed = []
        for partial in self.partial_steps() if partials is None else partials:
            if not partial.expired(older_than_s, now):
                continue
            self.storage.delete(marker_key(partial.step))
            self.storage.delete_prefix(step_prefix(partial.step))
            self.storage.delete(pending_key(partial.step))
            removed.append(partial.step)
        pending = self.storage.list("pending/")
        for key in pending + self.storage.list("commits/"):
            if key.rsplit("/", 1)[-1].startswith("."):  # a crashed create-only write's temp file
                self.storage.delete(key)
        for key in pending:
            step = _step_from_key(key, "pending")
            if step is not None and self.read_marker(step) is not None:
                self.storage.delete(key)
        if removed:
            log.info("removed partial steps %s under %s", removed, self.storage.uri)
        return removed

    def _map(self, fn: Callable[[int], CommitMarker | None], items: Iterable[int]) -> list:
        items = list(items)
        if len(items) <= 1:
            return [fn(i) for i in items]
        with ThreadPoolExecutor(min(self._list_workers, len(items))) as pool:
            return list(pool.map(fn, items))


def _brief(steps: list[int], limit: int = 20) -> str:
    if not steps:
        return "none"
    if len(steps) <= limit:
        return ", ".join(map(str, steps))
    head = ", ".join(map(str, steps[: limit // 2]))
    tail = ", ".join(map(str, steps[-limit // 2 :]))
    return f"{head}, ... {tail} ({len(steps)} steps)"


def retention_decision(
    committed: dict[int, CommitMarker],
    retention: policy.RetentionPolicy | None,
    *,
    protected: Iterable[int] = (),
) -> policy.RetentionDecision:
    """What ``retention`` keeps and deletes among committed steps (metrics, pins from markers)."""
    infos = [
        policy.StepInfo(step=s, metrics=dict(m.metrics) or None, pinned=m.keep)
        for s, m in committed.items()
    ]
    return policy.decide_retention(retention, infos, protected=set(protected))
