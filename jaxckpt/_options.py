"""The one options object of a :class:`jaxckpt.CheckpointManager`."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jaxckpt.formats import FORMATS
from jaxckpt.formats import NAMES_TEXT as FORMAT_NAMES
from jaxckpt.records import TRAILER_BYTES
from jaxckpt.storage import ObjectStoreOptions, parse_root

if TYPE_CHECKING:
    from jaxckpt.policy import HealthPolicy, RetentionPolicy, SavePolicy


def _finite_metrics() -> HealthPolicy:
    from jaxckpt.policy import FiniteMetrics

    return FiniteMetrics()


MIN_OBJECT_BYTES = 1 << 10
"""The smallest ``max_object_bytes`` (a chunk holds at least one element and its checksum)."""
OBJECT_HEADROOM_BYTES = 64 << 10
"""What the default ``max_object_bytes`` allows beyond 64 MiB of chunk data: every chunk's
4-byte checksum and padding to 64-byte alignment, so that chunks of a power-of-two size fill
a pack whole (up to 1,024 of them). With a cap of exactly 64 MiB a 64 MiB leaf was cut into
two 32 MiB chunks and no pack held two of them: packs half full, twice the objects."""
MIN_RESTORE_MEMORY = 1 << 20
"""The smallest ``restore_memory_bytes`` (its parts are a fifth of it: 204 KiB)."""


PUBLISH_FORMATS = ("safetensors",)


@dataclass(frozen=True, kw_only=True)
class PublishOptions:
    """Weights published from committed steps on their own schedule (``publish=``).

    After a step commits, a background thread of the primary process reads the chosen
    leaves from the committed step on storage (never from device memory) and writes
    them as Hugging Face safetensors shards to ``<destination>/<step>/``
    (``model-00001-of-0000N.safetensors``, then ``model.safetensors.index.json`` last:
    the index says the step is published). In a bucket (``s3://``, ``gs://``) each shard
    is spooled to a local temporary file under the budget, uploaded in bounded parts
    and deleted. See :mod:`jaxckpt.lifecycle._publish`.

    Attributes:
      policy: which committed steps to publish (a save policy, e.g.
        ``EveryNSteps(5000)`` or ``AtSteps([...])``).
      destination: a local directory (or ``file://`` URI), or ``s3://BUCKET/PREFIX`` /
        ``gs://BUCKET/PREFIX`` (checked as a root is; another bucket than the
        checkpoints' is fine).
      storage_options: an object-store destination's options (endpoint, region,
        credentials, addressing style: :class:`~jaxckpt.storage.ObjectStoreOptions` or
        a mapping); None: the manager's ``storage_options``.
      tree_filter: which leaves: glob patterns on dotted paths (``["params.*"]``) or a
        predicate on them; None: the ``params`` subtree when the step has one (a
        ``TrainState``), else every array.
      format: ``"safetensors"`` (the only one so far).
      max_memory_bytes: the most tensor bytes held at once while publishing (at least
        three chunks of every published leaf; default 256 MiB).
      max_shard_bytes: the most tensor bytes per shard (Hugging Face's default, 5 GB).
      retries: attempts after the first failed one, ``backoff_s`` apart (doubling from
        the first to the longest, with jitter); then the step is left for the next
        manager to open the root. A failure is logged and counted, never fails a save.
      backoff_s: the first and the longest wait between attempts.
      queue: steps waiting to be published; when one more is due, the oldest waiting
        one is skipped (logged and counted): publishing never holds up training.
    """

    policy: SavePolicy
    destination: str
    storage_options: ObjectStoreOptions | Mapping[str, Any] | None = None
    tree_filter: Sequence[str] | Callable[[str], bool] | None = None
    format: str = "safetensors"
    max_memory_bytes: int = 256 << 20
    max_shard_bytes: int = 5 * 10**9
    retries: int = 3
    backoff_s: tuple[float, float] = (1.0, 60.0)
    queue: int = 2

    def __post_init__(self) -> None:
        if not callable(getattr(self.policy, "should_save", None)):
            raise ValueError(f"publish policy must be a save policy, got {self.policy!r}")
        dest = os.fspath(self.destination) if isinstance(self.destination, os.PathLike) else None
        dest = dest if dest is not None else self.destination
        if not isinstance(dest, str) or not dest:
            raise ValueError(f"publish destination must be a path, got {self.destination!r}")
        if dest.startswith("file://"):
            dest = dest[len("file://") :]
        try:  # the root checks: the scheme, bucket names, prefixes that stay inside
            root = parse_root(dest)
        except OSError as e:
            why = str(e.strerror).split(": ", 1)[-1]
            raise ValueError(f"publish destination {dest!r} is not valid: {why}") from e
        if root.scheme != "file":
            dest = root.uri
        if self.storage_options is not None:
            given = ObjectStoreOptions.from_mapping(self.storage_options)
            if "://" in dest:
                given.check_scheme(dest.partition("://")[0])
            object.__setattr__(self, "storage_options", given)
        object.__setattr__(self, "destination", dest)
        if isinstance(self.tree_filter, str):
            object.__setattr__(self, "tree_filter", (self.tree_filter,))
        elif self.tree_filter is not None and not callable(self.tree_filter):
            object.__setattr__(self, "tree_filter", tuple(self.tree_filter))
        if self.format not in PUBLISH_FORMATS:
            raise ValueError(
                f"publish format must be one of {PUBLISH_FORMATS}, got {self.format!r}"
            )
        for name in ("max_memory_bytes", "max_shard_bytes", "queue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"publish {name} must be a positive int, got {value!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"publish retries must be an int >= 0, got {self.retries!r}")
        first, longest = self.backoff_s
        if not 0 < first <= longest or not math.isfinite(longest):
            raise ValueError(
                f"publish backoff_s must be 0 < first <= longest, got {self.backoff_s}"
            )
        object.__setattr__(self, "backoff_s", (float(first), float(longest)))


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """How a manager saves, keeps and restores checkpoints.

    Attributes:
      save_policy: decides whether ``save`` saves; None saves on every call.
      retention: decides which committed steps to keep; None keeps all.
      chunk_bytes: largest zarr chunk, in bytes. Chunks always tile shards.
      max_inflight_bytes: chunk bytes handed to TensorStore but not yet written.
      save_timeout_s: a background save (every host) must commit within this;
        also how long an object store's request is retried while the store
        throttles (``retry_deadline_s`` of the storage options, unless given).
      fallback_on_corrupt: ``restore()`` without a step falls back to the
        newest older step that reads back intact.
      allow_lossy_cast: ``restore`` may convert an array to a target dtype that
        cannot hold every value of the saved one (float32 -> float16, int32 ->
        float32); False refuses such a target (``restore(allow_lossy_cast=...)``
        decides per call).
      read_only: never write to the root (no root record, no garbage collection).
      gc_on_open: a writable manager removes partial attempts of fenced writers
        (and stale ones) when it opens.
      gc_grace_s: an uncommitted attempt of the current writer epoch younger
        than this is live, never garbage (``jaxckpt gc`` during training).
      storage_options: the options of object-store roots: an
        :class:`jaxckpt.ObjectStoreOptions`, or the same fields as a mapping,
        e.g. ``{"endpoint": "http://..."}`` for S3-compatible stores.
      primary_host: the process that writes records and commits.
      layout: the data format of new steps: ``"plain"`` (one zarr chunk object
        per chunk, readable by any zarr v3 reader) or ``"packed"`` (each
        process writes about ``objects_in_flight`` pack objects per step, more
        only as ``max_object_bytes`` needs, whatever the number of leaves). Reads follow what each
        step recorded, so a root may hold both.
      local_root: a fast local tier (e.g. a path on local NVMe): saves commit
        there, and the steps ``promote_policy`` chooses are promoted to the
        manager's root, the durable tier. None: saves go to the root.
      durable_wait_s: with a local tier, how long the first use of the durable root
        (``latest_step``, ``restore``, a save) waits for it, counted from the open,
        which itself waits for nothing (what a job does in between, such as compiling
        its step, overlaps the durable root's writer epoch). If it has not answered
        by then (an outage, a storm of 503s), the job trains from the local tier
        meanwhile: a restore takes the newest step every host holds locally, and
        promotion resumes once the epoch is taken in the background (README "Tiers").
        1 s covers a join under load (0.6-0.9 s on the game day, most of it botocore's
        import and client) and bounds what a restart in a storm waits.
      promote_policy: which locally committed steps become durable (a save
        policy, e.g. ``EveryNSteps(1000) | OnPreemption()``); None: every one.
      local_retention: retention of the local tier (``retention`` is the
        durable root's); a step waiting for promotion is kept, up to ``promote_backlog``.
      promote_backlog: the most steps waiting for promotion the local tier keeps
        beyond ``local_retention``'s: while the durable root is down or behind, an
        older waiting step is superseded by the newer ones (its request withdrawn,
        said in the log) so that the local disk holds a bounded number of steps; None
        keeps every one (an outage longer than the disk holds then fails the saves).
      promotion: ``"background"`` (a thread of this manager promotes) or
        ``"external"`` (a ``jaxckpt promote`` process does; ``close`` does not wait).
      restore_memory_bytes: the restore's memory budget on object stores,
        beyond the restored arrays: responses in flight plus room for their
        copies (``read_ahead_bytes`` of the storage options). None: a tenth
        of each restore's bytes, from 16 MiB to 1 GiB (about 1.08x the state
        at peak); at least 1 MiB. Lower it on hosts with little RAM; raise it on high-latency
        links. Local roots read chunk files straight into the restored arrays
        and need no budget.
      writer_nice: niceness of the background save's own threads (Linux:
        per thread, 0-19; 0 leaves them alone). It lowers their CPU priority
        against the training loop, and with it their I/O priority (the
        kernel derives a thread's best-effort I/O level from its nice value).
        TensorStore's I/O threads, which copy the bytes into the page cache,
        are shared with the rest of the process and keep their priority.
      max_object_bytes: the largest object a save writes (S3 takes at most
        5 GB in one PUT, and TensorStore's s3 driver refuses larger values;
        default 64 MiB of chunks plus ``OBJECT_HEADROOM_BYTES`` for their checksums):
        chunks are at most this (less their 4-byte checksum) whatever
        ``chunk_bytes`` says, and a packed save writes at least
        ``ceil(bytes / max_object_bytes)`` packs, unless its store's write rate
        (GCS: ~1,000 writes a second per bucket) needs fewer for the whole job:
        then it merges a process's share into packs of up to
        ``(objects_in_flight + 1) × max_object_bytes`` (at most 4 GiB), fewer of
        them uploading at once (``records.pack_count``). An axis a shard holds whole
        is split evenly, its last chunk partial (a long axis of prime length is
        a few chunks); a leaf whose shards split only into far more chunks than
        their bytes need (a prime axis split across devices, nothing else to
        split) is refused by ``save`` with its tree path. A packed save to an object store
        holds at most ``objects_in_flight + 1`` packs in host memory beyond
        the snapshot (a local root writes them from the snapshot).
      objects_in_flight: pack objects a packed save uploads at once per process
        (one more fills meanwhile), and pack spans a restore reads at once:
        enough requests to fill the bandwidth-delay product of a far-away store
        (16 × 85 MB/s fills a 10 Gb/s link). At least 1.
      local_replicas: with ``local_root``: how many nodes hold each process's
        local part (1: its own only). With ``k > 1`` the background part of a
        save sends the part to ``k - 1`` other nodes' local tiers (a ring over
        the nodes, see ``_placement``; a node is the host name or
        ``JAXCKPT_NODE_ID``) before the local commit, and a restore after a
        lost node fetches the missing parts from them.
      peer_timeout_s: the bound of every peer transfer's socket operation: a
        dead or stalled peer fails its transfer (or a restore's fetch) after this.
      strict_replication: with ``local_replicas > 1``: a part that cannot be
        replicated to one of its holders fails the save. False (default): the step
        commits without that copy ("not replicated": logged, counted in
        ``Peers.not_replicated``, and sent again before the next save's
        replication).
      peer_host: the address the peer listener binds and publishes to the
        other processes (``local_replicas > 1``); None: ``JAXCKPT_PEER_HOST``,
        else loopback when the JAX coordinator is on loopback, else the
        address of this host's name.
      health: judges each committed step from the metrics saved with it
        (``policy.FiniteMetrics()``, ``policy.MetricSpike(...)``, a function
        ``(step, metrics) -> bool``, combined with ``&`` and ``|``); a bad verdict is
        stored beside the step and ``restore()`` skips it. None judges nothing.
      crash_loop_limit: when this many runs in a row restored the same step and
        ended without committing a newer one, a clean ``close()`` or a preemption
        notice, the next ``restore()`` marks that step bad and takes an older one.
        None turns the quarantine (and its records) off.
      ledger: record the run ledger under the durable root (``ledger/``): saves,
        restores, the reached step, promotions, retention deletions, startup phases
        and clean exits, which ``jaxckpt report`` turns into goodput. Written in
        batches by a background thread; a write that fails is logged and counted
        (``CheckpointManager.ledger.write_failures``), never fails a save.
      ledger_flush_s: the longest an event waits before it is written (the reached
        step is at most this late); the ledger's thread writes at most this often.
      tolerate_failed_saves: how many background saves in a row may fail without
        ``save()`` raising (a full local disk, a store's outage past ``save_timeout_s``):
        each is logged and counted (``CheckpointManager.failed_saves``, the ledger's
        ``save_failed``), its step is not committed, and the next save the policy takes
        tries again; the next failure raises ``SaveFailedError``. ``wait()`` and
        ``close()`` always raise; a fence always raises. 0: the first failure raises.
      close_wait_s: how long ``close()``, once the in-flight save has committed, waits
        in all for what a run can do without (the ledger's last events, the health
        exit record, a retention pass) while a store does not answer (at most 1 s when
        the ledger's writes already find the durable root not answering); what is left is
        logged and abandoned at exit (a cut-short deletion is collected later).
      metrics_port: the primary process serves Prometheus metrics of its saves,
        restores and reached step on this port (``pip install 'jaxckpt[promote]'``).
      compilation_cache: keep JAX's persistent compilation cache in
        ``compilation-cache/`` of the local tier (or of a local root), so a restarted
        job loads its compiled programs instead of compiling them again (sets
        ``jax_compilation_cache_dir`` unless the job set one).
      publish: weights published from committed steps on their own schedule (a
        :class:`PublishOptions`); None publishes nothing.
    """

    save_policy: SavePolicy | None = None
    retention: RetentionPolicy | None = None
    chunk_bytes: int = 64 << 20
    max_inflight_bytes: int = 512 << 20
    save_timeout_s: float = 600.0
    fallback_on_corrupt: bool = True
    allow_lossy_cast: bool = False
    read_only: bool = False
    gc_on_open: bool = True
    gc_grace_s: float = 3600.0
    storage_options: ObjectStoreOptions | Mapping[str, Any] = field(default_factory=dict)
    primary_host: int = 0
    layout: str = "packed"
    local_root: str | None = None
    durable_wait_s: float = 1.0
    promote_policy: SavePolicy | None = None
    local_retention: RetentionPolicy | None = None
    promote_backlog: int | None = 2
    promotion: str = "background"
    restore_memory_bytes: int | None = None
    writer_nice: int = 0
    max_object_bytes: int = (64 << 20) + OBJECT_HEADROOM_BYTES
    objects_in_flight: int = 16
    local_replicas: int = 1
    peer_timeout_s: float = 60.0
    peer_host: str | None = None
    health: HealthPolicy | Callable[[int, Mapping[str, float]], bool] | None = field(
        default_factory=_finite_metrics
    )
    crash_loop_limit: int | None = 3
    strict_replication: bool = False
    ledger: bool = True
    ledger_flush_s: float = 10.0
    close_wait_s: float = 5.0
    tolerate_failed_saves: int = 0
    metrics_port: int | None = None
    compilation_cache: bool = False
    publish: PublishOptions | None = None

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {self.chunk_bytes}")
        if self.max_inflight_bytes < 1:
            raise ValueError(f"max_inflight_bytes must be positive, got {self.max_inflight_bytes}")
        if self.promote_backlog is not None and self.promote_backlog < 1:
            raise ValueError(f"promote_backlog must be >= 1 or None, got {self.promote_backlog}")
        if not self.durable_wait_s >= 0:
            raise ValueError(f"durable_wait_s must be non-negative, got {self.durable_wait_s}")
        if not self.gc_grace_s >= 0:  # NaN too; infinity keeps every attempt of the epoch
            raise ValueError(f"gc_grace_s must be non-negative, got {self.gc_grace_s}")
        if self.max_object_bytes < MIN_OBJECT_BYTES:
            raise ValueError(
                f"max_object_bytes must be at least {MIN_OBJECT_BYTES} bytes, "
                f"got {self.max_object_bytes}"
            )
        if self.objects_in_flight < 1:
            raise ValueError(f"objects_in_flight must be positive, got {self.objects_in_flight}")
        if self.layout not in FORMATS:
            raise ValueError(f"layout must be {FORMAT_NAMES}, got {self.layout!r}")
        if self.promotion not in ("background", "external"):
            raise ValueError(
                f"promotion must be 'background' or 'external', got {self.promotion!r}"
            )
        if self.local_root is None and (
            self.promote_policy is not None or self.local_retention is not None
        ):
            raise ValueError("promote_policy and local_retention need a local_root")
        if self.local_root is not None and not isinstance(self.local_root, str):
            object.__setattr__(self, "local_root", str(self.local_root))  # a PathLike
        if self.restore_memory_bytes is not None:
            budget = self.restore_memory_bytes
            if (
                isinstance(budget, bool)
                or not isinstance(budget, int)
                or budget < MIN_RESTORE_MEMORY
            ):
                # Parts are an eighth of the budget: a few bytes would mean a
                # ranged GET for every few bytes of the checkpoint.
                raise ValueError(
                    f"restore_memory_bytes must be an integer >= {MIN_RESTORE_MEMORY} (1 MiB), "
                    f"got {budget!r}"
                )
            given = self.storage_options
            if (
                given.read_ahead_bytes is not None
                if isinstance(given, ObjectStoreOptions)
                else "read_ahead_bytes" in given
            ):
                raise ValueError(
                    "restore_memory_bytes and storage_options['read_ahead_bytes'] set the same "
                    "budget: give one"
                )
        if isinstance(self.writer_nice, bool) or self.writer_nice not in range(20):
            raise ValueError(f"writer_nice must be an integer 0-19, got {self.writer_nice!r}")
        if not isinstance(self.strict_replication, bool):
            raise ValueError(
                f"strict_replication must be True or False, got {self.strict_replication!r}"
            )
        if isinstance(self.local_replicas, bool) or not isinstance(self.local_replicas, int):
            raise ValueError(f"local_replicas must be an int, got {self.local_replicas!r}")
        if self.local_replicas < 1 or (self.local_replicas > 1 and self.local_root is None):
            raise ValueError(
                f"local_replicas={self.local_replicas}: must be at least 1, and above 1 "
                "only with a local_root"
            )
        for name in ("peer_timeout_s", "save_timeout_s"):  # NaN or infinity: no deadline at all
            value = getattr(self, name)
            if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.health is not None:
            from jaxckpt.policy import health_from

            health_from(self.health)  # a TypeError names what it got
        limit = self.crash_loop_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise ValueError(f"crash_loop_limit must be an int >= 1 or None, got {limit!r}")
        if limit is not None and limit < 1:
            raise ValueError(f"crash_loop_limit must be an int >= 1 or None, got {limit!r}")
        if not 0 < self.ledger_flush_s <= 600:
            raise ValueError(f"ledger_flush_s must be in (0, 600], got {self.ledger_flush_s}")
        tolerated = self.tolerate_failed_saves
        if isinstance(tolerated, bool) or not isinstance(tolerated, int) or tolerated < 0:
            raise ValueError(f"tolerate_failed_saves must be an int >= 0, got {tolerated!r}")
        if not 0 <= self.close_wait_s <= 600:
            raise ValueError(f"close_wait_s must be in [0, 600], got {self.close_wait_s}")
        if self.publish is not None and not isinstance(self.publish, PublishOptions):
            raise ValueError(f"publish must be a PublishOptions or None, got {self.publish!r}")
        port = self.metrics_port
        if port is not None and (isinstance(port, bool) or port not in range(65536)):
            raise ValueError(f"metrics_port must be a port number 0-65535, got {port!r}")

    @property
    def stored_chunk_bytes(self) -> int:
        """The largest chunk a save plans: ``chunk_bytes``, and within ``max_object_bytes``."""
        return min(self.chunk_bytes, self.max_object_bytes - TRAILER_BYTES)

    def storage_kwargs(self, root: str) -> dict[str, Any]:
        """The backend options to open ``root`` with (``restore_memory_bytes`` applied)."""
        given = self.storage_options
        is_object = parse_root(root).scheme != "file"
        if isinstance(given, ObjectStoreOptions):
            kwargs = dataclasses.asdict(given) if is_object else {}
        else:
            kwargs = dict(given)
            if not is_object:  # a directory takes io_concurrency; the object stores' fields
                fields = {f.name for f in dataclasses.fields(ObjectStoreOptions)}  # are theirs
                kwargs = {k: v for k, v in kwargs.items() if k not in fields}
                unknown = sorted(set(kwargs) - {"io_concurrency"})
                if unknown:
                    raise ValueError(
                        f"storage_options {unknown} are options neither of the directory root "
                        f"{root} nor of an object store"
                    )
        if self.restore_memory_bytes is not None and is_object:
            kwargs["read_ahead_bytes"] = self.restore_memory_bytes
        if is_object and kwargs.get("retry_deadline_s") is None:
            kwargs["retry_deadline_s"] = self.save_timeout_s  # requests retry as long as a save may
        return kwargs
