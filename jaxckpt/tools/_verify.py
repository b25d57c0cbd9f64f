"""Verifying a committed step: every chunk re-read and checked against the manifest."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import tensorstore as ts

from jaxckpt.commit import CommitProtocol
from jaxckpt.errors import CheckpointError
from jaxckpt.formats import check_chunks, expected_chunk_count, zarr_metadata
from jaxckpt.records import SavedLeaf
from jaxckpt.restoring import LoadedStep, dotted_path, load_step


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One thing wrong with a step: the tree path, the chunk (if any), what.

    ``path`` is the ``jax.tree_util.keystr`` form (as ``rename=`` takes it),
    ``dotted`` the dotted form the command line prints.
    """

    path: str
    chunk: str | None
    message: str
    dotted: str = ""

    def __str__(self) -> str:
        where = f"{self.path} chunk {self.chunk}" if self.chunk else self.path
        return f"{where}: {self.message}"


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """The result of :meth:`jaxckpt.CheckpointManager.verify`."""

    step: int
    ok: bool
    problems: tuple[Problem, ...]
    chunks_checked: int
    bytes_checked: int


def verify_step(
    protocol: CommitProtocol,
    context: ts.Context,
    step: int,
    *,
    on_progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Re-reads every record and chunk of ``step`` and checks sizes and CRC32C.

    Args:
      on_progress: called with the number of bytes of each chunk checked.

    Raises:
      StepNotFoundError / UncommittedStepError: no committed ``step``.
    """
    marker = protocol.require_marker(step)
    problems: list[Problem] = []
    try:
        loaded = load_step(protocol, marker)
    except CheckpointError as e:
        return VerifyReport(
            step=step,
            ok=False,
            problems=(Problem(path="<records>", chunk=None, message=str(e), dotted="<records>"),),
            chunks_checked=0,
            bytes_checked=0,
        )
    chunks_checked = bytes_checked = 0
    # A multi-host job's local tier commits one host's part: it lists that host's chunks only.
    whole = marker.every_process
    for leaf in loaded.leaves:
        if leaf.kind == "value" or leaf.name is None:
            continue
        if loaded.format.zarr_arrays:  # else the arrays' metadata is in tree.json only
            problems.extend(_check_array_metadata(protocol, loaded, leaf))
        chunks = loaded.chunks.get(leaf.name, ())
        expected = expected_chunk_count(leaf)
        if whole and len({c.key for c in chunks}) != expected:
            problems.append(
                Problem(
                    path=leaf.path_text,
                    chunk=None,
                    message=f"manifest lists {len(chunks)} chunks, the array has {expected}",
                    dotted=dotted_path(leaf),
                )
            )
        for chunk, problem, nbytes in check_chunks(
            protocol.storage, context, marker.location, leaf, chunks
        ):
            chunks_checked += 1
            bytes_checked += nbytes
            if on_progress is not None:
                on_progress(nbytes)
            if problem is not None:
                problems.append(
                    Problem(
                        path=leaf.path_text,
                        chunk=chunk.key,
                        message=problem,
                        dotted=dotted_path(leaf),
                    )
                )
    return VerifyReport(
        step=step,
        ok=not problems,
        problems=tuple(problems),
        chunks_checked=chunks_checked,
        bytes_checked=bytes_checked,
    )


def _check_array_metadata(
    protocol: CommitProtocol, loaded: LoadedStep, leaf: SavedLeaf
) -> list[Problem]:
    assert leaf.name is not None
    key = loaded.marker.location.array_prefix(leaf.name) + "zarr.json"
    problem = None
    for _ in range(2):  # a byte flipped in transit fails once, stored damage twice
        problem = _metadata_problem(protocol.storage.read(key), leaf, protocol.where(key))
        if problem is None:
            return []
    return [
        Problem(path=leaf.path_text, chunk=None, message=str(problem), dotted=dotted_path(leaf))
    ]


def _metadata_problem(raw: bytes | None, leaf: SavedLeaf, where: str) -> str | None:
    """What is wrong with an array's stored ``zarr.json`` (at ``where``), or None."""
    if raw is None:
        return f"{where} is missing"
    try:
        meta = json.loads(raw)
    except ValueError:
        return f"{where} is not JSON"
    expected = zarr_metadata(leaf)
    for field in ("shape", "data_type", "chunk_grid"):
        if meta.get(field) != expected[field]:
            return f"zarr.json {field} is {meta.get(field)!r}, expected {expected[field]!r}"
    return None
