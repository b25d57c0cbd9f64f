"""Where everything lives under a root: the only module that builds storage keys.

Format version 4 (``FORMAT_VERSION`` in ``_step``) keeps every save attempt
under its own keys, so two writers never share a key, and spreads the
objects of a step (its processes' packs and manifest parts) over 32 of a fixed set
of 256 hashed prefixes that every step reuses, the hash ahead of the step::

    jaxckpt.json                               root record (format, version)
    writers/<epoch>.json                       a writer's epoch, create-only (see _fence)
    pending/<step>/<attempt>.json              intent: a save or delete of that attempt
    attempts/<step>/<attempt>/tree.json        the tree record
    attempts/<step>/<attempt>/zarr.json, arrays/zarr.json   zarr v3 group records
    attempts/<step>/<attempt>/arrays/...       zarr v3 arrays (one per array leaf; plain layout)
    data/<hh>/<step>.<attempt>/packs/<p>.<k>.bin   packed layout: process <p>'s pack objects
    data/<hh>/<step>.<attempt>/manifest/<p>.json   chunks written by process <p>
    data/<hh>/<step>.<attempt>/manifest/<p>.held.json  local tier only: replicas <p>
                                               keeps for its own restores (see _select)
    commits/<step:012d>.e<epoch>.json          the commit marker; names its attempt
                                               (steps >= 10**12: w<step:019d>.e<epoch>.json)
    commits/latest.e<epoch>                    the newest step <epoch> is committing (a hint)
    promote/<step:012d>.json                   local tier only: a request to promote the step
                                               to the durable root (see _promote)
    tier.json                                  local tier only: the durable root it serves
                                               (see _owner)
    replicas/<step>/<p>/<attempt>/<name>       local tier with local_replicas > 1: a replica
                                               of process <p>'s part (its objects by their
                                               names in the attempt; see _peers)
    replicas/<step>/<p>/<attempt>.json         its index (every file's size and CRC32C),
                                               written last: the replica is complete
    publish/<step:012d>.due.json               durable root: the step is to be published
                                               (written at its commit, before publishing)
    publish/<step:012d>.json                   durable root: where the step was published
                                               (after the destination's index; see _publish)
    ledger/<epoch>/<process>/<seq>.json        the run ledger (durable root only): each
                                               process's events, batched (the keys are
                                               built and checked by jaxckpt.ledger._events)

**Hashed prefixes** (:func:`spread_bucket`): ``<hh>`` is two hex digits of a hash of
(step, attempt, slot), one of the attempt's :data:`SPREAD_SLOTS` (32) slots: process
*p*'s pack *k* goes to slot (*p* + *k*) mod 32 and its manifest part (and held part)
to *p* mod 32, so the packs every process uploads at once fill every slot evenly.
Readers compute every key from names they already know (the marker names the attempt
and its parts, a part names its packs): nothing is listed to read. Whatever the
number of processes, an attempt's objects lie under its own prefix and 32 hashed
ones (:meth:`StepLocation.buckets`): a commit, a delete or a garbage collection lists
33 prefixes, the same at 1 process as at 8,192. A store's per-prefix request rate
(S3: 3,500 writes and 5,500 reads per second) then applies 32 times over to every
step: its slots are 32 distinct prefixes of the 256, 8 apart from a hashed base, so a
step lands in prefixes that earlier steps warmed.
Plain-layout arrays stay under ``attempts/``: a zarr v3 hierarchy keeps every array
under its group (zarr-python opens ``arrays/`` as one group), and TensorStore writes
an array's chunks under one kvstore path.

Format versions 2 and 3 (every object of an attempt under
``attempts/<step>/<attempt>/``: ``packs/<p>.<k>.bin``, ``manifest/<p>.json``) are
still read: a marker's version says which keys its step uses
(:meth:`StepLocation.committed`). Format version 1 (roots written before writer
fencing) too::

    pending/<step>.json
    steps/<step>/{tree.json,manifest/<p>.json,arrays/...}
    commits/<step>.json

An attempt id is ``e<epoch>-<unix seconds>-<random hex>``: the epoch and the
start time can be read from any key under the attempt, so garbage collection
can tell a fenced or stale attempt from a live one without reading anything.
Imports neither jax nor numpy.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from jaxckpt.records._writebudget import MAX_MERGED_PACK_BYTES, budget_packs, merged_pack_limit

ROOT_RECORD = "jaxckpt.json"
TREE_FILE = "tree.json"
COMMITS = "commits/"
PENDING = "pending/"
WRITERS = "writers/"
ATTEMPTS = "attempts/"
LEGACY_STEPS = "steps/"
PROMOTE = "promote/"
PUBLISH = "publish/"  # published weights: due and done records (see lifecycle._publish)
DATA = "data/"  # format 4: per-process objects under hashed prefixes (see spread_bucket)
REPLICAS = "replicas/"  # local tier only: other processes' parts (see _peertier)
TIER_RECORD = "tier.json"  # local tier only: the durable root it serves (see _owner)

_ATTEMPT = re.compile(r"e(\d+)-(\d+)-([0-9a-f]+)")
_MARKER_V2 = re.compile(r"(\d{12}|w\d{19})\.e(\d+)\.json")
STEP_DIGITS = 12  # format-2 marker keys of steps below 10**12 sort by step
WIDE_STEP_DIGITS = 19  # ... and of larger steps, after a "w" (sorting after every digit)
MAX_STEP = 2**63 - 1
"""The largest step id (a signed 64-bit integer): ``save`` refuses larger ones."""
_V1_JSON = re.compile(r"(\d+)\.json")
_RECEIPT = re.compile(r"(\d+)\.done")


def new_attempt(epoch: int, now: float | None = None) -> str:
    """A fresh, unique attempt id for a save in ``epoch``."""
    started = int(time.time() if now is None else now)
    return f"e{epoch}-{started}-{secrets.token_hex(6)}"


def parse_attempt(attempt: str) -> tuple[int, float] | None:
    """``(epoch, start time)`` of an attempt id, or None if it is not one."""
    m = _ATTEMPT.fullmatch(attempt)
    return (int(m.group(1)), float(m.group(2))) if m else None


def manifest_name(process: int) -> str:
    """The name, relative to a step's prefix, of process ``process``'s manifest part."""
    return f"manifest/{process}.json"


def held_manifest_name(process: int) -> str:
    """A local tier only: the part listing chunks process ``process`` holds for its own
    restores whose ``replica_id == 0`` copy is another process's (never promoted)."""
    return f"manifest/{process}.held.json"


def is_held_manifest_name(name: str) -> bool:
    return name.startswith("manifest/") and name.endswith(".held.json")


def is_manifest_name(name: str) -> bool:
    return name.startswith("manifest/")


PACK_UPLOADS = 16
"""The packed layout: the default of ``CheckpointOptions.objects_in_flight``, the pack
objects one process uploads (and the spans one restore reads) at once. Enough to fill
a 10 Gb/s link at S3's ~85 MB/s per connection."""
MAX_PACKS = PACK_UPLOADS
"""The packed layout: the most pack objects one process writes for one step, unless
``CheckpointOptions.max_object_bytes`` needs more (readers take every pack's name from
the manifest, so the count is not part of the format)."""
MIN_PACK_BYTES = 4 << 20
"""The packed layout: packs smaller than this are not split further (a 4 MiB object takes
about one round trip more than its transfer at 25 MB/s and 20 ms)."""
PACK_ALIGNMENT = 64
"""The packed layout: every chunk starts at a multiple of this in its pack (zero padding
between chunks), so a chunk read inside an aligned buffer is aligned too (XLA's CPU client
then aliases it instead of copying)."""


def pack_count(
    nbytes: float,
    *,
    min_pack_bytes: int = MIN_PACK_BYTES,
    max_object_bytes: int | None = None,
    max_packs: int = MAX_PACKS,
    processes: int = 1,
    writes_per_s: float | None = None,
) -> int:
    """How many pack objects a process writes for ``nbytes`` of stored chunks.

    Enough for ``max_packs`` uploads in flight at once, none under
    ``min_pack_bytes``, and as many more as ``max_object_bytes`` needs, so a process's
    objects per step are ``max_packs`` plus its bytes over the cap, at most:

    >>> pack_count(0), pack_count(1), pack_count(10 << 20), pack_count(10 << 30)
    (0, 1, 3, 16)
    >>> pack_count(10 << 30, max_object_bytes=64 << 20)
    160

    With the store's ``writes_per_s`` (the whole job's budget,
    :func:`~jaxckpt.records._writebudget.store_writes_per_s`) and the job's ``processes``,
    fewer where the job's packs would take the store longer than the bytes take the link
    (:func:`~jaxckpt.records._writebudget.budget_packs`; larger packs, each at most
    ``(max_packs + 1) × max_object_bytes``). A 70B state with Adam (1.1 TB) at 1 to
    8,192 processes, without a budget, on a new GCS bucket (1,000 writes/s), and on S3
    over 32 prefixes:

    >>> def packs(writes_per_s):
    ...     return [pack_count(1.1e12 / n, max_object_bytes=64 << 20, processes=n,
    ...                        writes_per_s=writes_per_s) for n in (1, 16, 1024, 8192)]
    >>> packs(None), packs(1000), packs(32 * 3500)
    ([16392, 1025, 17, 16], [16392, 1025, 4, 1], [16392, 1025, 17, 5])
    """
    if nbytes <= 0:
        return 0
    count = min(max_packs, max(1, math.ceil(nbytes / min_pack_bytes)))
    if max_object_bytes is not None:
        count = max(count, math.ceil(nbytes / max_object_bytes))
    if writes_per_s is None:
        return int(count)
    largest = MAX_MERGED_PACK_BYTES
    if max_object_bytes is not None:
        largest = merged_pack_limit(max_object_bytes, max_packs)
    fewest = min(count, max(1, math.ceil(nbytes / largest)))
    return budget_packs(
        nbytes,
        processes=processes,
        writes_per_s=writes_per_s,
        uploads=max_packs,
        max_object_bytes=max_object_bytes,
        fewest=fewest,
        most=int(count),
    )


def pack_name(process: int, index: int) -> str:
    """The name, relative to a step's prefix, of process ``process``'s pack object ``index``."""
    return f"packs/{process}.{index}.bin"


SPREAD_VERSION = 4
"""The first format version whose per-process objects lie under hashed prefixes."""
SPREAD_BUCKETS = 256
"""The hashed prefixes ``data/00/`` .. ``data/ff/`` every step shares."""
SPREAD_SLOTS = 32
"""How many of the hashed prefixes one attempt's objects spread over, whatever the
number of processes (a lister visits these and the attempt's own prefix)."""
_PACK_NAME = re.compile(r"packs/(\d+)\.(\d+)\.bin")
_PART_NAME = re.compile(r"manifest/(\d+)(?:\.held)?\.json")
_SPREAD_DIR = re.compile(r"([0-9a-f]{2})/(\d+)\.(e\d+-\d+-[0-9a-f]+)/")


def spread_slot(name: str) -> int | None:
    """The slot of an object of an attempt that format 4 spreads (a pack, a manifest
    part, a held part), by its name in the attempt; None for the others.

    >>> spread_slot("packs/3.30.bin"), spread_slot("manifest/35.json"), spread_slot("tree.json")
    (1, 3, None)
    """
    m = _PACK_NAME.fullmatch(name)
    if m:
        return (int(m.group(1)) + int(m.group(2))) % SPREAD_SLOTS
    m = _PART_NAME.fullmatch(name)
    return int(m.group(1)) % SPREAD_SLOTS if m else None


@functools.lru_cache(maxsize=1 << 14)  # a restore asks once per chunk record
def spread_bucket(step: int, attempt: str, slot: int) -> str:
    """The hashed prefix (two hex digits) of one slot of an attempt.

    A fixed function of names every reader knows: a base from BLAKE2b of
    ``step/attempt``, and the slots 8 apart from it, so an attempt's 32 slots lie under
    32 distinct prefixes of the 256, and successive steps rotate through them:

    >>> [spread_bucket(7, "e1-1733000000-0123456789ab", s) for s in (0, 1, 31)]
    ['2e', '36', '26']
    """
    base = hashlib.blake2b(f"{step}/{attempt}".encode(), digest_size=1).digest()[0]
    return f"{(base + slot * (SPREAD_BUCKETS // SPREAD_SLOTS)) % SPREAD_BUCKETS:02x}"


@dataclass(frozen=True)
class StepLocation:
    """Where one save attempt of one step keeps its data and records.

    ``attempt`` is None for a format-1 step (``steps/<step>/``). ``spread``: its
    packs and manifest parts lie under hashed prefixes (format 4; a location built
    for a new attempt is, one from an older marker is not: :meth:`committed`).
    ``sealed``: a committed attempt, found from its marker: nobody writes into it
    any more. Neither takes part in equality: an attempt is one attempt however it
    was found.
    """

    step: int
    attempt: str | None = None
    spread: bool = field(default=True, compare=False)
    sealed: bool = field(default=False, compare=False)

    @classmethod
    def committed(cls, step: int, attempt: str | None, version: int) -> StepLocation:
        """The location a marker of format ``version`` names."""
        return cls(step, attempt, spread=version >= SPREAD_VERSION, sealed=True)

    @property
    def is_spread(self) -> bool:
        return self.spread and self.attempt is not None

    @property
    def prefix(self) -> str:
        if self.attempt is None:
            return f"{LEGACY_STEPS}{self.step}/"
        return f"{ATTEMPTS}{self.step}/{self.attempt}/"

    @property
    def arrays_prefix(self) -> str:
        return self.prefix + "arrays/"

    def array_prefix(self, name: str) -> str:
        """The prefix of one zarr array (a leaf's ``name``)."""
        return f"{self.arrays_prefix}{name}/"

    @property
    def tree_key(self) -> str:
        return self.prefix + TREE_FILE

    def key(self, name: str) -> str:
        """An object of the attempt by its name in its records (``tree.json``,
        ``manifest/0.json``, ``packs/0.3.bin``): format 4 spreads packs and parts."""
        slot = spread_slot(name) if self.is_spread else None
        if slot is None:
            return self.prefix + name
        return self.bucket_prefix(spread_bucket(self.step, str(self.attempt), slot)) + name

    def bucket_prefix(self, bucket: str) -> str:
        """This attempt's prefix under the hashed prefix ``bucket`` (two hex digits)."""
        return f"{DATA}{bucket}/{self.step}.{self.attempt}/"

    def buckets(self, names: Iterable[str] | None = None) -> list[str]:
        """The hashed prefixes this attempt's spread objects lie under, sorted: those of
        its :data:`SPREAD_SLOTS` slots (fewer where two share one), or of ``names``."""
        if not self.is_spread:
            return []
        attempt = str(self.attempt)
        if names is None:
            slots: set[int] = set(range(SPREAD_SLOTS))
        else:
            slots = {slot for n in names if (slot := spread_slot(n)) is not None}
        return sorted({spread_bucket(self.step, attempt, s) for s in slots})

    def name_of(self, key: str) -> str | None:
        """The name in this attempt of one of its keys (the inverse of :meth:`key`)."""
        if key.startswith(self.prefix):
            return key[len(self.prefix) :]
        if self.is_spread and key.startswith(DATA):
            m = _SPREAD_DIR.match(key, len(DATA))
            if m and (int(m.group(2)), m.group(3)) == (self.step, self.attempt):
                name = key[m.end() :]
                if self.key(name) == key:
                    return name
        return None

    @property
    def pending_key(self) -> str:
        if self.attempt is None:
            return f"{PENDING}{self.step}.json"
        return f"{PENDING}{self.step}/{self.attempt}.json"

    @property
    def epoch(self) -> int:
        """The epoch that wrote this attempt (0 for format 1)."""
        parsed = parse_attempt(self.attempt) if self.attempt else None
        return parsed[0] if parsed else 0

    def __str__(self) -> str:
        return f"step {self.step}" + (f" (attempt {self.attempt})" if self.attempt else "")


@dataclass(frozen=True, order=True)
class MarkerRef:
    """A commit marker known from its key alone: the step and the epoch that wrote it."""

    step: int
    epoch: int
    key: str


def check_step(step: object) -> int:
    """``step`` if it is a valid step id: an int from 0 to :data:`MAX_STEP`.

    Raises:
      ValueError: anything else (a bool, a float, a negative or too large int).
    """
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be a non-negative int (at most 2**63 - 1), got {step!r}")
    return step


def marker_step_name(step: int) -> str:
    """How a format-2 marker key spells ``step``: names sort in step order.

    Steps below 10**12 have 12 digits (as format 2 always wrote them); larger
    ones (such as millisecond timestamps) ``w`` and 19 digits.

    >>> marker_step_name(42), marker_step_name(1_733_000_000_000)
    ('000000000042', 'w0000001733000000000')
    """
    if step < 10**STEP_DIGITS:
        return f"{step:0{STEP_DIGITS}d}"
    return f"w{check_step(step):0{WIDE_STEP_DIGITS}d}"


def marker_key(step: int, epoch: int | None) -> str:
    """The marker key of ``step`` (``epoch`` None: the format-1 key)."""
    if epoch is None:
        return f"{COMMITS}{step}.json"
    return f"{COMMITS}{marker_step_name(step)}.e{epoch}.json"


def latest_hint_key(epoch: int) -> str:
    """The key of ``epoch``'s hint: the newest step its writer began to commit."""
    return f"{COMMITS}latest.e{epoch}"


def is_latest_hint(key: str) -> bool:
    return key.startswith(f"{COMMITS}latest.e")


def parse_marker_key(key: str) -> MarkerRef | None:
    """The marker a ``commits/`` key names (format 1: epoch 0), or None."""
    name = key[len(COMMITS) :] if key.startswith(COMMITS) else ""
    m = _MARKER_V2.fullmatch(name)
    if m:
        return MarkerRef(step=int(m.group(1).lstrip("w")), epoch=int(m.group(2)), key=key)
    m = _V1_JSON.fullmatch(name)
    return MarkerRef(step=int(m.group(1)), epoch=0, key=key) if m else None


def marker_refs_of(keys: Iterable[str]) -> list[MarkerRef]:
    """The markers among ``commits/`` keys (hints and temp files dropped), sorted."""
    return sorted(r for r in map(parse_marker_key, keys) if r is not None)


def parse_pending_key(key: str) -> StepLocation | None:
    """The attempt a ``pending/`` key announces, or None."""
    name = key[len(PENDING) :] if key.startswith(PENDING) else ""
    m = _V1_JSON.fullmatch(name)
    if m:
        return StepLocation(int(m.group(1)))
    step, _, rest = name.partition("/")
    attempt = rest[: -len(".json")] if rest.endswith(".json") else ""
    if step.isdigit() and parse_attempt(attempt):
        return StepLocation(int(step), attempt)
    return None


def parse_data_key(key: str) -> StepLocation | None:
    """The attempt (or format-1 step) a data key belongs to, or None."""
    if key.startswith(DATA):
        m = _SPREAD_DIR.match(key, len(DATA))
        if m and parse_attempt(m.group(3)):
            return StepLocation(int(m.group(2)), m.group(3))
    elif key.startswith(ATTEMPTS):
        parts = key[len(ATTEMPTS) :].split("/", 2)
        if len(parts) >= 2 and parts[0].isdigit() and parse_attempt(parts[1]):
            return StepLocation(int(parts[0]), parts[1])
    elif key.startswith(LEGACY_STEPS):
        step = key[len(LEGACY_STEPS) :].split("/", 1)[0]
        if step.isdigit():
            return StepLocation(int(step))
    return None


def epoch_key(epoch: int) -> str:
    return f"{WRITERS}{epoch}.json"


def parse_epoch_key(key: str) -> int | None:
    m = _V1_JSON.fullmatch(key[len(WRITERS) :]) if key.startswith(WRITERS) else None
    return int(m.group(1)) if m else None


TEMP_GRACE_S = 600.0  # a create-only write's temp file lives for milliseconds
_TEMP_STAMP = re.compile(r"\.(\d+)-[0-9a-f]+\.tmp")


def is_temp_key(key: str) -> bool:
    """A create-only write's hidden temp file (local roots), live or left by a crash."""
    return key.rsplit("/", 1)[-1].startswith(".")


def is_stale_temp_key(key: str, now: float, grace_s: float = TEMP_GRACE_S) -> bool:
    """A temp file old enough to be a crashed write's (never one a live write still needs)."""
    if not is_temp_key(key):
        return False
    m = _TEMP_STAMP.search(key.rsplit("/", 1)[-1])
    return m is None or now - int(m.group(1)) >= grace_s


def promote_key(step: int) -> str:
    """The key of a local tier's request to promote ``step`` to the durable root."""
    return f"{PROMOTE}{step:0{STEP_DIGITS}d}.json"


def parse_promote_key(key: str) -> int | None:
    """The step a ``promote/`` key names, or None."""
    name = key[len(PROMOTE) :] if key.startswith(PROMOTE) else ""
    m = _V1_JSON.fullmatch(name)
    return int(m.group(1)) if m else None


def receipt_key(step: int) -> str:
    """The key of a promoter's receipt for ``step``: durable, its request withdrawn
    (beside the requests, which readers of requests skip: not a ``.json``)."""
    return f"{PROMOTE}{step:0{STEP_DIGITS}d}.done"


def parse_receipt_key(key: str) -> int | None:
    """The step a receipt key names, or None."""
    name = key[len(PROMOTE) :] if key.startswith(PROMOTE) else ""
    m = _RECEIPT.fullmatch(name)
    return int(m.group(1)) if m else None


_PUBLISH = re.compile(r"(\d{12,19})(\.due)?\.json")


def publish_key(step: int, *, due: bool = False) -> str:
    """The key of ``step``'s publish record: ``due`` (to publish) or done (published).

    >>> publish_key(7, due=True), publish_key(7)
    ('publish/000000000007.due.json', 'publish/000000000007.json')
    """
    return f"{PUBLISH}{step:0{STEP_DIGITS}d}{'.due' if due else ''}.json"


def parse_publish_key(key: str) -> tuple[int, bool] | None:
    """``(step, due)`` of a ``publish/`` key, or None for any other key.

    >>> parse_publish_key("publish/000000000007.due.json"), parse_publish_key("publish/x")
    ((7, True), None)
    """
    name = key[len(PUBLISH) :] if key.startswith(PUBLISH) else ""
    m = _PUBLISH.fullmatch(name)
    return None if m is None else (int(m.group(1)), m.group(2) is not None)


def replica_prefix(step: int, process: int | None = None) -> str:
    """The prefix of ``step``'s replicas on a local tier (of one source ``process``'s)."""
    base = f"{REPLICAS}{marker_step_name(step)}/"
    return base if process is None else f"{base}{process}/"


def replica_index_key(step: int, process: int, attempt: str) -> str:
    """The index of the replica of ``process``'s part of ``step`` (attempt ``attempt``)."""
    return f"{replica_prefix(step, process)}{attempt}.json"


def parse_replica_index_key(key: str) -> tuple[int, int, str] | None:
    """``(step, process, attempt)`` of a replica index key, or None."""
    parts = key[len(REPLICAS) :].split("/") if key.startswith(REPLICAS) else []
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].endswith(".json"):
        return None
    step, attempt = parts[0].lstrip("w"), parts[2][: -len(".json")]
    if not step.isdigit() or parse_attempt(attempt) is None:
        return None
    return int(step), int(parts[1]), attempt


def replica_holdings(keys: Iterable[str]) -> list[tuple[int, int, str]]:
    """The complete replicas (with an index) among ``replicas/`` keys: (step, process,
    attempt), sorted."""
    return sorted(h for h in map(parse_replica_index_key, keys) if h is not None)


def parse_replica_step(key: str) -> int | None:
    """The step a ``replicas/`` key belongs to, or None."""
    name = key[len(REPLICAS) :].split("/", 1)[0] if key.startswith(REPLICAS) else ""
    digits = name.lstrip("w")
    return int(digits) if digits.isdigit() else None
