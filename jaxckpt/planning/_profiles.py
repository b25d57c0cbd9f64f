"""Per-process counts of the cluster-scale model, as formulas in the process count N.

Counts per process are formulas ``a + b*N`` (:class:`Linear`) of the process
count N, one set per phase (a save until its manager is closed, a restore
likewise) and role (the primary; every other process): metadata reads (GET,
HEAD and LIST of records, manifest parts, markers, listings), metadata writes
(PUT, DELETE), manifest parts read, bytes of per-process summaries read, and
coordination-service calls. A :class:`Profile` holds one set:

* ``measured`` (the default of ``jaxckpt plan``): the current format's counts, fit
  (:func:`fit_profile`) to the ``python scripts/bench.py scale --json`` report shipped
  with the package (:mod:`jaxckpt.planning._measured`); any run's report fits the same;
* ``before``, kept for comparison: fit by least squares to ``bench.py scale`` at 2, 4,
  8 and 16 real processes of the code before format 4 (:data:`BEFORE`, 2026-12-04);
* ``target``: the protocol format 4 was built to: every count constant per
  process; the primary gathers one small summary per process
  (:data:`SUMMARY_BYTES`) through the coordination service; a restore reads its
  own manifest part and one more (the part holding its replicated chunks).

Pure: no jax, no I/O. The model that uses them is :mod:`jaxckpt.planning._scale`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["METRICS", "PHASES", "PROFILES", "ROLES", "Linear", "Profile", "fit_profile"]

METRICS = ("meta_reads", "meta_writes", "parts_read", "summary_bytes", "coordination_calls")
PHASES = ("save", "restore")
ROLES = ("primary", "other")

SUMMARY_BYTES = 256
"""A per-process summary of the target protocol: pack names, sizes, the part's CRC32C."""


RETRY_BUDGET_BEFORE_S = 16.0
"""How long retries waited at most before they were bounded by a deadline (the ``before``
profile): 6 attempts, 0.5-8 s backoff."""
RETRY_DEADLINE_S = 600.0
"""How long retries wait now: until the save's or restore's deadline (``save_timeout_s``,
600 s by default; ``storage/_retry.py``)."""


@dataclass(frozen=True, kw_only=True)
class Linear:
    """``a + b * N``; with ``until``, ``a + b * min(N, until)`` (a count that stops growing,
    such as the hashed prefixes a commit lists: at most 32)."""

    a: float
    b: float = 0.0
    until: float | None = None

    def at(self, n: float) -> float:
        """The value at ``n`` processes (never below 0)."""
        if self.until is not None:
            n = min(n, self.until)
        return max(0.0, self.a + self.b * n)

    def __str__(self) -> str:
        if not self.b:
            return f"{self.a:.3g}"
        line = f"{self.a:.3g} {'+' if self.b >= 0 else '-'} {abs(self.b):.3g}·N"
        return line if self.until is None else f"{line} (N ≤ {self.until:g})"


Formulas = Mapping[str, Mapping[str, Mapping[str, Linear]]]
"""``formulas[phase][role][metric]``."""


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Per-process counts as formulas in N, and where they come from."""

    name: str
    source: str
    formulas: Formulas
    retry_budget_s: float = RETRY_DEADLINE_S
    """How long its retries wait out throttling before a phase fails."""

    def value(self, phase: str, role: str, metric: str, n: int) -> float:
        return self.formulas[phase][role][metric].at(n)


def _table(rows: dict[str, dict[str, tuple[float, float]]]) -> dict[str, dict[str, Linear]]:
    return {role: {m: Linear(a=a, b=b) for m, (a, b) in row.items()} for role, row in rows.items()}


BEFORE = Profile(
    name="before",
    source="least-squares fit of a + b*N to `python scripts/bench.py scale` at 2, 4, 8 and 16 "
    "processes of the code before format 4, kept for comparison (main a05940e, 2026-12-04; "
    "every count lay exactly on its line)",
    retry_budget_s=RETRY_BUDGET_BEFORE_S,
    formulas={
        "save": _table(
            {
                "primary": {
                    "meta_reads": (4.0, 1.0),  # the commit reads the N - 1 other parts
                    "meta_writes": (8.0, 0.0),
                    "parts_read": (-1.0, 1.0),
                    "summary_bytes": (0.0, 0.0),
                    "coordination_calls": (5.0, 1.0),  # closing reads N keys
                },
                "other": {
                    "meta_reads": (4.0, 0.0),
                    "meta_writes": (1.0, 0.0),
                    "parts_read": (0.0, 0.0),
                    "summary_bytes": (0.0, 0.0),
                    "coordination_calls": (4.0, 0.0),
                },
            }
        ),
        "restore": _table(
            {
                "primary": {
                    "meta_reads": (5.0, 1.0),  # every manifest part
                    "meta_writes": (0.0, 0.0),
                    "parts_read": (0.0, 1.0),
                    "summary_bytes": (0.0, 0.0),
                    "coordination_calls": (5.0, 2.0),  # a gather and the close: N keys each
                },
                "other": {
                    "meta_reads": (1.0, 1.0),
                    "meta_writes": (0.0, 0.0),
                    "parts_read": (0.0, 1.0),
                    "summary_bytes": (0.0, 0.0),
                    "coordination_calls": (4.0, 1.0),  # a gather reads N keys
                },
            }
        ),
    },
)

TARGET = Profile(
    name="target",
    source="the target format 4 was built to, derived from its protocol: the constant terms; "
    f"the commit gathers a {SUMMARY_BYTES} B summary per process through one directory read "
    "instead of reading parts; a restore reads its own part and one more; a gather is a "
    "set, a barrier and one directory read",
    formulas={
        "save": _table(
            {
                "primary": {
                    "meta_reads": (5.0, 0.0),
                    "meta_writes": (8.0, 0.0),
                    "parts_read": (0.0, 0.0),
                    "summary_bytes": (0.0, SUMMARY_BYTES),
                    "coordination_calls": (7.0, 0.0),
                },
                "other": {
                    "meta_reads": (4.0, 0.0),
                    "meta_writes": (1.0, 0.0),
                    "parts_read": (0.0, 0.0),
                    "summary_bytes": (0.0, 0.0),
                    "coordination_calls": (5.0, 0.0),
                },
            }
        ),
        "restore": _table(
            {
                "primary": {
                    "meta_reads": (7.0, 0.0),
                    "meta_writes": (0.0, 0.0),
                    "parts_read": (2.0, 0.0),
                    "summary_bytes": (0.0, 0.0),
                    "coordination_calls": (9.0, 0.0),
                },
                "other": {
                    "meta_reads": (3.0, 0.0),
                    "meta_writes": (0.0, 0.0),
                    "parts_read": (2.0, 0.0),
                    "summary_bytes": (0.0, 0.0),
                    "coordination_calls": (7.0, 0.0),
                },
            }
        ),
    },
)

PROFILES = {p.name: p for p in (BEFORE, TARGET)}


def _fit(points: Iterable[tuple[float, float]]) -> Linear:
    """Least squares ``a + b*N`` through ``(N, value)`` points (a constant for one N)."""
    pts = list(points)
    if not pts:
        raise ValueError("no measured points to fit")
    mean_n = sum(n for n, _ in pts) / len(pts)
    mean_v = sum(v for _, v in pts) / len(pts)
    spread = sum((n - mean_n) ** 2 for n, _ in pts)
    if spread == 0:
        return Linear(a=mean_v)
    b = sum((n - mean_n) * (v - mean_v) for n, v in pts) / spread
    values = [v for _, v in pts]
    if max(values) - min(values) <= 1:  # within one count across the measured N: a constant
        return Linear(a=round(mean_v, 3))
    return Linear(a=round(mean_v - b * mean_n, 3), b=round(b, 3))


def fit_profile(report: Mapping[str, Any], name: str = "measured") -> Profile:
    """A profile fit to a ``scripts/bench.py scale --json`` report (least squares per count).

    >>> run = lambda n, k: {"processes": n, "summary": {p: {r: {
    ...     "meta_reads": k, "meta_writes": 1, "manifest_gets": n, "coordination_calls": 2 * n}
    ...     for r in ("primary", "others_max")} for p in ("save", "restore")}}
    >>> f = fit_profile({"runs": [run(2, 5), run(4, 7)]}).formulas["restore"]["other"]
    >>> str(f["meta_reads"]), str(f["parts_read"]), str(f["coordination_calls"])
    ('3 + 1·N', '0 + 1·N', '0 + 2·N')
    """
    runs = list(report.get("runs", ()))
    if not runs:
        raise ValueError("the report has no runs")
    keys = {
        "meta_reads": "meta_reads",
        "meta_writes": "meta_writes",
        "parts_read": "manifest_gets",
        "coordination_calls": "coordination_calls",
    }
    formulas: dict[str, dict[str, dict[str, Linear]]] = {}
    for phase in PHASES:
        formulas[phase] = {}
        for role, measured in (("primary", "primary"), ("other", "others_max")):
            row = {
                metric: _fit(
                    (float(r["processes"]), float(r["summary"][phase][measured][key])) for r in runs
                )
                for metric, key in keys.items()
            }
            row["summary_bytes"] = Linear(a=0.0)
            formulas[phase][role] = row
    ns = sorted(int(r["processes"]) for r in runs)
    return Profile(
        name=name,
        source=f"least-squares fit of a + b*N to a scale report at {ns} processes",
        formulas=formulas,
    )
