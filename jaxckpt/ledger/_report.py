"""Goodput from a root's run ledger: :func:`report` and ``jaxckpt report``.

Definitions (seconds of wall time; a *run* is one writer epoch, i.e. one start of the
job; its *end* is its last recorded event, at most ``ledger_flush_s`` before it died):

* ``wall_s``: from the first run's process start to the last run's end.
* ``badput_s.save_blocking``: the seconds the ``save`` calls that saved took (per
  step, the slowest process; the wait for the previous save included), outside lost
  work.
* ``badput_s.restore``: each run's restore (the slowest process).
* ``badput_s.startup``: each run's start until its first ``save`` call (process start →
  manager open → restore done → first save call), less its restore, plus the time
  between a run's end and the next run's process start (the scheduler's restart).
* ``badput_s.lost_work``: per restart, the time the previous run spent past the step
  the restart restored (from when it reached that step until its end), less the
  blocking of its saves in that time.
* ``goodput``: the rest of the wall time as a share of it.

A run without a clean exit on every process (``close``, or interpreter exit with the
manager open, not while an exception unwinds the loop) is a failure; the job's MTBF is
the wall time over the failures, and ``daly`` sets Daly's optimal interval
(:func:`jaxckpt.policy.daly_interval`, the formula ``jaxckpt plan`` uses with guesses)
from the measured median blocking time and that MTBF against the run's own interval.
``storage`` estimates requests from the saves' bytes (the records of a step, its packs
and listings; ``jaxckpt plan`` has the model) and bills them at list prices.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from jaxckpt.ledger._read import RunEvents, read_ledger
from jaxckpt.ledger._runs import RunFigures
from jaxckpt.storage import Storage, open_storage

PRICES: Mapping[str, Mapping[str, float]] = {
    # USD: per GB-month stored, per 1,000 writes/lists (class A), per 1,000 reads (class B)
    "s3": {"gb_month": 0.023, "writes_per_1000": 0.005, "reads_per_1000": 0.0004},
    "gs": {"gb_month": 0.020, "writes_per_1000": 0.005, "reads_per_1000": 0.0004},
    "file": {"gb_month": 0.0, "writes_per_1000": 0.0, "reads_per_1000": 0.0},
}
"""List prices of standard storage (2026) the bill is estimated with."""


@dataclass(frozen=True, kw_only=True)
class Restart:
    """One restart of the job.

    Attributes:
      restored_step: the step it restored (None: it started afresh).
      reached_step: the newest step the run before it reached.
      lost_steps: steps redone: ``reached_step - restored_step``.
      lost_s: seconds the run before spent on them.
      tier: where the restored step came from (``local``, ``durable``).
      crash: the run before ended without a clean exit.
      why: why an older step than the newest was restored (``fallback``, ``healing``,
        ``quarantine``: a crash loop marked it bad, ``bad``: marked bad), or
        ``unrecorded``: the run died before its restore was written, and the newest save
        before it stands in for the step it restored.
      at_s: when the restart's process started, seconds into the job.
      compile, compile_s: ``CheckpointManager.compile`` in the restarted run: ``loaded``
        (every process loaded its kept executable), ``compiled`` or ``recompiled`` (a
        kept one failed to load), and the slowest process's seconds (None: not called).
    """

    restored_step: int | None
    reached_step: int | None
    lost_steps: int
    lost_s: float
    tier: str | None
    crash: bool
    why: str | None = None
    at_s: float = 0.0
    compile: str | None = None
    compile_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Badput:
    """Seconds of wall time that did not end as kept progress, by cause."""

    save_blocking: float = 0.0
    restore: float = 0.0
    lost_work: float = 0.0
    startup: float = 0.0

    @property
    def total(self) -> float:
        return self.save_blocking + self.restore + self.lost_work + self.startup


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """What the plot draws (seconds into the job)."""

    reached: tuple[tuple[tuple[float, int], ...], ...] = ()
    """Per run, its (time, step) points."""
    saves: tuple[tuple[float, int, str], ...] = ()
    failures: tuple[float, ...] = ()
    restores: tuple[tuple[float, int], ...] = ()
    lost: tuple[tuple[float, float, int, int], ...] = ()
    """(from, to, restored step, reached step) of each restart's lost work."""
    startup: tuple[tuple[float, float], ...] = ()
    """(from, to) of each run's startup: its process start (or the run before's end)
    until its first save call."""


@dataclass(frozen=True, kw_only=True)
class Report:
    """A run ledger's goodput report (see the module docstring for the definitions)."""

    root: str
    goodput: float
    wall_s: float
    badput_s: Badput
    restarts: tuple[Restart, ...]
    saves: dict[str, Any]
    storage: dict[str, Any]
    daly: dict[str, Any]
    runs: int = 0
    timeline: Timeline = field(default_factory=Timeline)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON: ``goodput``, ``wall_s``, ``badput_s``, ``restarts``,
        ``saves``, ``storage``, ``daly``."""
        return {
            "goodput": self.goodput,
            "wall_s": self.wall_s,
            "badput_s": asdict(self.badput_s),
            "restarts": [asdict(r) for r in self.restarts],
            "saves": self.saves,
            "storage": self.storage,
            "daly": self.daly,
        }


def _restart(prev: RunFigures, cur: RunFigures, origin: float) -> Restart:
    restored = cur.restored
    reached = prev.reached
    lost_steps, lost_s = 0, 0.0
    if reached is not None:
        lost_steps = max(0, reached - (restored if restored is not None else 0))
        if lost_steps:
            since = prev.time_at(restored) if restored is not None else prev.work_start
            since = max(since, prev.start)
            lost_s = max(0.0, prev.end - since - prev.blocking_between(since, prev.end))
    return Restart(
        restored_step=restored,
        reached_step=reached,
        lost_steps=lost_steps,
        lost_s=lost_s,
        tier=cur.tier,
        crash=not prev.clean,
        why=cur.why,
        at_s=cur.start - origin,
        compile=cur.compile,
        compile_s=cur.compile_s,
    )


def _stand_in_for_unrecorded_restores(runs: Sequence[RunFigures]) -> None:
    """A run killed within its first flush interval wrote its open but not its restore:
    when the runs before it committed saves, the newest of them up to the step the last
    one reached (else the step that one restored: killed early too) stands in for the
    step it restored (``why``: ``unrecorded``), as a restore takes the newest step;
    without one it started fresh."""
    saved: list[int] = []
    for p, c in itertools.pairwise(runs):
        saved += p.saves
        bound = p.reached if p.reached is not None else p.restored
        if c.restored is not None or bound is None:
            continue
        newest = max((s for s in saved if s <= bound), default=None)
        if newest is not None:
            c.restored, c.why = newest, "unrecorded"


def _step_s(runs: Sequence[RunFigures]) -> float | None:
    """The job's median seconds per step over its runs."""
    return _median([s for r in runs if (s := r.step_s()) is not None])


def _gaps_badput(runs: Sequence[RunFigures], step_s: float | None) -> float:
    """The time between runs of the ledger that was not kept progress: runs it never
    heard of (their durable root never answered them, so they never learned an epoch to
    write under) may have trained in a gap, up to the step the next run restored; so may
    the run before it when it died before its first reached step was written (its end
    is its open: its training is in the gap, from the step it restored). Where that
    restore is a stand-in (``unrecorded``: it may have restored later steps, trained
    before its open), progress the gap after it cannot hold is credited to the one
    before it."""
    total, carry = 0.0, 0.0
    for p, c in reversed(list(itertools.pairwise(runs))):
        gap = max(0.0, c.start - p.end)
        if step_s is not None and c.restored is not None:
            reached = p.reached if p.reached is not None else p.restored or 0
            carry += max(0, c.restored - reached) * step_s
        total += max(0.0, gap - carry)
        carry = max(0.0, carry - gap) if p.why == "unrecorded" else 0.0
    return total


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _saves(runs: Sequence[RunFigures]) -> dict[str, Any]:
    saves = [s for r in runs for s in r.saves.values()]
    blocking = [s["blocking_s"] for s in saves]
    promoted = [e for r in runs for e in r.promoted]
    durable = [e["durable_s"] for e in promoted if e["durable_s"] is not None]
    durable += [s["total_s"] for s in saves if s["tier"] == "durable"]
    steps, seconds = [], []
    for r in runs:
        ordered = sorted(r.saves.values(), key=lambda s: s["step"])
        for a, b in itertools.pairwise(ordered):
            steps.append(b["step"] - a["step"])
            if a["started"] and b["started"]:
                seconds.append(b["started"] - a["started"])
    return {
        "count": len(saves),
        "by_tier": {
            t: sum(s["tier"] == t for s in saves) for t in sorted({s["tier"] for s in saves})
        },
        "promoted": len(promoted),
        "failed": sum(len(r.failed) for r in runs),
        "bytes": sum(s["nbytes"] for s in saves),
        "blocking_s": {
            "total": sum(blocking),
            "median": _median(blocking),
            "max": max(blocking, default=None),
        },
        "total_s_median": _median([s["total_s"] for s in saves]),
        "durable_s_median": _median(durable),
        "interval_steps": _median(steps),
        "interval_s": _median(seconds),
    }


def _requests(processes: int, step_bytes: float, scheme: str) -> tuple[int, int]:
    """Estimated (writes and lists, reads) of committing one step of ``step_bytes`` to a
    ``scheme`` root (its packs under the store's write budget)."""
    from jaxckpt.records import RECORDS_PER_STEP, SPREAD_SLOTS, pack_count, store_writes_per_s

    rate = store_writes_per_s(f"{scheme}://", prefixes=SPREAD_SLOTS)
    share = step_bytes / max(1, processes)
    packs = processes * pack_count(share, processes=processes, writes_per_s=rate)
    return RECORDS_PER_STEP + processes + packs + 3, 2 + processes


def _storage(
    runs: Sequence[RunFigures], scheme: str, now_bytes: int | None, ledger: int
) -> dict[str, Any]:
    written = local_written = freed = local_freed = 0
    writes, reads = ledger, 0
    for r in runs:
        for s in r.saves.values():
            if s["tier"] == "durable":
                written += s["nbytes"]
                w, rd = _requests(r.processes, s["nbytes"], scheme)
                writes, reads = writes + w, reads + rd
            else:
                local_written += s["nbytes"]
        for e in r.promoted:
            written += e["nbytes"]
            w, rd = _requests(r.processes, e["nbytes"], scheme)
            writes, reads = writes + w + 1, reads + rd + 1  # the promoter's request and marker
        for e in r.deleted:
            if e["tier"] == "durable":
                freed += e["nbytes"]
                writes += 34 + math.ceil(_requests(r.processes, e["nbytes"], scheme)[0] / 1000)
            else:
                local_freed += e["nbytes"]
    now = written - freed if now_bytes is None else now_bytes
    price = PRICES.get(scheme, PRICES["s3"])
    requests_usd = (writes * price["writes_per_1000"] + reads * price["reads_per_1000"]) / 1000
    return {
        "now_bytes": now,
        "written_bytes": written,
        "freed_bytes": freed,
        "local_written_bytes": local_written,
        "local_freed_bytes": local_freed,
        "requests": {"writes": writes, "reads": reads, "ledger_objects": ledger},
        "bill_usd": {
            "requests": requests_usd,
            "storage_per_month": now / 1e9 * price["gb_month"],
            "prices": dict(price),
            "estimated": True,
        },
    }


def _daly(runs: Sequence[RunFigures], wall_s: float, saves: dict[str, Any]) -> dict[str, Any]:
    from jaxckpt.policy import daly_interval

    failures = sum(not r.clean for r in runs)
    delta = saves["blocking_s"]["median"]
    mtbf = wall_s / failures if failures and wall_s > 0 else None
    step_s = _median([s for r in runs if (s := r.step_s()) is not None])
    optimal = daly_interval(delta, mtbf) if delta is not None and mtbf is not None else None
    interval_s = saves["interval_s"]
    if interval_s is None and saves["interval_steps"] is not None and step_s is not None:
        interval_s = saves["interval_steps"] * step_s
    return {
        "save_cost_s": delta,
        "failures": failures,
        "mtbf_s": mtbf,
        "step_s": step_s,
        "interval_s": interval_s,
        "interval_steps": saves["interval_steps"],
        "optimal_s": optimal,
        "optimal_steps": None if optimal is None or not step_s else max(1, round(optimal / step_s)),
        "interval_over_optimal": None
        if not optimal or interval_s is None
        else interval_s / optimal,
    }


def build_report(
    root: str, events: Sequence[RunEvents], *, now_bytes: int | None = None, scheme: str = "file"
) -> Report:
    """The report of a ledger's runs (see :func:`report`)."""
    runs = [RunFigures(r) for r in events if r.events]
    if not runs:
        return Report(
            root=root,
            goodput=0.0,
            wall_s=0.0,
            badput_s=Badput(),
            restarts=(),
            saves=_saves([]),
            storage=_storage([], scheme, now_bytes, 0),
            daly=_daly([], 0.0, _saves([])),
        )
    for p, c in itertools.pairwise(runs):
        if c.start < p.end:  # a process that ran the run before too: from this open
            c.start = max(p.end, c.open_start)
    _stand_in_for_unrecorded_restores(runs)
    origin = runs[0].start
    wall = max(0.0, runs[-1].end - origin)
    restarts = tuple(_restart(p, c, origin) for p, c in itertools.pairwise(runs))
    startup = sum(max(0.0, min(r.work_start, r.end) - r.start - r.restore_s) for r in runs)
    step_s = _step_s(runs)
    startup += _gaps_badput(runs, step_s)
    lost = sum(r.lost_s for r in restarts)
    blocking = sum(s["blocking_s"] for r in runs for s in r.saves.values())
    blocking -= sum(
        p.blocking_between(max(p.start, p.time_at(c.restored)), p.end)
        for p, c in itertools.pairwise(runs)
        if c.restored is not None and p.reached is not None and p.reached > c.restored
    )
    badput = Badput(
        save_blocking=max(0.0, blocking),
        restore=sum(r.restore_s for r in runs),
        lost_work=lost,
        startup=startup,
    )
    saves = _saves(runs)
    timeline = Timeline(
        reached=tuple(tuple((t - origin, s) for t, s in r.points) for r in runs),
        saves=tuple(
            (s["started"] - origin, step, s["tier"])
            for r in runs
            for step, s in sorted(r.saves.items())
            if s["started"]
        ),
        failures=tuple(r.end - origin for r in runs if not r.clean),
        restores=tuple(
            (r.restore_end - origin, r.restored)
            for r in runs
            if r.restore_end is not None and r.restored is not None
        ),
        lost=tuple(
            (p.end - origin - x.lost_s, p.end - origin, x.restored_step or 0, x.reached_step or 0)
            for p, x in zip(runs, restarts, strict=False)
            if x.lost_steps
        ),
        startup=tuple(
            (start - origin, min(r.work_start, r.end) - origin)
            for start, r in zip([runs[0].start, *(p.end for p in runs[:-1])], runs, strict=True)
        ),
    )
    return Report(
        root=root,
        goodput=max(0.0, wall - badput.total) / wall if wall > 0 else 0.0,
        wall_s=wall,
        badput_s=badput,
        restarts=restarts,
        saves=saves,
        storage=_storage(runs, scheme, now_bytes, sum(r.objects for r in events)),
        daly=_daly(runs, wall, saves),
        runs=len(runs),
        timeline=timeline,
    )


def _stored_bytes(storage: Storage) -> int | None:
    """Bytes of the steps committed under the root now (their markers), or None."""
    from jaxckpt.commit import CommitProtocol

    try:
        return sum(m.nbytes for m in CommitProtocol(storage).committed().values())
    except Exception:  # a root without steps, or one the reader does not know
        return None


def report(root: str, *, storage_options: Mapping[str, Any] | None = None) -> Report:
    """The goodput report of the runs recorded under ``root`` (its run ledger).

    Args:
      root: the durable root (a local path, ``gs://`` or ``s3://``).
      storage_options: object-store options (as ``CheckpointOptions.storage_options``).

    Returns:
      The :class:`Report`; ``to_json()`` gives ``goodput``, ``wall_s``, ``badput_s``
      (``save_blocking``, ``restore``, ``lost_work``, ``startup``), ``restarts`` (each
      ``restored_step``, ``reached_step``, ``lost_steps``, ``lost_s``, ``tier``),
      ``saves``, ``storage`` and ``daly``.

    Raises:
      StorageError: the store failed.

    >>> import tempfile, jaxckpt
    >>> root = tempfile.mkdtemp()
    >>> with jaxckpt.CheckpointManager(root) as mgr:
    ...     mgr.save(1, {"w": 1.0})
    True
    >>> r = jaxckpt.report(root)
    >>> sorted(r.to_json()), r.saves["count"], r.restarts
    (['badput_s', 'daly', 'goodput', 'restarts', 'saves', 'storage', 'wall_s'], 1, ())
    """
    storage = open_storage(root, storage_options)
    events = read_ledger(storage)
    scheme = storage.uri.partition("://")[0] if "://" in storage.uri else "file"
    return build_report(storage.uri, events, now_bytes=_stored_bytes(storage), scheme=scheme)
