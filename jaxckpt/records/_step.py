"""On-storage records: the commit marker, manifest parts and the tree record.

Records are small JSON objects. Each carries ``format`` and ``version``; the
commit marker also carries a CRC32C of its own canonical encoding, so a marker
torn by a crash mid-write is detected and treated as absent; so does a manifest
part from version 4 on, so a restore checks the few parts it reads without the
marker listing every part's digest. This module imports neither jax nor numpy.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import crc32c as _crc32c

from jaxckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from jaxckpt.records._keys import StepLocation, marker_key, parse_attempt
from jaxckpt.records._layouts import FORMATS, DataFormat, format_named
from jaxckpt.records._names import checked_name

if TYPE_CHECKING:
    import numpy as np

    from jaxckpt.storage import Storage

FORMAT = "jaxckpt"
LAYOUTS = tuple(FORMATS)
"""Data formats inside an attempt (:mod:`jaxckpt.formats`): one object per zarr chunk, or a
few pack objects."""
FORMAT_VERSION = 4
"""2: save attempts under their own prefix, markers name attempt and epoch (see _keys).
4: manifest parts check themselves (``part_crc32c``); a marker names its parts without
their digests (``parts``, ``parts_crc32c``), so it stays the same size whatever the
number of processes, and a restore reads only the parts it needs."""
PACKED_VERSION = 3
"""The version of a manifest part of a packed step (chunks inside pack objects, see _pack)
written before version 4.

Only manifest parts carry it, so a jaxckpt that predates packing refuses such a
step with :class:`UnsupportedFormatError` instead of misreading it."""
SELF_CHECKED_VERSION = 4
"""From this version on a manifest part carries ``part_crc32c`` over its own canonical
encoding, and a marker lists no digest of such a part."""


def crc32c(data: bytes | memoryview) -> int:
    """CRC32C (Castagnoli) of ``data``."""
    return int(_crc32c.crc32c(data))


TRAILER_BYTES = 4  # the crc32c codec appends CRC32C(raw), little-endian


def chunk_problem(stored: Any, record: ChunkRecord) -> str | None:
    """Why a stored chunk object does not match its manifest record, or None."""
    if len(stored) != record.size:
        return f"size {len(stored)} != recorded {record.size}"
    view = memoryview(stored) if isinstance(stored, bytes) else stored.data
    raw, trailer = view[:-TRAILER_BYTES], bytes(view[-TRAILER_BYTES:])
    if int(crc32c(raw)) != record.crc32c:
        return "checksum mismatch"
    if trailer != record.crc32c.to_bytes(TRAILER_BYTES, "little"):
        return "checksum trailer mismatch"
    return None


def dumps(obj: Any) -> bytes:
    """Canonical JSON encoding (sorted keys, no spaces), as UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def _check_version(obj: Mapping[str, Any], what: str, newest: int = FORMAT_VERSION) -> None:
    if obj.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{what} is not a jaxckpt record")
    version = obj.get("version")
    if not isinstance(version, int):
        raise CorruptCheckpointError(f"{what} has no format version")
    if version > newest:
        raise UnsupportedFormatError(
            f"{what} has format version {version}; this jaxckpt reads up to "
            f"{newest}. Upgrade jaxckpt to read it."
        )


@dataclass(frozen=True, kw_only=True)
class FileDigest:
    """Size and CRC32C of one stored object."""

    size: int
    crc32c: int

    @classmethod
    def of(cls, data: bytes) -> FileDigest:
        return cls(size=len(data), crc32c=crc32c(data))


@dataclass(frozen=True, kw_only=True)
class ChunkAddress:
    """Where a chunk's stored bytes lie: ``size`` bytes at ``offset`` of object ``key``."""

    key: str
    """The storage key of the object that holds the chunk (relative to the root)."""
    offset: int
    size: int
    whole: bool
    """The object is this chunk alone (read it whole), not a byte range of a larger one."""

    def read(self, storage: Storage) -> bytes | np.ndarray | None:
        """The chunk's stored bytes (None when the object is missing)."""
        if self.whole:
            return storage.read_buffer(self.key, self.size)
        return storage.read_range(self.key, self.offset, self.size)


@dataclass(frozen=True, kw_only=True)
class ChunkRecord:
    """One stored zarr chunk: its key inside the array, size and CRC32C.

    A chunk of a packed step also names the pack object that holds it
    (``pack``, relative to the attempt's prefix) and its byte ``offset`` there;
    the stored bytes are the same ``raw || crc32c(raw)`` either way.
    """

    key: str
    size: int
    crc32c: int
    pack: str | None = None
    offset: int = 0

    def address(self, loc: StepLocation, array: str) -> ChunkAddress:
        """Where this chunk of array ``array`` (its name) of step ``loc`` is stored.

        The one place that answers it for every reader, verifier, copier and exporter.
        """
        if self.pack is None:
            return ChunkAddress(
                key=loc.array_prefix(array) + self.key, offset=0, size=self.size, whole=True
            )
        return ChunkAddress(key=loc.key(self.pack), offset=self.offset, size=self.size, whole=False)

    @property
    def whole_object(self) -> bool:
        """The chunk is an object of its own (not a byte range of a pack)."""
        return self.pack is None

    def inside(self) -> str:
        """For messages: ``" (in pack <name> at byte <offset>)"``, or "" for a whole object."""
        return "" if self.pack is None else f" (in pack {self.pack} at byte {self.offset})"

    def encode(self) -> list[Any]:
        if self.pack is None:
            return [self.key, self.size, self.crc32c]
        return [self.key, self.size, self.crc32c, self.pack, self.offset]

    @classmethod
    def decode(cls, item: Sequence[Any], what: str) -> ChunkRecord:
        """A chunk record read from a manifest part, every field checked.

        Raises:
          CorruptCheckpointError: a malformed record or an unsafe key or pack name.
        """
        if not isinstance(item, list) or len(item) not in (3, 5):
            raise CorruptCheckpointError(f"{what}: malformed chunk record {item!r:.200}")
        key = checked_name(item[0], "chunk", what)
        size, crc = _int(item[1], what, "chunk size"), _int(item[2], what, "chunk crc32c")
        if size < TRAILER_BYTES or crc >= 1 << 32:
            raise CorruptCheckpointError(f"{what}: malformed chunk record {item!r:.200}")
        if len(item) == 3:
            return cls(key=key, size=size, crc32c=crc)
        pack = checked_name(item[3], "pack", what)
        return cls(key=key, size=size, crc32c=crc, pack=pack, offset=_int(item[4], what, "offset"))


MAX_PROCESSES = 1 << 20
"""The most processes a record may name: readers and copies iterate over them."""


def _processes(value: Any, what: str) -> int:
    count = _int(value, what, "num_processes")
    if not 1 <= count <= MAX_PROCESSES:
        raise CorruptCheckpointError(f"{what}: num_processes {count} is not in 1..{MAX_PROCESSES}")
    return count


def _int(value: Any, what: str, name: str) -> int:
    """A non-negative int field of a record."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CorruptCheckpointError(f"{what}: {name} is not a non-negative integer: {value!r:.80}")
    return value


PLAIN_CODECS = "bytes+crc32c"
"""A manifest part's ``codecs``: its arrays' chunks are raw little-endian bytes || crc32c."""


@dataclass(frozen=True, kw_only=True)
class ManifestPart:
    """The chunks one process wrote for one step."""

    step: int
    process: int
    num_processes: int
    arrays: Mapping[str, tuple[ChunkRecord, ...]]

    layout: str = "plain"
    """``"plain"`` (one object per chunk) or ``"packed"`` (chunks inside pack objects)."""
    packs: Mapping[str, int] = field(default_factory=dict)
    """Packed: every pack object this process wrote (name relative to the attempt) and its size."""
    plain_codecs: bool = False
    """Every array of this part is stored with jaxckpt's own codec chain (zarr ``bytes``,
    little-endian, then ``crc32c``), so a restore need not read its ``zarr.json`` to know
    that its chunks are raw bytes plus a CRC32C trailer. Written as ``"codecs":
    "bytes+crc32c"`` by saves since this field exists; a part without it (older saves,
    ``jaxckpt cp --compress``) has each array's ``zarr.json`` read instead."""
    process_state: Mapping[str, Any] | None = None
    """This process's ``save(process_state=...)`` as a record (see ``_procstate``); readers
    that predate it ignore the field."""
    version: int = field(default=FORMAT_VERSION, compare=False)
    """The format version it was read at (a part written now is at ``FORMAT_VERSION``):
    from ``SELF_CHECKED_VERSION`` on it carries its own CRC32C."""

    def __post_init__(self) -> None:
        format_named(self.layout)  # ValueError: no such format

    @property
    def format(self) -> DataFormat:
        """This part's data format (:mod:`jaxckpt.formats`)."""
        return format_named(self.layout)

    def lists_object(self, chunk: ChunkRecord) -> bool:
        """Whether the object holding ``chunk`` is one this part says it wrote."""
        return chunk.pack is None or chunk.pack in self.packs

    @property
    def objects(self) -> int:
        """The data objects this part wrote: its packs and its chunks stored whole."""
        return len(self.packs) + sum(c.pack is None for cs in self.arrays.values() for c in cs)

    def to_bytes(self) -> bytes:
        arrays = {name: [c.encode() for c in chunks] for name, chunks in self.arrays.items()}
        body: dict[str, Any] = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": self.step,
            "process": self.process,
            "num_processes": self.num_processes,
            "arrays": arrays,
        }
        if self.layout == "packed":
            body.update(layout=self.layout, packs=dict(self.packs))
        if self.plain_codecs:
            body["codecs"] = PLAIN_CODECS
        if self.process_state is not None:
            body["process_state"] = dict(self.process_state)
        body["part_crc32c"] = crc32c(dumps(body))
        return dumps(body)

    @classmethod
    def from_bytes(cls, data: bytes, what: str, *, self_checked: bool = False) -> ManifestPart:
        """Parses and checks a part (every field; its own CRC32C from version 4 on).

        Args:
          self_checked: the part must check itself (version 4 or newer): the marker
            that covers it holds no digest of it.

        Raises:
          CorruptCheckpointError: malformed, or it fails its own checksum.
          UnsupportedFormatError: a newer format version.
        """
        obj = _loads(data, what)
        _check_version(obj, what, newest=max(FORMAT_VERSION, PACKED_VERSION))
        if obj["version"] >= SELF_CHECKED_VERSION:
            stored = obj.pop("part_crc32c", None)
            if stored != crc32c(dumps(obj)):
                raise CorruptCheckpointError(f"{what}: manifest part checksum mismatch")
        elif self_checked:
            raise CorruptCheckpointError(
                f"{what}: a part of format version {obj['version']} has no checksum of its "
                "own, and the marker lists none"
            )
        _require(obj, what, "step", "process", "num_processes", "arrays")
        layout = obj.get("layout", "plain")
        if layout not in LAYOUTS:
            raise CorruptCheckpointError(f"{what}: unknown layout {layout!r:.80}")
        arrays_obj, packs_obj = obj["arrays"], obj.get("packs", {})
        if not isinstance(arrays_obj, dict) or not isinstance(packs_obj, dict):
            raise CorruptCheckpointError(f"{what}: arrays and packs must be JSON objects")
        packs = {
            checked_name(k, "pack", what): _int(v, what, f"size of {k}")
            for k, v in packs_obj.items()
        }
        arrays: dict[str, tuple[ChunkRecord, ...]] = {}
        for name, chunks in arrays_obj.items():
            checked_name(name, "array", what)
            if not isinstance(chunks, list):
                raise CorruptCheckpointError(f"{what}: chunks of {name} are not a list")
            arrays[name] = tuple(ChunkRecord.decode(c, what) for c in chunks)
            for c in arrays[name]:
                if c.pack is not None and (
                    c.pack not in packs or c.offset + c.size > packs[c.pack]
                ):
                    raise CorruptCheckpointError(
                        f"{what}: chunk {c.key} of {name} lies outside the packs the part lists "
                        f"({c.pack} at byte {c.offset}, {c.size} bytes)"
                    )
        state = obj.get("process_state")
        if state is not None and not isinstance(state, dict):
            raise CorruptCheckpointError(f"{what}: malformed process_state")
        return cls(
            step=_int(obj["step"], what, "step"),
            process=_int(obj["process"], what, "process"),
            num_processes=_processes(obj["num_processes"], what),
            arrays=arrays,
            layout=layout,
            packs=packs,
            plain_codecs=obj.get("codecs") == PLAIN_CODECS,
            process_state=state,
            version=obj["version"],
        )

    @property
    def nbytes(self) -> int:
        return sum(c.size for chunks in self.arrays.values() for c in chunks)


@dataclass(frozen=True, kw_only=True)
class CommitMarker:
    """The record whose presence makes a step visible.

    Written last, create-only, after every file it lists is durable.
    """

    step: int
    time: float
    num_processes: int
    files: Mapping[str, FileDigest]
    nbytes: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    keep: bool = False
    attempt: str | None = None
    epoch: int = 0
    version: int = FORMAT_VERSION
    parts: tuple[str, ...] | None = None
    """Version 4: the manifest parts the marker covers, when not every process's own part
    (a host's local commit: its part and its held part). ``files`` holds the digests of
    only the records that do not check themselves (the tree record, older parts)."""
    parts_crc32c: int | None = None
    """Version 4: CRC32C of the covered parts' ``[name, size, crc32c]`` list, in
    :meth:`manifest_names` order (a reader of every part can check the set; a reader of
    a few checks each part's own CRC32C)."""

    def manifest_names(self) -> list[str]:
        """Every manifest part this marker covers (held parts included), in order."""
        if self.version < SELF_CHECKED_VERSION:
            return sorted(n for n in self.files if n.startswith("manifest/"))
        if self.parts is not None:
            return list(self.parts)
        return [f"manifest/{p}.json" for p in range(self.num_processes)]

    def covers(self, name: str) -> bool:
        """Whether manifest part ``name`` is one this marker covers (without listing them)."""
        if self.version < SELF_CHECKED_VERSION or self.parts is not None:
            return name in self.manifest_names()
        process = name.removeprefix("manifest/").removesuffix(".json")
        return (
            process.isdigit()
            and f"manifest/{int(process)}.json" == name
            and (int(process) < self.num_processes)
        )

    @property
    def every_process(self) -> bool:
        """The marker covers every process's own part (a shared tier's commit)."""
        if self.version >= SELF_CHECKED_VERSION:
            return self.parts is None
        names = [n for n in self.files if n.startswith("manifest/")]
        if self.num_processes > len(names):  # never iterate a count read from storage
            return False
        return all(f"manifest/{p}.json" in self.files for p in range(self.num_processes))

    @property
    def location(self) -> StepLocation:
        """Where the attempt this marker vouches for keeps its data."""
        return StepLocation.committed(self.step, self.attempt, self.version)

    @property
    def key(self) -> str:
        """This marker's own key under ``commits/``."""
        return marker_key(self.step, None if self.attempt is None else self.epoch)

    def _body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "format": FORMAT,
            "version": self.version,
            "step": self.step,
            "time": self.time,
            "num_processes": self.num_processes,
            "files": {k: [d.size, d.crc32c] for k, d in sorted(self.files.items())},
            "nbytes": self.nbytes,
            "metrics": dict(self.metrics),
            "keep": self.keep,
        }
        if self.version >= 2:
            body["attempt"] = self.attempt
            body["epoch"] = self.epoch
        if self.version >= SELF_CHECKED_VERSION:
            if self.parts_crc32c is not None:
                body["parts_crc32c"] = self.parts_crc32c
            if self.parts is not None:
                body["parts"] = list(self.parts)
        return body

    def to_bytes(self) -> bytes:
        body = self._body()
        body["marker_crc32c"] = crc32c(dumps(body))
        return dumps(body)

    @classmethod
    def from_bytes(cls, data: bytes, what: str) -> CommitMarker:
        """Parses and validates a marker.

        Raises:
          CorruptCheckpointError: torn, truncated or altered marker.
          UnsupportedFormatError: written by a newer format version.
        """
        obj = _loads(data, what)
        _check_version(obj, what)
        stored = obj.pop("marker_crc32c", None)
        if stored != crc32c(dumps(obj)):
            raise CorruptCheckpointError(f"{what}: marker checksum mismatch")
        _require(obj, what, "step", "time", "num_processes", "files", "nbytes")
        attempt = obj.get("attempt")
        if obj["version"] >= 2 and (not isinstance(attempt, str) or not parse_attempt(attempt)):
            raise CorruptCheckpointError(f"{what}: names no valid save attempt")
        metrics, keep, when = obj.get("metrics", {}), obj.get("keep", False), obj["time"]
        if not isinstance(metrics, dict) or not isinstance(keep, bool):
            raise CorruptCheckpointError(f"{what}: malformed metrics or keep field")
        if isinstance(when, bool) or not isinstance(when, int | float):
            raise CorruptCheckpointError(f"{what}: time is not a number")
        parts, parts_crc = None, None
        if obj["version"] >= SELF_CHECKED_VERSION:
            if "parts_crc32c" in obj:
                parts_crc = _int(obj["parts_crc32c"], what, "parts_crc32c")
            raw_parts = obj.get("parts")
            if raw_parts is not None:
                if not isinstance(raw_parts, list) or len(set(map(str, raw_parts))) != len(
                    raw_parts
                ):
                    raise CorruptCheckpointError(f"{what}: parts is not a list of names")
                parts = tuple(checked_name(n, "file", what) for n in raw_parts)
                if any(not n.startswith("manifest/") for n in parts):
                    raise CorruptCheckpointError(f"{what}: parts names a file that is no part")
        return cls(
            step=_int(obj["step"], what, "step"),
            time=when,
            num_processes=_processes(obj["num_processes"], what),
            files=_digests(obj["files"], "file", what),
            nbytes=_int(obj["nbytes"], what, "nbytes"),
            metrics=metrics,
            keep=keep,
            attempt=attempt if obj["version"] >= 2 else None,
            epoch=_int(obj.get("epoch", 0), what, "epoch"),
            version=obj["version"],
            parts=parts,
            parts_crc32c=parts_crc,
        )


def _digests(files: Any, kind: str, what: str) -> dict[str, FileDigest]:
    """A record's ``files`` (``{name: [size, crc32c]}``), every name a safe one of ``kind``."""
    if not isinstance(files, dict):
        raise CorruptCheckpointError(f"{what}: files is not a JSON object")
    out = {}
    for name, digest in files.items():
        checked_name(name, kind, what)
        if not isinstance(digest, list) or len(digest) != 2:
            raise CorruptCheckpointError(f"{what}: malformed digest of {name}: {digest!r:.80}")
        out[name] = FileDigest(
            size=_int(digest[0], what, "size"), crc32c=_int(digest[1], what, "crc32c")
        )
    return out


def _loads(data: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{what} is not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{what} is not a JSON object")
    return obj


def _require(obj: Mapping[str, Any], what: str, *fields: str) -> None:
    missing = [f for f in fields if f not in obj]
    if missing:
        raise CorruptCheckpointError(f"{what}: no {', '.join(missing)} field")


def load_json_record(data: bytes, what: str) -> dict[str, Any]:
    """Parses a versioned JSON record (tree record, root record, pending record)."""
    obj = _loads(data, what)
    _check_version(obj, what)
    return obj


def json_record(**fields: Any) -> bytes:
    """Encodes a versioned JSON record."""
    return dumps({"format": FORMAT, "version": FORMAT_VERSION, **fields})


def path_text(parts: Sequence[Sequence[Any]]) -> str:
    """Readable form of an encoded tree path, the same text as ``jax.tree_util.keystr``.

    >>> path_text([["d", "params"], ["a", "kernel"], ["s", 0]])
    "['params'].kernel[0]"
    """
    text = ""
    for kind, key in parts:
        text += f".{key}" if kind == "a" else f"[{key!r}]" if kind == "d" else f"[{key}]"
    return text or "<root>"


@dataclass(frozen=True, kw_only=True)
class ReplicaIndex:
    """What a replica of one process's part holds (``replicas/<step>/<p>/<attempt>.json``
    on a holder's local tier, see ``_peertier``): every file's size and CRC32C and what
    its owner's local marker carries; written last, so a replica with one is complete."""

    step: int
    process: int
    attempt: str
    num_processes: int
    files: dict[str, FileDigest]
    metrics: dict[str, float] = field(default_factory=dict)
    keep: bool = False
    promote: str | None = None
    """The promotion request the owner wrote with the step (its JSON), if it was chosen."""

    def _body(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "process": self.process,
            "attempt": self.attempt,
            "num_processes": self.num_processes,
            "files": {n: [d.size, d.crc32c] for n, d in sorted(self.files.items())},
            "metrics": self.metrics,
            "keep": self.keep,
            "promote": self.promote,
        }

    def to_bytes(self) -> bytes:
        body = self._body()
        return json_record(replica=body, crc32c=crc32c(dumps(body)))

    @classmethod
    def from_bytes(cls, data: bytes, what: str) -> ReplicaIndex:
        """Parses and checks an index.

        Raises:
          CorruptCheckpointError: not an index, or it fails its own CRC32C.
        """
        obj = load_json_record(data, what)
        body = obj.get("replica")
        if not isinstance(body, dict) or crc32c(dumps(body)) != obj.get("crc32c"):
            raise CorruptCheckpointError(f"{what} is damaged (it fails its checksum)")
        try:
            attempt = body["attempt"]
            if not isinstance(attempt, str) or parse_attempt(attempt) is None:
                raise CorruptCheckpointError(f"{what}: names no valid save attempt")
            return cls(
                step=_int(body["step"], what, "step"),
                process=_int(body["process"], what, "process"),
                attempt=attempt,
                num_processes=_processes(body["num_processes"], what),
                files=_digests(body["files"], "key", what),
                metrics=body["metrics"],
                keep=body["keep"],
                promote=body.get("promote"),
            )
        except (KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{what}: malformed replica index ({e!r})") from e
