"""Per-process storage requests, metadata bytes and coordination calls, 2 vs 4 real processes.

Counted, not timed: ``scripts/bench.py scale --processes 2,4`` (``benchkit/scale.py``):
two groups of real JAX processes (1 CPU device each, gloo) save and restore one
sharded step (the same bytes per process) on a loopback moto, every process
through a counting proxy of its own.
The assertions are issue 35's targets for both the save (until its manager is
closed) and the restore (likewise):

* storage requests and coordination-service calls per process within 1.5x from
  2 to 16 processes, for the primary (process 0) and the busiest other process.
  Measured at 2 and 4 and extrapolated on the line through them (a protocol's
  count per process is ``a + b*N``: N-sized gathers and reads of every part are
  ``b > 0``); a bound of 1.5x between 2 and 4 alone would pass today's O(N)
  counts (a restore's 5 requests at 2 processes, 7 at 4, 19 at 16);
* the primary's metadata bytes read grow at most linearly in N;
* every other process's metadata bytes read stay constant (within 1.2x: the
  same records differ by a few digits between runs: times, offsets, indices).

Every assertion holds since issue 35's items 1 and 2: a restoring host reads its own
manifest part and those of the writers of chunks it needs (not every part), and the
commit checks the other processes' part summaries, gathered with the save's agreement,
against one listing (it reads no other part).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from benchkit import scale
from benchkit.scale_child import PHASES as CHILD_PHASES
from benchkit.shaper import Exchange, ResponseCounter
from triggers import SCRIPT_HANG_S

pytestmark = pytest.mark.timeout(SCRIPT_HANG_S + 300)

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"
PHASES = ("save", "restore")
ROLES = ("primary", "others_max")
GROWTH = 1.5  # the bound on per-process counts from 2 to 16 processes
SAME = 1.2  # "constant": the same records, a few digits apart


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """``bench.py scale`` at 2 and 4 processes (each child checks its restore), by N."""
    out = tmp_path_factory.mktemp("scale") / "bench_scale.json"
    argv = ["--processes", "2,4", "--leaves", "4", "--leaf-kib", "16", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "scale", *argv],
        capture_output=True,
        text=True,
        timeout=SCRIPT_HANG_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(proc.stdout)  # the table, shown with -s or on a failure
    assert "| N | phase | requests/process P0 / others |" in proc.stdout
    report = json.loads(out.read_text())
    assert report["config"]["leaves"] == 4
    return {run["processes"]: run for run in report["runs"]}


def figure(runs: dict[int, Any], n: int, phase: str, role: str, key: str) -> int:
    return int(runs[n]["summary"][phase][role][key])


def at_16(two: int, four: int) -> float:
    """The count at 16 processes on the line through the counts at 2 and 4."""
    return four + (16 - 4) / (4 - 2) * (four - two)


def test_every_process_saved_and_restored_through_its_own_proxy(measured: dict[int, Any]) -> None:
    """Each process wrote and read its own data through its proxy, and nothing fell outside
    the phases (each child checked its restored values before it reported)."""
    for n, run in measured.items():
        assert len(run["per_process"]) == n
        for p, phases in enumerate(run["per_process"]):
            for phase in PHASES:
                assert phases[phase]["data_requests"] >= 1, (n, p, phase, phases[phase])
            assert set(phases) <= set(CHILD_PHASES), (n, p, sorted(phases))


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("phase", PHASES)
def test_storage_requests_per_process_within_1_5x(
    measured: dict[int, Any], phase: str, role: str
) -> None:
    """Apart from the primary's save listings: its commit lists one hashed prefix per slot
    the processes used, one more per process up to 32, a bound whatever N (the test below)."""

    def requests(n: int) -> int:
        counts = measured[n]["summary"][phase][role]
        lists = counts["requests"]["LIST"] if (phase, role) == ("save", "primary") else 0
        return int(counts["total_requests"]) - int(lists)

    two, four = requests(2), requests(4)
    assert at_16(two, four) <= GROWTH * two, (
        f"{phase} {role}: {two} requests at 2 processes, {four} at 4, {at_16(two, four):g} at 16"
    )


def test_the_commit_lists_at_most_the_attempts_32_prefixes_whatever_the_process_count(
    measured: dict[int, Any],
) -> None:
    """The primary's save lists the protocol's prefixes (markers, writers), the attempt's
    own and the hashed ones its parts and packs can have used: more with more processes,
    never more than its 32 (at 8,192 processes too)."""
    from jaxckpt.records import SPREAD_SLOTS

    lists = {n: measured[n]["summary"]["save"]["primary"]["requests"]["LIST"] for n in (2, 4)}
    assert lists[2] <= lists[4] <= 3 + 1 + SPREAD_SLOTS, lists


def calls(runs: dict[int, Any], n: int, phase: str, role: str) -> int:
    """Coordination calls of one phase of the child (``close`` apart from the step's save)."""
    counts = [p[phase]["coordination_calls"] for p in runs[n]["per_process"]]
    return counts[0] if role == "primary" else max(counts[1:])


@pytest.mark.parametrize("role", ["primary", "others_max"])
@pytest.mark.parametrize("phase", ["save", "restore"])
def test_coordination_calls_per_process_within_1_5x(
    measured: dict[int, Any], phase: str, role: str
) -> None:
    """A save (until committed) and a restore: the same calls per process whatever N."""
    two, four = (calls(measured, n, phase, role) for n in (2, 4))
    assert at_16(two, four) <= GROWTH * two, (
        f"{phase} {role}: {two} calls at 2 processes, {four} at 4, {at_16(two, four):g} at 16"
    )


@pytest.mark.parametrize("phase", ["close", "close2"])
def test_closing_a_manager_costs_every_process_at_most_three_calls(
    measured: dict[int, Any], phase: str
) -> None:
    """Once per manager: say it closed, read who has, and the last one deletes the keys."""
    for n in (2, 4):
        counts = [p[phase]["coordination_calls"] for p in measured[n]["per_process"]]
        assert max(counts) <= 3, (n, phase, counts)


@pytest.mark.parametrize("phase", PHASES)
def test_primary_metadata_bytes_grow_at_most_linearly(measured: dict[int, Any], phase: str) -> None:
    two, four = (figure(measured, n, phase, "primary", "meta_bytes_read") for n in (2, 4))
    assert four <= two * 4 / 2, f"{phase}: the primary read {two} B at 2 processes, {four} B at 4"


@pytest.mark.parametrize("phase", PHASES)
def test_other_processes_metadata_bytes_stay_constant(measured: dict[int, Any], phase: str) -> None:
    two, four = (figure(measured, n, phase, "others_max", "meta_bytes_read") for n in (2, 4))
    assert four <= SAME * two, f"{phase}: another process read {two} B at 2 processes, {four} at 4"


# -- the counting itself -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "target", "expected"),
    [
        ("GET", "/b?list-type=2&prefix=run%2Fcommits%2F", ("LIST", "meta", "run/commits/")),
        ("GET", "/b/run/attempts/1/e1-2-ab/packs/3.0.bin", ("GET", "data", "")),
        ("GET", "/b/run/attempts/1/e1-2-ab/manifest/3.json", ("GET", "meta", "")),
        ("PUT", "/b/run/attempts/1/e1-2-ab/arrays/w/c/0/1", ("PUT", "data", "")),
        ("PUT", "/b/run/attempts/1/e1-2-ab/arrays/w/zarr.json", ("PUT", "meta", "")),
        ("HEAD", "/b/run/commits/000000000001.e1.json", ("HEAD", "meta", "")),
        ("POST", "/b?delete", ("DELETE", "meta", "")),
        ("DELETE", "/b/run/pending/1/e1-2-ab.json", ("DELETE", "meta", "")),
    ],
)
def test_requests_are_told_by_kind_and_key(
    method: str, target: str, expected: tuple[str, str, str]
) -> None:
    kind, cls, key = scale.classify(Exchange(started=0.0, method=method, target=target))
    assert (kind, cls) == expected[:2]
    if expected[2]:
        assert key == expected[2]


def test_response_bodies_are_counted_per_request() -> None:
    """Content-Length, HEAD, 204, a 100 Continue, chunked and until-close bodies."""
    import collections

    xs = [Exchange(started=0.0, method=m, target="/b/k") for m in ("PUT", "GET", "HEAD", "DELETE")]
    xs += [Exchange(started=0.0, method="GET", target="/b/k") for _ in range(2)]
    pending = collections.deque(xs)
    counter = ResponseCounter(pending)
    stream = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        b"HTTP/1.1 206 Partial\r\nContent-Length: 11\r\n\r\nhello world"
        b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n"
        b"HTTP/1.1 204 No Content\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcde\r\n0\r\n\r\n"
        b"HTTP/1.1 404 Not Found\r\n\r\nno length: until close"
    )
    for i in range(0, len(stream), 7):  # fed in pieces, as a socket delivers it
        counter.feed(stream[i : i + 7])
    assert [x.status for x in xs] == [200, 206, 200, 204, 200, 404]
    assert [x.received for x in xs[:4]] == [0, 11, 0, 0]
    assert xs[4].received == len(b"5\r\nabcde\r\n0\r\n\r\n")
    assert xs[5].received == len(b"no length: until close")
    assert not pending


def test_phases_are_windows_between_the_childs_stamps() -> None:
    stamps = {"open": 1.0, "save": 2.0, "close": 3.0, "end": 4.0}
    assert [scale._phase_of(t, stamps) for t in (0.5, 1.0, 2.5, 3.9, 4.0)] == [
        "before",
        "open",
        "save",
        "close",
        "after",
    ]
