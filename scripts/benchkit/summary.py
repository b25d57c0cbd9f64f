"""Medians over repeats, and the targets each case is checked against."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

from benchkit.common import GB, Case, _median, _ok, _ratio
from benchkit.rounds import _pair_overhead


def summarize_io(samples: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    """Medians over the repeats; memory is the worst repeat."""
    ok = _ok(samples)
    out: dict[str, Any] = {
        "n": len(ok),
        "errors": [x["error"] for x in samples if "error" in x],
        "incorrect": sum(1 for x in ok if not x.get("correct", True)),
    }
    if not ok:
        return out
    commit = _median([x["commit_s"] for x in ok])
    restore = _median([x["restore_s"] for x in ok])
    out.update(
        blocking_s=_median([x["blocking_s"] for x in ok]),
        commit_s=commit,
        restore_s=restore,
        save_gbps=nbytes / commit / GB if commit else None,
        restore_gbps=nbytes / restore / GB if restore else None,
        save_rss=max(x["save_extra_rss"] for x in ok) / nbytes,
        restore_rss=max(x["restore_extra_rss"] for x in ok) / nbytes,
        stored_ratio=_median([x["stored_bytes"] / nbytes for x in ok]),
    )
    for phase in ("save", "restore"):
        counts = [x.get(f"{phase}_requests") for x in ok]
        if all(counts):
            out[f"{phase}_requests"] = _median([sum(c.values()) for c in counts if c])
            out[f"{phase}_requests_by_method"] = counts[0]
    return out


def summarize_loop(
    samples: dict[str, list[dict[str, Any]]], io: dict[str, Any], every: int, saves: int
) -> dict[str, Any]:
    """Overhead per save: the median over pairs of (saving − plain segment), then over repeats."""
    out: dict[str, Any] = {"every": every, "saves": saves}
    for contender, results in samples.items():
        ok = _ok(results)
        entry: dict[str, Any] = {
            "n": len(ok),
            "errors": [x["error"] for x in results if "error" in x],
        }
        if ok:
            entry.update(
                overhead_s_per_save=_median([_pair_overhead(x) for x in ok]),
                plain_segment_s=_median([statistics.median(x["plain_s"]) for x in ok]),
                blocking_s_in_loop=_median([statistics.median(x["blocking_s"]) for x in ok]),
                blocking_s_alone=io.get(contender, {}).get("blocking_s"),
            )
        out[contender] = entry
    return out


# ---- targets --------------------------------------------------------------------------------


def _get(summary: dict[str, Any], contender: str, key: str) -> float | None:
    return summary.get("io", {}).get(contender, {}).get(key)


def _vs(summary: dict[str, Any], key: str, other: str, mine: str = "jaxckpt") -> float | None:
    """``mine``'s ``key`` (jaxckpt's by default) divided by ``other``'s."""
    return _ratio(_get(summary, mine, key), _get(summary, other, key))


def _loop_ratio(summary: dict[str, Any]) -> float | None:
    loop = summary.get("loop", {}).get("jaxckpt", {})
    return _ratio(loop.get("overhead_s_per_save"), loop.get("blocking_s_alone"))


PACKED_SUFFIX = " (layout=packed)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """A goal for one ratio; ``kind`` is the case kind it applies to, or ``*``."""

    kind: str
    label: str
    measure: Callable[[dict[str, Any], str], float | None]  # (summary, contender)
    at_least: bool
    bound: float
    contender: str = "jaxckpt"
    loop: bool = False  # measured in the training loop, where jaxckpt-packed does not run

    @property
    def bound_text(self) -> str:
        """The bound as the report prints it, e.g. ``≥ 0.9×``."""
        return f"{'≥' if self.at_least else '≤'} {self.bound:g}×"

    def for_packed(self) -> Target:
        """The same goal measured on the ``jaxckpt-packed`` contender."""
        return dataclasses.replace(
            self, label=self.label + PACKED_SUFFIX, contender="jaxckpt-packed"
        )

    def check(self, summary: dict[str, Any]) -> dict[str, Any]:
        value = self.measure(summary, self.contender)
        if value is None:
            verdict = "n/a"
        else:
            passed = value >= self.bound if self.at_least else value <= self.bound
            verdict = "PASS" if passed else "MISS"
        return {"target": self.label, "bound": self.bound_text, "value": value, "verdict": verdict}


TARGETS = (
    Target(
        kind="few-big",
        label="save throughput vs raw write+fsync",
        measure=lambda s, c: _vs(s, "save_gbps", "raw", c),
        at_least=True,
        bound=0.85,
    ),
    Target(
        kind="few-big",
        label="restore throughput vs Orbax",
        measure=lambda s, c: _vs(s, "restore_gbps", "orbax", c),
        at_least=True,
        bound=1.5,
    ),
    Target(  # save throughput against raw writes
        kind="many-small",
        label="save throughput vs raw write+fsync",
        measure=lambda s, c: _vs(s, "save_gbps", "raw", c),
        at_least=True,
        bound=0.9,
    ),
    Target(
        kind="many-small",
        label="save throughput vs Orbax",
        measure=lambda s, c: _vs(s, "save_gbps", "orbax", c),
        at_least=True,
        bound=2.0,
    ),
    Target(
        kind="many-small",
        label="restore throughput vs Orbax",
        measure=lambda s, c: _vs(s, "restore_gbps", "orbax", c),
        at_least=True,
        bound=2.0,
    ),
    Target(
        kind="*",
        label="blocking time vs Orbax",
        measure=lambda s, c: _vs(s, "blocking_s", "orbax", c),
        at_least=False,
        bound=1.0,
    ),
    Target(
        kind="*",
        label="peak extra RSS during save / state",
        measure=lambda s, c: _get(s, c, "save_rss"),
        at_least=False,
        bound=1.25,
    ),
    Target(
        kind="*",
        label="training-loop overhead / blocking alone",
        measure=lambda s, c: _loop_ratio(s),
        loop=True,
        at_least=False,
        bound=1.5,
    ),
)


# The packed layout against the same goals (its own rounds only: not in the training loop).
PACKED_TARGETS = tuple(t.for_packed() for t in TARGETS if not t.loop)


def check_targets(case: Case, summary: dict[str, Any]) -> list[dict[str, Any]]:
    targets = [t for t in TARGETS if t.kind in ("*", case.kind)]
    if summary.get("io", {}).get("jaxckpt-packed", {}).get("n"):
        targets += [t for t in PACKED_TARGETS if t.kind in ("*", case.kind)]
    return [t.check(summary) for t in targets]


# ---- machine --------------------------------------------------------------------------------
