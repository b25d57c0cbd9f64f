"""A step's ``process_state`` records described for people: kind, size, digest, preview.

``jaxckpt inspect`` shows them (and ``--json`` gives them), ``jaxckpt diff`` compares
them process by process: two records are the same when kind, size and CRC32C agree
(the CRC32C of the encoded value, which the record carries). A record that fails
its own check is shown as damaged, never decoded into a preview.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jaxckpt.errors import CorruptCheckpointError
from jaxckpt.records._procstate import decode

__all__ = ["StateSummary", "summaries"]

_PREVIEW = 60


@dataclass(frozen=True, kw_only=True)
class StateSummary:
    """One process's ``process_state`` record of a step."""

    process: int
    kind: str
    size: int
    crc32c: int
    preview: str
    damaged: str | None = None

    @property
    def digest(self) -> str:
        return f"crc32c:{self.crc32c:08x}"

    def describe(self) -> str:
        """``json, 45 B, crc32c:1a2b3c4d: {"epoch": 1, ...}``."""
        text = f"{self.kind}, {self.size:,} B, {self.digest}"
        return f"{text}: damaged ({self.damaged})" if self.damaged else f"{text}: {self.preview}"

    def same_as(self, other: StateSummary) -> bool:
        return (self.kind, self.size, self.crc32c) == (other.kind, other.size, other.crc32c)

    def as_json(self) -> dict[str, Any]:
        return {
            "process": self.process,
            "kind": self.kind,
            "size": self.size,
            "digest": self.digest,
            "preview": self.preview,
            "damaged": self.damaged,
        }


def _preview(kind: str, value: Any) -> str:
    if kind == "bytes":
        text = repr(bytes(value[: _PREVIEW // 2]))
        return text + ("..." if len(value) > _PREVIEW // 2 else "")
    text = value if kind == "str" else json.dumps(value, sort_keys=True)
    text = " ".join(str(text).split())
    return text if len(text) <= _PREVIEW else text[: _PREVIEW - 3] + "..."


def _number(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def summaries(records: Mapping[int, Any], step: int) -> list[StateSummary]:
    """The summaries of a step's records (process -> record), by process."""
    out = []
    for process in sorted(records):
        record = records[process]
        fields = record if isinstance(record, Mapping) else {}
        kind, size = str(fields.get("kind", "?")), _number(fields.get("size"))
        crc, damaged, preview = _number(fields.get("crc32c")), None, ""
        try:
            preview = _preview(kind, decode(record, f"step {step}: process {process}"))
        except CorruptCheckpointError as e:
            damaged = str(e)
        out.append(
            StateSummary(
                process=process,
                kind=kind,
                size=size,
                crc32c=crc & 0xFFFFFFFF,
                preview=preview,
                damaged=damaged,
            )
        )
    return out
