"""The time floors of ``jaxckpt plan --devices --leaves``, computed by hand for two states."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest

from jaxckpt import cli as jaxckpt_cli
from jaxckpt.formats import FORMATS, DataFormat
from jaxckpt.planning import (
    PROFILES,
    Link,
    _costs,
    floor,
    floors,
    object_plan,
    process_share,
    scale_plan,
)
from jaxckpt.records import ProcessShare, SaveRequests, pack_count

MiB, KiB = 1 << 20, 1 << 10
CONN, RTT, HOST = 85e6, 0.020, 1.25e9  # the defaults: AWS's guidance, a 10 Gb/s NIC


def test_link_defaults_are_the_documented_ones() -> None:
    link = Link()
    assert (link.conn_bytes_per_s, link.rtt_s, link.host_bytes_per_s) == (CONN, RTT, HOST)
    assert link.connections == 32  # ObjectStoreOptions.request_concurrency


def test_floors_of_sixteen_big_leaves_on_one_host() -> None:
    # 16 leaves of 16 MiB over 8 devices of one process: 128 chunks of 2 MiB; 16 packs
    # (objects_in_flight) of 16 MiB (pack_count: none under 4 MiB, none over 64 MiB).
    share = process_share(checkpoint_bytes=16 * 16 * MiB, leaves=16, devices=8)
    assert (share.processes, share.chunks, share.chunk_bytes, share.packs) == (1, 128, 2 * MiB, 16)
    f = floors(share, leaves=16)
    nbytes = 256 * MiB
    # plain save: 128 chunks + 1 manifest + 16 zarr.json + 6 records = 151 requests, 32 at
    # once (512 MiB of 2 MiB chunks allow 256): 5 waves; 32 x 85 MB/s > the 1.25 GB/s host;
    # plus the save's 4 other sequential round trips.
    plain = f["plain"]
    assert (plain.save_requests_per_process, plain.save_in_flight) == (151, 32)
    assert plain.save_floor_s == pytest.approx(4 * RTT + 5 * RTT + nbytes / HOST)
    assert plain.save_bound == "host bandwidth"
    # plain restore: 128 GETs, 16 at once (objects_in_flight): 8 waves; 16 x 85 MB/s > the
    # host; before them the hint, the marker, and the tree with the manifest part.
    assert (plain.restore_requests_per_process, plain.restore_in_flight) == (128, 16)
    assert plain.restore_floor_s == pytest.approx(3 * RTT + 8 * RTT + nbytes / HOST)
    # packed save: 16 packs, all in flight: 1 wave, at the host's rate; 3 other round trips.
    packed = f["packed"]
    assert (packed.objects_per_process, packed.save_in_flight) == (17, 16)
    assert packed.save_floor_s == pytest.approx(3 * RTT + RTT + nbytes / HOST)
    assert packed.save_floor_s == pytest.approx(0.2947, abs=1e-4)
    assert packed.save_bound == "host bandwidth"
    # packed restore: spans of up to 9/8 of 256 MiB / 16 (18 MiB) hold a pack's 8 aligned
    # chunks of 2 MiB + 4 B: 16 GETs, 16 at once, 1 wave.
    assert (packed.restore_requests_per_process, packed.restore_in_flight) == (16, 16)
    assert packed.restore_floor_s == pytest.approx(3 * RTT + RTT + nbytes / HOST)


def test_floors_of_a_thousand_small_leaves_are_round_trips_in_plain() -> None:
    share = process_share(checkpoint_bytes=1000 * 16 * KiB, leaves=1000, devices=8)
    assert (share.chunks, share.chunk_bytes, share.packs) == (8000, 2 * KiB, 4)  # 4 MiB packs
    f = floors(share, leaves=1000)
    nbytes = 1000 * 16 * KiB
    plain, packed = f["plain"], f["packed"]
    # 8,000 chunks + 1,000 zarr.json + 7: 9,007 writes, 32 at once: 282 waves.
    assert plain.save_requests_per_process == 9007
    assert plain.save_floor_s == pytest.approx(4 * RTT + 282 * RTT + nbytes / HOST)
    # 8,000 GETs, 16 at once: 500 waves.
    assert plain.restore_floor_s == pytest.approx(3 * RTT + 500 * RTT + nbytes / HOST)
    assert plain.save_bound == plain.restore_bound == "request round trips"
    # 4 packs on 4 connections; restore spans of 9/8 of 16,416,000 B / 16 (1,154,250 B)
    # hold 546 chunks of 2,052 B at a stride of 2,112: 4 per pack of 2,000 chunks, 16 GETs.
    assert packed.save_in_flight == 4
    assert packed.save_floor_s == pytest.approx(3 * RTT + RTT + nbytes / (4 * CONN))
    assert packed.restore_requests_per_process == 16
    assert packed.restore_floor_s == pytest.approx(3 * RTT + RTT + nbytes / HOST)
    assert plain.restore_floor_s / packed.restore_floor_s > 80


def test_floors_follow_the_options_and_the_packed_layouts_sizing() -> None:
    # 2 GiB on one host: packs of at most max_object_bytes, objects_in_flight at once.
    share = process_share(checkpoint_bytes=2 << 30, leaves=8, devices=8)
    assert share.packs == pack_count(2 << 30, max_object_bytes=64 << 20) == 32
    capped = process_share(checkpoint_bytes=2 << 30, leaves=8, devices=8, max_object_bytes=16 << 20)
    assert capped.packs == 128 and capped.chunk_bytes <= (16 << 20) - 4  # chunks bounded too
    fewer = process_share(checkpoint_bytes=2 << 30, leaves=8, devices=8, objects_in_flight=4)
    assert (fewer.packs, fewer.objects_in_flight) == (32, 4)
    wide, narrow = floors(share, leaves=8)["packed"], floors(fewer, leaves=8)["packed"]
    assert (wide.save_in_flight, narrow.save_in_flight) == (16, 4)
    assert narrow.save_floor_s > 3 * wide.save_floor_s  # 4 x 85 MB/s against the 1.25 GB/s NIC
    with pytest.raises(ValueError, match="objects_in_flight"):
        process_share(checkpoint_bytes=1e9, leaves=8, devices=8, objects_in_flight=0)


def test_restore_floor_does_not_grow_with_the_number_of_processes() -> None:
    one = floors(process_share(checkpoint_bytes=8e9, leaves=100, devices=8), leaves=100)
    many = floors(process_share(checkpoint_bytes=64 * 8e9, leaves=100, devices=512), leaves=100)
    # the same bytes per process; the 64 manifest parts are read at once
    assert many["packed"].restore_floor_s == pytest.approx(one["packed"].restore_floor_s)
    assert many["plain"].save_floor_s == pytest.approx(one["plain"].save_floor_s)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("conn_bytes_per_s", 0.0),
        ("rtt_s", -1.0),
        ("host_bytes_per_s", math.inf),
        ("connections", 0),
    ],
)
def test_link_rejects_bad_values(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        Link(**{field: value})  # type: ignore[arg-type]


ARGV = [
    "plan",
    "--params=1B",
    "--bytes-per-param=4",
    "--step-seconds=1",
    "--write-gbps=1",
    "--every-steps=100",
    "--mtbf-hours=24",
    "--gpus=8",
    "--gpu-hour-usd=2",
    "--devices=8",
    "--leaves=16",
]
FLOOR_KEYS = {
    "objects_per_process",
    "save_requests_per_process",
    "restore_requests_per_process",
    "save_in_flight",
    "restore_in_flight",
    "save_floor_s",
    "restore_floor_s",
    "save_bound",
    "restore_bound",
}


def test_cli_json_has_the_floors_per_layout_and_the_link(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert jaxckpt_cli.main([*ARGV, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out.keys() >= FLOOR_KEYS
    for key in FLOOR_KEYS:
        assert set(out[key]) == {"plain", "packed"}, key
    assert out["link"] == {"conn_mbps": 85.0, "rtt_ms": 20.0, "host_gbps": 1.25, "connections": 32}
    expected = floors(process_share(checkpoint_bytes=4e9, leaves=16, devices=8), leaves=16)
    assert out["save_floor_s"]["packed"] == pytest.approx(expected["packed"].save_floor_s)
    assert out["restore_floor_s"]["plain"] == pytest.approx(expected["plain"].restore_floor_s)
    # 4 GB on one host in packs of at most 64 MiB: 60 packs, and a manifest part
    assert out["objects_per_process"]["packed"] == 60 + 1


def test_cli_options_change_the_link_and_the_text_names_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [*ARGV, "--conn-mbps=25", "--rtt-ms=50", "--host-gbps=0.2", "--connections=4"]
    argv += ["--objects-in-flight=8"]
    assert jaxckpt_cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["link"] == {"conn_mbps": 25.0, "rtt_ms": 50.0, "host_gbps": 0.2, "connections": 4}
    link = Link(conn_bytes_per_s=25e6, rtt_s=0.05, host_bytes_per_s=0.2e9, connections=4)
    share = process_share(checkpoint_bytes=4e9, leaves=16, devices=8, objects_in_flight=8)
    assert out["save_floor_s"]["plain"] == pytest.approx(
        floors(share, leaves=16, link=link)["plain"].save_floor_s
    )
    assert out["save_in_flight"] == {"plain": 4, "packed": 4}  # the connections bound both
    assert out["objects_per_process"]["packed"] == 60 + 1
    assert jaxckpt_cli.main(argv) == 0
    text = capsys.readouterr().out
    title = "time floor of one save and one restore per process, by layout\n"
    link_line = "(25 MB/s per connection, 50 ms round trip, 0.2 GB/s host, at most 4 requests"
    assert title + link_line + " in flight):\n" in text
    rows = text[text.index(title) :].splitlines()[2:5]
    assert rows[0].split() == ["layout", "objects", "save", "bound", "by", "restore", "bound", "by"]
    assert rows[1].startswith("plain ") and rows[2].startswith("packed ")
    assert f"{out['save_floor_s']['packed']:,.2f} s" in rows[2]
    assert "(4 in flight)" in rows[2]


def test_cli_defaults_are_the_links(capsys: pytest.CaptureFixture[str]) -> None:
    assert jaxckpt_cli.main([*ARGV, "--json"]) == 0
    link = json.loads(capsys.readouterr().out)["link"]
    default = Link()
    assert link["conn_mbps"] * 1e6 == default.conn_bytes_per_s
    assert link["rtt_ms"] / 1e3 == default.rtt_s
    assert link["host_gbps"] * 1e9 == default.host_bytes_per_s
    assert link["connections"] == default.connections
    assert jaxckpt_cli.main([*ARGV, "--connections=0"]) == 2
    assert "connections must be an integer >= 1" in capsys.readouterr().err


@dataclass(frozen=True)
class _WholeCost:
    """A made-up third format: each process's share one object, written and read whole,
    plus one index object per step."""

    save_round_trips: int = 3

    def data_objects(self, share: ProcessShare) -> float:
        return 1

    def step_objects(self, leaves: int) -> int:
        return 1

    def save_requests(
        self,
        share: ProcessShare,
        *,
        leaves: int,
        records: int,
        connections: int,
        inflight_bytes: int,
    ) -> SaveRequests:
        return SaveRequests(written=2 + records, waited=1, in_flight=1, carrying=1)

    def restore_requests(self, share: ProcessShare) -> int:
        return 1


WHOLE = DataFormat(
    name="whole", zarr_arrays=False, raw_chunks=True, description="one object", cost=_WholeCost()
)


def test_a_third_format_is_priced_by_its_cost_object_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    share = process_share(checkpoint_bytes=16 * 16 * MiB, leaves=16, devices=8)
    f = floor(WHOLE, share, leaves=16)
    # one request carrying 256 MiB on one connection, after the format's 2 other round trips
    assert (f.layout, f.objects_per_process, f.save_requests_per_process) == ("whole", 2, 9)
    assert f.save_floor_s == pytest.approx(2 * RTT + RTT + 256 * MiB / CONN)
    assert f.save_bound == f.restore_bound == "per-connection bandwidth"
    assert (f.restore_requests_per_process, f.restore_in_flight) == (1, 1)
    assert f.restore_floor_s == pytest.approx(3 * RTT + RTT + 256 * MiB / CONN)
    # the request plan counts its objects once added to the table: 32 processes' objects,
    # its index, the step's 6 records and 32 manifest parts
    monkeypatch.setattr(_costs, "FORMATS", {**FORMATS, WHOLE.name: WHOLE})
    plan = object_plan(checkpoint_bytes=840e9, leaves=2200, devices=256)
    assert list(plan) == [*FORMATS, "whole"]
    assert plan["whole"].objects_per_checkpoint == 32 + 1 + 6 + 32
    # the scale model: the primary writes its object and the index, every other process one
    (save, restore) = scale_plan(
        processes=[16], profile=PROFILES["target"], stores=["s3"], data_format=WHOLE
    )
    assert save.requests_primary == 5 + 8 + 2 and save.requests_other == 4 + 1 + 1
    assert save.cluster_writes == 8 + 15 * 1 + 2 + 15 * 1
    assert restore.cluster_reads == 7 + 15 * 3 + 16 * 1
