"""save(process_state=...): each process's own state, committed with the step.

Checked here: bytes, str and JSON values round trip and are None where none was saved
(older steps too); the size bound and unsupported values are refused naming the limit
or the fix; a bytes leaf in the state tree points at ``process_state=``; a damaged record
is a ``CorruptCheckpointError``; the state goes through a local tier and its promotion
and through ``jaxckpt cp`` (byte for byte and recompressed); and with 2 real JAX
processes (each with a local tier, every step promoted) each process gets its own bytes
back in a fresh group, while a single process reads both with ``process_states`` and is
told clearly when it asks for "its own" of a 2-process step.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import harness
import numpy as np
import procstate_child
import pytest
from benchkit import servers

import jaxckpt
from jaxckpt import policy
from jaxckpt.cli import main as cli_main
from jaxckpt.commit import CommitProtocol
from jaxckpt.records import _procstate, manifest_name
from jaxckpt.storage import open_storage

CHILD = Path(__file__).with_name("procstate_child.py")

pytestmark = pytest.mark.timeout(240)

GRAIN_LIKE = {"next_index": 17, "parents": [{"seed": 3}], "name": "it"}


def _manager(root: Path, **kwargs) -> jaxckpt.CheckpointManager:
    return jaxckpt.CheckpointManager(root, gc_on_open=False, **kwargs)


def test_values_round_trip_and_none_where_none_was_saved(tmp_path):
    with _manager(tmp_path) as mgr:
        assert mgr.restored_process_state is None  # before any restore
        mgr.save(1, {"x": np.arange(3)})  # an older-style step: no process state
        mgr.save(2, {"x": np.arange(3)}, process_state=b"\x00\xffbytes")
        mgr.save(3, {"x": np.arange(3)}, process_state="text é")
        mgr.save(4, {"x": np.arange(3)}, process_state=GRAIN_LIKE)
        mgr.wait()
    mgr = _manager(tmp_path, read_only=True)
    expected = {1: None, 2: b"\x00\xffbytes", 3: "text é", 4: GRAIN_LIKE}
    for step, value in expected.items():
        assert mgr.restore(step)["x"].tolist() == [0, 1, 2]
        assert mgr.restored_process_state == value
        assert type(mgr.restored_process_state) is type(value)
        assert mgr.process_states(step) == [value]
    mgr.restore()
    assert (mgr.restored_step, mgr.restored_process_state) == (4, GRAIN_LIKE)
    with pytest.raises(jaxckpt.StepNotFoundError):
        mgr.process_states(9)


def test_a_callable_is_called_only_for_the_steps_saved(tmp_path):
    """``process_state=it.get_state``: an iterator's state is taken only when the policy
    saves (grain's ``get_state`` costs 0.4 ms: every step of a loop paid it)."""
    calls = []

    def get_state():
        calls.append(len(calls))
        return {"position": len(calls)}

    with jaxckpt.CheckpointManager(str(tmp_path), save_policy=policy.EveryNSteps(5)) as mgr:
        for step in range(1, 11):
            mgr.save(step, {"x": np.arange(3)}, process_state=get_state)
    assert len(calls) == 2  # steps 5 and 10
    with jaxckpt.CheckpointManager(str(tmp_path), read_only=True) as mgr:
        assert mgr.process_states(10) == [{"position": 2}]


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_steps_of_every_older_format_have_no_process_state(tmp_path, version):
    fixture = Path(__file__).with_name("fixtures") / version / "root"
    root = shutil.copytree(fixture, tmp_path / "root")
    mgr = _manager(root, read_only=True)
    for step in mgr.steps():
        mgr.restore(step)
        assert mgr.restored_step == step and mgr.restored_process_state is None
        assert mgr.process_states(step) == [None] * _num_processes(root, step)


def _num_processes(root: Path, step: int) -> int:
    protocol = CommitProtocol(open_storage(str(root)))
    return protocol.require_marker(step).num_processes


def test_refused_values_name_the_limit_or_the_fix(tmp_path):
    big = b"x" * (_procstate.MAX_PROCESS_STATE_BYTES + 1)
    with _manager(tmp_path) as mgr:
        with pytest.raises(jaxckpt.CheckpointError, match="MAX_PROCESS_STATE_BYTES=1,048,576"):
            mgr.save(1, {"x": np.arange(3)}, process_state=big)
        with pytest.raises(jaxckpt.UnsupportedLeafError, match="bytes, str or JSON"):
            mgr.save(1, {"x": np.arange(3)}, process_state={"it": object()})
        with pytest.raises(jaxckpt.UnsupportedLeafError, match=r"save\(process_state=\.\.\.\)"):
            mgr.save(1, {"x": np.arange(3), "data_iter": b"state"})
        assert mgr.save(1, {"x": np.arange(3)}, process_state=big[:-1])  # exactly the limit
        mgr.wait()
    assert _manager(tmp_path, read_only=True).process_states(1) == [big[:-1]]


def test_a_damaged_record_is_corrupt(tmp_path):
    with _manager(tmp_path) as mgr:
        mgr.save(1, {"x": np.arange(3)}, process_state=b"abc")
    record = _procstate.encode(b"abc", step=1, process=0)
    assert _procstate.decode(record, "r") == b"abc"
    for forged in ({**record, "data": "YWJk"}, {**record, "size": 4}, {"kind": "pickle"}):
        with pytest.raises(jaxckpt.CorruptCheckpointError, match="step 1: process_state"):
            _procstate.decode(forged, "step 1: process_state of process 0")
    # the part is covered by the marker: a changed byte in it fails the step's checksums
    protocol = CommitProtocol(open_storage(str(tmp_path)))
    marker = protocol.require_marker(1)
    path = tmp_path / marker.location.key(manifest_name(0))
    path.write_bytes(path.read_bytes().replace(b'"crc32c":', b'"crc32C":', 1))
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"manifest/0\.json"):
        _manager(tmp_path, read_only=True).process_states(1)


def test_local_tier_promotion_and_cp_carry_it(tmp_path):
    local, durable = tmp_path / "local", tmp_path / "durable"
    with _manager(durable, local_root=str(local)) as mgr:
        mgr.save(5, {"x": np.arange(4.0)}, process_state=GRAIN_LIKE)
        assert mgr.wait_durable(5, timeout_s=60) == 5
        mgr.restore(5)  # the local copy, the nearest
        assert mgr.restored_process_state == GRAIN_LIKE
    plain = _manager(durable, read_only=True)  # the promoted copy only
    plain.restore(5)
    assert plain.restored_process_state == GRAIN_LIKE
    for compress in ((), ("--compress=zstd",)):
        root = tmp_path / f"cp{len(compress)}"
        assert cli_main(["cp", f"{durable}:5", str(root), *compress]) == 0
        copied = _manager(root, read_only=True)
        assert copied.restore(5)["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert copied.restored_process_state == GRAIN_LIKE


# ------------------------------------------------------------------ two real processes


def _group(tmp_path: Path, mode: str, *extra: str) -> list[list[str]]:
    """Runs a group of 2 children (on nodes ``node0``, ``node1``) to the end; their
    stdout lines, by process."""
    for _ in range(3):  # the coordinator's port may be taken before process 0 binds it
        port = servers.free_port()
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-u",
                    str(CHILD),
                    f"--coordinator=127.0.0.1:{port}",
                    "--num-processes=2",
                    f"--process-id={i}",
                    f"--root={tmp_path / 'durable'}",
                    f"--mode={mode}",
                    *extra,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=harness.child_env(JAX_PLATFORMS="cpu", JAXCKPT_NODE_ID=f"node{i}"),
            )
            for i in range(2)
        ]
        try:
            outs = [p.communicate(timeout=150) for p in procs]
        finally:
            for p in procs:
                harness.kill(p)
        if all(p.returncode == 0 for p in procs):
            return [out.splitlines() for out, _ in outs]
        if "address already in use" not in outs[0][1].lower():
            pytest.fail("\n".join(f"process {i}: {err[-3000:]}" for i, (_, err) in enumerate(outs)))
        time.sleep(0.5)
    pytest.fail("no free coordinator port in 3 attempts")


def test_two_processes_each_get_their_own_state_back(tmp_path):
    local = f"--local-root={tmp_path / 'local'}"
    saved = _group(tmp_path, "save", local)
    assert all("SAVED" in lines for lines in saved), saved
    restored = _group(tmp_path, "restore", local)  # fresh processes, from the local tiers
    everyone_bytes = [procstate_child.state_of(p, 2) for p in (0, 1)]
    everyone = ",".join(b.hex() for b in everyone_bytes)
    for process, lines in enumerate(restored):
        assert "RESTORED 2" in lines, lines
        assert f"OWN {procstate_child.state_of(process, 2).hex()}" in lines, lines
        assert f"ALL {everyone}" in lines, lines
    # one process reads the durable copy that 2 processes saved
    mgr = _manager(tmp_path / "durable", read_only=True)
    assert mgr.process_states(1) == [procstate_child.state_of(p, 1) for p in (0, 1)]
    mgr.restore(2)
    with pytest.raises(jaxckpt.CheckpointError, match=r"saved by 2 processes.*process_states\(2\)"):
        _ = mgr.restored_process_state
    archive = tmp_path / "archive"  # recompressed: one part of chunks, every state kept
    assert cli_main(["cp", f"{tmp_path / 'durable'}:2", str(archive), "--compress=zstd"]) == 0
    assert _manager(archive, read_only=True).process_states(2) == everyone_bytes


def test_a_lost_local_root_gets_its_state_back_from_its_peer(tmp_path):
    local = f"--local-root={tmp_path / 'local'}"
    saved = _group(tmp_path, "save", local, "--replicas")
    assert all("SAVED" in lines for lines in saved), saved
    assert not _manager(tmp_path / "durable", read_only=True).steps()  # local only
    shutil.rmtree(tmp_path / "local1")  # process 1's node lost its disk
    restored = _group(tmp_path, "restore", local, "--replicas")
    everyone = ",".join(procstate_child.state_of(p, 2).hex() for p in (0, 1))
    for process, lines in enumerate(restored):
        assert "RESTORED 2" in lines, lines
        assert f"OWN {procstate_child.state_of(process, 2).hex()}" in lines, lines
        assert f"ALL {everyone}" in lines, lines  # gathered from the local tiers


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({1: "a"}, "key 1 (int)"),
        ({"it": {True: 1}}, "['it']: key True (bool)"),
        ({None: 1}, "key None (NoneType)"),
        ((1, 2), "a tuple"),
        ({"parents": [{"seed": (3,)}]}, "['parents'][0]['seed']: a tuple"),
    ],
)
def test_values_json_cannot_carry_exactly_are_refused_by_name(value, named):
    """``{1: 'a'}`` came back as ``{'1': 'a'}`` and ``(1, 2)`` as ``[1, 2]``: refused,
    naming the key or the type, before anything is written."""
    with pytest.raises(jaxckpt.UnsupportedLeafError) as info:
        _procstate.encode(value, step=3, process=1)
    assert "step 3: process_state of process 1" in str(info.value)
    assert named in str(info.value), str(info.value)


def test_a_deep_value_is_refused_without_a_recursion_error():
    deep: list = []
    inner = deep
    for _ in range(100_000):
        inner.append([])
        inner = inner[0]
    with pytest.raises(jaxckpt.UnsupportedLeafError, match="nested deeper than 100"):
        _procstate.encode(deep, step=1, process=0)
    shallow: list = []
    inner = shallow
    for _ in range(98):  # with the dict: 100 levels
        inner.append([])
        inner = inner[0]
    record = _procstate.encode({"a": shallow, "n": float("nan")}, step=1, process=0)
    back = _procstate.decode(record, "r")
    assert back["a"] == shallow and back["n"] != back["n"]  # NaN round trips as NaN


def test_a_record_over_the_bound_is_refused_on_read():
    """The bound holds on read too: a crafted record of 3 MiB with a matching size and
    CRC32C (a writer that skipped the check) is corrupt, not returned."""
    import base64

    from jaxckpt.records._step import crc32c, dumps

    raw = b"x" * (3 << 20)
    crafted = {
        "bytes": {"kind": "bytes", "data": base64.b64encode(raw).decode(), "size": len(raw)},
        "str": {"kind": "str", "data": raw.decode(), "size": len(raw)},
        "json": {"kind": "json", "data": [raw.decode()], "size": len(dumps([raw.decode()]))},
    }
    for kind, record in crafted.items():
        body = raw if kind != "json" else dumps([raw.decode()])
        record = {**record, "crc32c": crc32c(body)}
        with pytest.raises(jaxckpt.CorruptCheckpointError, match="MAX_PROCESS_STATE_BYTES"):
            _procstate.decode(record, "step 1: process_state of process 0")
