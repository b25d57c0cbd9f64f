"""Shared constants, the cases and the run settings (no jax here)."""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent
RESULT_MARK = "BENCH-RESULT "
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
GB = 1e9
KEEP_BYTES = 3 * GiB  # scratch kept on disk within a case (see Scratch)
CONTENDERS = ("raw", "jaxckpt", "jaxckpt-packed", "orbax")
# jaxckpt-packed: CheckpointOptions(layout="packed"), a few pack objects per
# process instead of two files per leaf; local save + restore rounds only.
PACKED_OPTIONS = {"layout": "packed"}
LOOP_CONTENDERS = ("raw", "jaxckpt", "orbax", "jaxckpt-nice")
# jaxckpt-nice: the background save's threads at nice WRITER_NICE.
WRITER_NICE = 10
STORE_CONTENDERS = (
    "raw-s3",
    "jaxckpt-s3",
    "jaxckpt-s3-ts",
    "jaxckpt-s3-lowmem",
    "raw-gcs",
    "jaxckpt-gcs",
    "jaxckpt-gcs-ts",
)
# jaxckpt-*-ts: restores read through TensorStore (direct_reads=False), as before the
# direct HTTP reads; jaxckpt-*-lowmem: the restore memory budget lowered for small-RAM hosts.
LOWMEM_RESTORE_BYTES = 8 * MiB  # CheckpointOptions.restore_memory_bytes (default 16 MiB)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """A state to save: ``leaves`` float32 arrays of ``leaf_bytes`` each."""

    name: str
    kind: str  # "few-big" or "many-small": which targets apply
    leaves: int
    leaf_bytes: int

    @property
    def nbytes(self) -> int:
        return self.leaves * self.leaf_bytes

    @property
    def label(self) -> str:
        return f"{self.name}: {self.leaves:,} × {_size(self.leaf_bytes)} = {_size(self.nbytes)}"


CASES = {
    c.name: c
    for c in (
        Case(name="big", kind="few-big", leaves=16, leaf_bytes=64 * MiB),
        Case(name="small", kind="many-small", leaves=1000, leaf_bytes=64 * KiB),
        Case(name="huge", kind="few-big", leaves=16, leaf_bytes=256 * MiB),
        Case(name="store", kind="few-big", leaves=16, leaf_bytes=16 * MiB),
        Case(name="tiny-big", kind="few-big", leaves=4, leaf_bytes=1 * MiB),
        Case(name="tiny-small", kind="many-small", leaves=40, leaf_bytes=16 * KiB),
    )
}
DEFAULT_CASES = "big,small,huge"
TINY_CASES = "tiny-big,tiny-small"


def io_contenders(case: Case) -> tuple[str, ...]:
    """The save + restore contenders of ``case``: all, but the smoke test's tiny few-big
    case skips ``jaxckpt-packed`` (test time; tiny-small runs it)."""
    if case.name.startswith("tiny") and case.kind != "many-small":
        return tuple(c for c in CONTENDERS if c != "jaxckpt-packed")
    return CONTENDERS


def _size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


# --------------------------------------------------------------------------------------------
# Child side: state, contenders, memory probe, measurements. Imports jax lazily.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    cases: tuple[Case, ...]
    repeats: int
    out: Path
    root: Path
    cold_cache: bool
    object_stores: bool
    stores_only: bool
    object_store_max_bytes: int
    loop_saves: int
    loop_min_interval_s: float
    loop_max_bytes: int
    jaxckpt_options: dict[str, Any]


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _ok(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [x for x in samples if "error" not in x]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is not positive."""
    return a / b if a is not None and b is not None and b > 0 else None


def write_json_rows(path: str | None, rows: Any) -> None:
    """Writes a part's rows as indented JSON to ``path`` (its ``--json``), if given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rows, indent=1) + "\n")
