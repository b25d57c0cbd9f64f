"""Checkpoint cost arithmetic behind ``jaxckpt plan``. Pure: no jax, no I/O.

Definitions (GB = 1e9 bytes, write speed in GB per second):

* ``save_seconds``: time to write one checkpoint, ``checkpoint_gb / write_gbps``.
* blocking seconds per save: ``async_blocking_seconds`` when given (an async save only
  blocks for the device-to-host copy), else ``save_seconds`` (a synchronous save).
* ``overhead_percent``: blocking seconds per save over the training time between saves
  (``every_steps * step_seconds``), in percent.
* ``run_hours`` is training time; the run has ``run_hours * 3600 / step_seconds`` steps and
  writes one checkpoint per whole ``every_steps`` of them.
* ``idle_gpu_hours``: all GPUs stalled during every blocking save of the run.
* ``optimal_interval_steps``: Daly's interval (:func:`jaxckpt.policy.daly_interval`) with
  δ = blocking seconds per save and M = the job's MTBF, in steps (at least 1).
* ``expected_lost_minutes_per_failure``: a failure strikes on average half an interval
  after the last save started, and that save only counts once written, so it loses
  ``every_steps * step_seconds / 2 + save_seconds`` (restart time not included).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from jaxckpt.formats import FORMATS
from jaxckpt.policy import daly_interval
from jaxckpt.records import RECORDS_PER_STEP, ProcessShare

__all__ = ["PlanResult", "plan"]


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    """Costs of one checkpointing plan; see the module docstring for definitions."""

    checkpoint_gb: float
    save_seconds: float
    overhead_percent: float
    optimal_interval_steps: int
    checkpoints: int
    idle_gpu_hours: float
    idle_cost_usd: float
    expected_lost_minutes_per_failure: float

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")

    def to_dict(self) -> dict[str, float]:
        """Returns the fields as a plain dict (for ``--json``)."""
        return asdict(self)

    def format_text(self) -> str:
        """Renders the plan for humans, one quantity per line."""
        rows = [
            ("checkpoint size", f"{self.checkpoint_gb:,.1f} GB"),
            ("save time", f"{self.save_seconds:,.1f} s"),
            ("blocking overhead", f"{self.overhead_percent:.2f} % of training time"),
            ("checkpoints over the run", f"{self.checkpoints:,}"),
            ("idle GPU time", f"{self.idle_gpu_hours:,.1f} GPU-hours"),
            ("idle GPU cost", f"${self.idle_cost_usd:,.0f}"),
            ("work lost per failure", f"{self.expected_lost_minutes_per_failure:,.1f} min"),
            ("Daly-optimal interval", f"every {self.optimal_interval_steps:,} steps"),
        ]
        width = max(len(label) for label, _ in rows)
        return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def plan(
    *,
    params: float,
    bytes_per_param: float = 2,
    step_seconds: float,
    write_gbps: float,
    every_steps: int,
    mtbf_hours: float,
    gpus: int,
    gpu_hour_usd: float,
    run_hours: float = 504,
    async_blocking_seconds: float | None = None,
) -> PlanResult:
    """Estimates what a checkpointing plan costs.

    Args:
        params: Number of parameters (plus optimizer state, if you count it in params).
        bytes_per_param: Bytes per parameter (2 for bf16).
        step_seconds: Wall time of one training step.
        write_gbps: Storage write speed in GB (1e9 bytes) per second.
        every_steps: Save every this many steps.
        mtbf_hours: Mean time between failures of the whole job.
        gpus: GPUs that sit idle while a save blocks.
        gpu_hour_usd: Price of one GPU-hour.
        run_hours: Training time of the run (default three weeks).
        async_blocking_seconds: Blocking time of an async save; None for synchronous saves.

    Returns:
        The costs.

    Raises:
        ValueError: If an argument is not positive (``async_blocking_seconds`` may be 0).

    >>> r = plan(params=30e9, step_seconds=2.5, write_gbps=1.2, every_steps=1000,
    ...          mtbf_hours=24, gpus=64, gpu_hour_usd=4)
    >>> r.checkpoint_gb, r.save_seconds, r.overhead_percent, r.checkpoints
    (60.0, 50.0, 2.0, 725)
    """
    for name, value in [
        ("params", params),
        ("bytes_per_param", bytes_per_param),
        ("step_seconds", step_seconds),
        ("write_gbps", write_gbps),
        ("mtbf_hours", mtbf_hours),
        ("gpu_hour_usd", gpu_hour_usd),
        ("run_hours", run_hours),
    ]:
        _positive(name, value)
    for name, count in [("every_steps", every_steps), ("gpus", gpus)]:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {count!r}")
    if async_blocking_seconds is not None and not (
        math.isfinite(async_blocking_seconds) and async_blocking_seconds >= 0
    ):
        raise ValueError(f"async_blocking_seconds must be >= 0, got {async_blocking_seconds!r}")

    checkpoint_gb = params * bytes_per_param / 1e9
    save_seconds = checkpoint_gb / write_gbps
    blocking = save_seconds if async_blocking_seconds is None else async_blocking_seconds
    interval_seconds = every_steps * step_seconds
    run_steps = math.floor(run_hours * 3600 / step_seconds + 1e-9)  # tolerate float noise
    checkpoints = run_steps // every_steps
    idle_gpu_hours = checkpoints * blocking * gpus / 3600
    daly_steps = daly_interval(blocking, mtbf_hours * 3600) / step_seconds
    return PlanResult(
        checkpoint_gb=checkpoint_gb,
        save_seconds=save_seconds,
        overhead_percent=100 * blocking / interval_seconds,
        optimal_interval_steps=max(1, round(daly_steps)),
        checkpoints=checkpoints,
        idle_gpu_hours=idle_gpu_hours,
        idle_cost_usd=idle_gpu_hours * gpu_hour_usd,
        expected_lost_minutes_per_failure=(interval_seconds / 2 + save_seconds) / 60,
    )


# -- objects and requests per checkpoint, per data format ----------------------


def process_share(
    *,
    checkpoint_bytes: float,
    leaves: int,
    devices: int,
    devices_per_process: int = 8,
    chunk_bytes: int | None = None,
    max_object_bytes: int | None = None,
    objects_in_flight: int | None = None,
    writes_per_s: float | None = None,
) -> ProcessShare:
    """One process's bytes, chunks and packs when every leaf is sharded over all ``devices``.

    ``chunk_bytes``, ``max_object_bytes`` and ``objects_in_flight`` default to
    :class:`jaxckpt.CheckpointOptions`'s, whose ``stored_chunk_bytes`` bounds the
    chunks; packs are counted by the packed format's own
    :func:`jaxckpt.records._keys.pack_count`, under the store's write budget
    ``writes_per_s`` (the whole job's, per second; None: no budget, as on a local root).

    >>> s = process_share(checkpoint_bytes=16 * (16 << 20), leaves=16, devices=8)
    >>> s.processes, s.chunks, s.chunk_bytes == 2 << 20, s.packs, s.objects_in_flight
    (1, 128.0, True, 16, 16)

    Raises:
      ValueError: a count below 1, or options :class:`jaxckpt.CheckpointOptions` refuses.
    """
    for name, count in [
        ("leaves", leaves),
        ("devices", devices),
        ("devices_per_process", devices_per_process),
    ]:
        _count(name, count)
    _positive("checkpoint_bytes", checkpoint_bytes)
    from jaxckpt._options import CheckpointOptions
    from jaxckpt.records import TRAILER_BYTES, pack_count, uploads_within

    default = CheckpointOptions()
    options = CheckpointOptions(
        chunk_bytes=default.chunk_bytes if chunk_bytes is None else chunk_bytes,
        max_object_bytes=default.max_object_bytes if max_object_bytes is None else max_object_bytes,
        objects_in_flight=(
            default.objects_in_flight if objects_in_flight is None else objects_in_flight
        ),
    )
    processes = math.ceil(devices / devices_per_process)
    shard_bytes = checkpoint_bytes / leaves / devices
    chunks_per_shard = max(1, math.ceil(shard_bytes / options.stored_chunk_bytes))
    nbytes = checkpoint_bytes / processes
    packs = pack_count(
        nbytes,
        max_object_bytes=options.max_object_bytes,
        max_packs=options.objects_in_flight,
        processes=processes,
        writes_per_s=writes_per_s,
    )
    chunk_size = shard_bytes / chunks_per_shard
    return ProcessShare(
        processes=processes,
        nbytes=nbytes,
        chunks=leaves * devices * chunks_per_shard / processes,
        chunk_bytes=chunk_size,
        chunk_stored_bytes=chunk_size + TRAILER_BYTES,
        packs=packs,
        objects_in_flight=options.objects_in_flight,
        uploads_in_flight=uploads_within(
            nbytes / max(1, packs), options.objects_in_flight, options.max_object_bytes
        ),
    )


def _option(name: str) -> int:
    """The default of a :class:`jaxckpt.CheckpointOptions` field."""
    from jaxckpt._options import CheckpointOptions

    return int(getattr(CheckpointOptions(), name))


def _count(name: str, count: object) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {count!r}")


@dataclass(frozen=True, kw_only=True)
class LayoutCost:
    """Objects and requests of one checkpoint in one data format (see :func:`object_plan`)."""

    layout: str
    """The format's name."""
    objects_per_checkpoint: int
    requests_per_checkpoint: int
    request_cost_usd: float
    request_seconds: float
    run_request_cost_usd: float


def object_plan(
    *,
    checkpoint_bytes: float,
    leaves: int,
    devices: int,
    devices_per_process: int = 8,
    chunk_bytes: int | None = None,
    max_object_bytes: int | None = None,
    objects_in_flight: int | None = None,
    write_usd_per_1000: float = 0.005,
    read_usd_per_1000: float = 0.0004,
    write_requests_per_s: float = 1000.0,
    checkpoints: int = 1,
) -> dict[str, LayoutCost]:
    """Objects, requests and request cost of one checkpoint, per data format (by name).

    Model (:func:`process_share`: every leaf is sharded over all ``devices``,
    as FSDP does; a shard is split into chunks of at most ``chunk_bytes``; a
    host runs ``devices_per_process`` devices). The data objects are each
    format's (``DataFormat.cost``: its objects per process, and those written once
    per step):

    * plain: one object per chunk, ``leaves × devices × chunks per shard``, plus
      one ``zarr.json`` per leaf;
    * packed: :func:`jaxckpt.records._keys.pack_count` pack objects per process
      (``objects_in_flight`` of them, fewer for a small state or where the job's packs
      would outlast the link at ``write_requests_per_s``, more as ``max_object_bytes``
      needs);
    * every format: the step's records — pending record, tree record, two zarr group
      records, one manifest part per process, the latest hint and the marker.

    Requests add to the object writes: the pending record's delete, the
    marker's conditional HEAD, two ``writers/`` listings (fence checks), the
    commit's read-back of tree and manifest parts, and its listing of the
    attempt (one LIST page per 1,000 keys). Writes and listings are billed at
    ``write_usd_per_1000`` (S3/GCS class A: $0.005), reads at
    ``read_usd_per_1000`` (class B: $0.0004); ``request_seconds`` is the write
    and list requests at the bucket's ``write_requests_per_s`` (a new GCS
    bucket starts near 1,000 writes/s).

    >>> p = object_plan(checkpoint_bytes=840e9, leaves=2200, devices=256)
    >>> {name: cost.objects_per_checkpoint for name, cost in p.items()}
    {'plain': 565438, 'packed': 12550}
    """
    _count("checkpoints", checkpoints)
    _positive("write_requests_per_s", write_requests_per_s)
    for name, value in [
        ("write_usd_per_1000", write_usd_per_1000),
        ("read_usd_per_1000", read_usd_per_1000),
    ]:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    share = process_share(
        checkpoint_bytes=checkpoint_bytes,
        leaves=leaves,
        devices=devices,
        devices_per_process=devices_per_process,
        chunk_bytes=chunk_bytes,
        max_object_bytes=max_object_bytes,
        objects_in_flight=objects_in_flight,
        writes_per_s=write_requests_per_s,
    )
    processes = share.processes
    records = RECORDS_PER_STEP + processes  # + a manifest part per process
    out = {}
    for data_format in FORMATS.values():
        model = data_format.cost
        data = round(model.data_objects(share) * processes) + model.step_objects(leaves)
        objects = data + records
        listing = math.ceil(data / 1000) + 2  # the attempt, and writers/ twice
        writes = objects + 1 + listing  # + the pending record's delete
        reads = 1 + (1 + processes)  # the marker's HEAD, tree and manifests read back
        cost = (writes * write_usd_per_1000 + reads * read_usd_per_1000) / 1000
        out[data_format.name] = LayoutCost(
            layout=data_format.name,
            objects_per_checkpoint=objects,
            requests_per_checkpoint=writes + reads,
            request_cost_usd=cost,
            request_seconds=writes / write_requests_per_s,
            run_request_cost_usd=cost * checkpoints,
        )
    return out
