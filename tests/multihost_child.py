"""One JAX process of a multi-host checkpoint test, on CPU devices with gloo.

Usage::

    python tests/multihost_child.py --coordinator 127.0.0.1:PORT --num-processes P
        --process-id I --devices D --root ROOT
        --mode {save,restore,save_and_die,restore_and_die,policy} [--mesh AxB]
        [--spec data,model] [--steps 1,2] [--save-timeout S] [--primary-host H]
        [--exchange-min-bytes N] [--exchange-part-bytes N] [--scale K]
        [--local-root PREFIX --promotion {background,external}] [--leaves x,y]
        [--local-replicas K --peer-timeout S --promote-every N --probe-wrong-secret]
        [--strict-replication]

The process joins a ``jax.distributed`` group of ``P`` processes with ``D``
CPU devices each, builds a ``('data', 'model')`` mesh of shape ``AxB`` over
all ``P*D`` devices, and then:

* ``save``: saves :func:`build_state` for each of ``--steps`` and waits for
  each commit; the sharded leaves use the save layout of :data:`SAVE_SPECS`.
* ``restore``: ``restore()`` without a step onto the mesh, with ``--spec``
  for the sharded leaves (the replicated ones stay replicated); prints the
  step it got (every process of the group must get the same one) and checks
  every addressable shard of every array against :func:`expected` for it,
  and the bytes of array data it read from storage (``BYTES READ n``).
* ``restore_and_die``: a ``restore`` during which one process (started with
  ``JAXCKPT_PAUSE_AT``) pauses and is SIGKILLed; the survivors report the
  ``CheckpointError`` they get like ``save_and_die``.
* ``save_and_die``: commits the first step, then saves the second; one
  process of the group is started with ``JAXCKPT_PAUSE_AT`` set, which is
  armed only for that second save, and the test SIGKILLs it while it pauses.
  The survivors report the ``CheckpointError`` they get and how long it took.
* ``policy``: offers every step of ``--steps`` to ``save()`` under a save
  policy that answers differently on each process (the primary saves even
  steps, the others steps divisible by 3) and prints ``DECIDED s True|False``:
  every process must follow the primary's answer.

With ``--local-root`` the manager is tiered: process ``i`` saves to its own
local root ``PREFIX<i>`` and ``ROOT`` is the durable root; ``save`` then waits
until the last step is durable (background promotion) and prints ``DURABLE
s``, and ``restore`` prints ``TIER local|durable``: where this process read
its regions from. With ``--local-replicas`` each process's local part is replicated to
``K - 1`` other processes' local tiers (their nodes come from ``JAXCKPT_NODE_ID``);
``restore`` also prints ``HEALED`` when this process fetched its part from a peer and
``REPLICA UNUSABLE`` when a peer's copy failed its checks; ``--probe-wrong-secret``
then makes process 0 connect to process 1's listener with a wrong secret and print
``PROBE REFUSED`` when it is turned away. ``--promote-every`` sets ``promote_policy``
to ``EveryNSteps(N)``. ``--leaves`` limits the state to some leaves (all by
default), e.g. ``x,y`` with ``--mesh 4x1``: every process holds distinct
shards, so a local tier holds every region its process reads.

Values are a deterministic function of the leaf, the step and the global
index, so any process can check any shard. Protocol lines go to stdout:
``READY``, ``SAVED s``, ``COMMITTED s``, ``DECIDED s b``, ``RESTORED s``,
``CHECKED n``, ``BYTES READ n``, ``FAILED <error class> <seconds>``, ``DONE``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import threading
import time
from typing import Any

import numpy as np

PAUSE_ENV = "JAXCKPT_PAUSE_AT"
UNBOUNDED_S = 120.0  # a save timeout only a hang reaches (see save_and_die)

# The sharded leaves, their shapes and how the save lays them out on the mesh:
# x is sharded on 'data' and replicated on 'model'; y is sharded on both; z is
# sharded on 'model' and replicated on 'data', so its replicas sit on
# different processes when 'data' spans processes.
SHARDED: dict[str, tuple[int, ...]] = {"x": (16, 8), "y": (16, 8), "z": (16, 8)}
SAVE_SPECS = {"x": ("data",), "y": ("data", "model"), "z": ("model",)}
# Fully replicated jax.Arrays and a host (numpy) array, identical on every process.
REPLICATED: dict[str, tuple[tuple[int, ...], Any]] = {
    "rep": ((4, 4), np.float32),
    "count": ((), np.int32),
}
HOST: dict[str, tuple[tuple[int, ...], Any]] = {"host": ((3,), np.int32)}
# Replicated leaves above the exchange threshold (jaxckpt.restoring._readonce.MIN_BYTES),
# always restored replicated (P()), so each is read once over all processes: big
# is saved replicated (one 1.5 MiB chunk, read in parts), wide sharded on 'data'
# (one 1 MiB chunk per row of the mesh).
BIG: dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]] = {
    "big": ((512, 768), ()),
    "wide": ((1024, 512), ("data",)),
}
VALUES = {"lr": 0.5, "name": "run-7"}
OFFSETS = {"x": 0, "y": 1, "z": 2, "rep": 3, "count": 4, "host": 5, "big": 6, "wide": 7}


def expected(name: str, step: int) -> np.ndarray:
    """The whole global value of array leaf ``name`` at ``step`` (exact in float32)."""
    shape: tuple[int, ...]
    dtype: Any
    if name in SHARDED:
        shape, dtype = SHARDED[name], np.float32
    elif name in BIG:
        shape, dtype = BIG[name][0], np.float32
    else:
        shape, dtype = {**REPLICATED, **HOST}[name]
    base = 100_000 * step + 1_000 * OFFSETS[name]
    return (np.arange(math.prod(shape)) + base).reshape(shape).astype(dtype)


def value_leaves(step: int) -> dict[str, Any]:
    return {**VALUES, "step": step}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--root", required=True)
    p.add_argument(
        "--mode",
        choices=("save", "restore", "save_and_die", "restore_and_die", "policy"),
        required=True,
    )
    p.add_argument("--mesh", default=None, help="AxB for axes ('data', 'model')")
    p.add_argument("--spec", default="data", help="PartitionSpec of x, y, z on restore")
    p.add_argument("--steps", default="1", help="comma-separated steps to save")
    p.add_argument("--save-timeout", type=float, default=20.0)
    p.add_argument("--primary-host", type=int, default=0, help="CheckpointOptions.primary_host")
    p.add_argument("--init-timeout", type=int, default=60)
    p.add_argument("--layout", default="plain", help="CheckpointOptions.layout")
    p.add_argument("--scale", type=int, default=1, help="multiplies the rows of BIG's leaves")
    p.add_argument(
        "--exchange-min-bytes",
        type=int,
        default=None,
        help="jaxckpt.restoring._readonce.MIN_BYTES (huge: every process reads what it needs)",
    )
    p.add_argument(
        "--exchange-part-bytes", type=int, default=None, help="..._replicated.PART_BYTES"
    )
    p.add_argument("--local-root", default=None, help="prefix of each process's local tier")
    p.add_argument("--promotion", default="background", help="CheckpointOptions.promotion")
    p.add_argument(
        "--shared-local-root", action="store_true", help="every process gets --local-root as is"
    )
    p.add_argument("--leaves", default=None, help="comma-separated leaves to save (default all)")
    p.add_argument("--local-replicas", type=int, default=1, help="CheckpointOptions.local_replicas")
    p.add_argument("--peer-timeout", type=float, default=60.0, help="...peer_timeout_s")
    p.add_argument("--strict-replication", action="store_true", help="...strict_replication")
    p.add_argument("--promote-every", type=int, default=None, help="promote_policy EveryNSteps")
    p.add_argument("--probe-wrong-secret", action="store_true")
    p.add_argument("--local-keep", type=int, default=None, help="local_retention KeepLast(N)")
    p.add_argument("--save-after", default="", help="restore mode: then save these steps")
    p.add_argument("--compile", action="store_true", help="compilation_cache; compile() a step")
    return p.parse_args(argv)


def _say(text: str) -> None:
    print(text, flush=True)


_LEAVES: set[str] = set()  # empty: every leaf


def _wanted(name: str) -> bool:
    return not _LEAVES or name in _LEAVES


class _TierHandler(logging.Handler):
    """Prints ``TIER <name>`` when the manager reports where it restored a step from."""

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("restored step "):
            _say(f"TIER {text.split(' from the ')[1].split()[0]}")
        elif "fetched this process's part" in text:
            _say("HEALED")
        elif "is unusable" in text:
            _say("REPLICA UNUSABLE")


def _spec(text: str) -> tuple[str | None, ...]:
    return tuple(None if s in ("", "None") else s for s in text.split(","))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    ).strip()
    pause_at = os.environ.pop(PAUSE_ENV, None)  # armed only for the save that must die

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        coordinator_bind_address=args.coordinator,  # loopback only
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=args.init_timeout,
    )
    assert jax.process_count() == args.num_processes
    assert jax.local_device_count() == args.devices, jax.local_devices()

    import jaxckpt
    import jaxckpt.restoring._readonce

    for name, (shape, spec) in BIG.items():
        BIG[name] = ((shape[0] * args.scale, *shape[1:]), spec)
    if args.exchange_min_bytes is not None:
        jaxckpt.restoring._readonce.MIN_BYTES = args.exchange_min_bytes
    if args.exchange_part_bytes is not None:
        jaxckpt.restoring._readonce.PART_BYTES = args.exchange_part_bytes
    mesh = _mesh(jax, args.mesh, args.num_processes * args.devices)
    save_policy = _DisagreeingPolicy(args.primary_host) if args.mode == "policy" else None
    if args.leaves:
        _LEAVES.update(args.leaves.split(","))
    tiered: dict[str, Any] = {}
    if args.local_root is not None:
        own = "" if args.shared_local_root else str(args.process_id)
        tiered = {"local_root": f"{args.local_root}{own}", "promotion": args.promotion}
        if args.local_replicas > 1:
            tiered.update(local_replicas=args.local_replicas, peer_timeout_s=args.peer_timeout)
            tiered["strict_replication"] = args.strict_replication
        if args.local_keep is not None:
            tiered["local_retention"] = jaxckpt.policy.KeepLast(args.local_keep)
        if args.promote_every is not None:
            tiered["promote_policy"] = jaxckpt.policy.EveryNSteps(args.promote_every)
        tiered["compilation_cache"] = args.compile
        logging.getLogger("jaxckpt").addHandler(_TierHandler())
        logging.getLogger("jaxckpt").setLevel(logging.INFO)

    def open_manager(save_timeout_s: float) -> Any:
        return jaxckpt.CheckpointManager(
            args.root,
            save_timeout_s=save_timeout_s,
            primary_host=args.primary_host,
            save_policy=save_policy,
            layout=args.layout,
            **tiered,
        )

    # save_and_die: the short --save-timeout is meant to be reached by the save whose peer
    # is killed, never by the step that commits first (a loaded machine may run it late).
    dies = args.mode == "save_and_die"
    manager = open_manager(max(args.save_timeout, UNBOUNDED_S) if dies else args.save_timeout)
    _say("READY")
    if args.compile:
        _compile(manager, mesh)
    steps = [int(s) for s in args.steps.split(",")]
    if args.mode == "save":
        for step in steps:
            _save(manager, mesh, step)
        if tiered and args.promotion == "background":
            _say(f"DURABLE {manager.wait_durable(timeout_s=args.save_timeout)}")
    elif args.mode == "restore":
        _restore(manager, mesh, _spec(args.spec))
        for step in [int(s) for s in args.save_after.split(",") if s]:
            _save(manager, mesh, step)
        if args.probe_wrong_secret and jax.process_index() == 0:
            _probe_wrong_secret(manager)
    elif args.mode == "restore_and_die":
        if pause_at is not None:
            os.environ[PAUSE_ENV] = pause_at
        start = time.monotonic()
        try:
            _restore(manager, mesh, _spec(args.spec))
        except jaxckpt.CheckpointError as e:
            _say(f"FAILED {type(e).__name__} {time.monotonic() - start:.1f}")
            print(f"error: {e}", file=sys.stderr, flush=True)
            _exit_with_a_dead_peer()
        _say("UNEXPECTED restore")
        os._exit(1)
    elif args.mode == "policy":
        for step in steps:
            saved = manager.save(step, build_state(mesh, step))
            _say(f"DECIDED {step} {saved}")
        manager.wait()
    else:
        _save(manager, mesh, steps[0])
        manager.close()
        manager = open_manager(args.save_timeout)
        if pause_at is not None:
            os.environ[PAUSE_ENV] = pause_at
        start = time.monotonic()
        try:
            _save(manager, mesh, steps[1])
        except jaxckpt.CheckpointError as e:
            _say(f"FAILED {type(e).__name__} {time.monotonic() - start:.1f}")
            print(f"error: {e}", file=sys.stderr, flush=True)
            _exit_with_a_dead_peer()
        _say(f"UNEXPECTED commit of step {steps[1]}")
        os._exit(1)
    manager.close()
    from jax._src import distributed

    # The last process to close removes the agreement's keys: look once every one has.
    distributed.global_state.client.wait_at_barrier("multihost-child-closed", 120_000)
    if jax.process_index() == args.primary_host:  # the agreement cleaned up after itself
        left = distributed.global_state.client.key_value_dir_get("jaxckpt/")
        _say(f"AGREEMENT KEYS LEFT {len(left)}")
    _say("DONE")
    return 0


def _probe_wrong_secret(manager: Any) -> None:
    """Connects to process 1's peer listener with a wrong secret; it must turn us away."""
    import jaxckpt
    from jaxckpt.tiers._peerclient import connect
    from jaxckpt.tiers._transport import new_secret

    address = manager._tiers[0].peers.addresses[1]
    try:
        with connect(address, new_secret(), timeout_s=10.0) as peer:
            peer.put("replicas/000000000009/0/injected", b"x")
    except jaxckpt.PeerAuthError:
        _say("PROBE REFUSED")


class _DisagreeingPolicy:
    """A save policy whose answer depends on the process asking it."""

    def __init__(self, primary: int) -> None:
        self._primary = primary

    def should_save(self, ctx: Any) -> bool:
        import jax

        if jax.process_index() == self._primary:
            return ctx.step % 2 == 0
        return ctx.step % 3 == 0


def _mesh(jax: Any, text: str | None, n: int) -> Any:
    a, b = (int(x) for x in text.split("x")) if text else (n, 1)
    if a * b != n:
        raise SystemExit(f"--mesh {text} needs {a * b} devices, have {n}")
    return jax.sharding.Mesh(np.array(jax.devices()).reshape(a, b), ("data", "model"))


def _sharding(jax: Any, mesh: Any, spec: tuple[str | None, ...]) -> Any:
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def build_state(mesh: Any, step: int) -> dict[str, Any]:
    """The state of ``step``: sharded and replicated jax.Arrays, a numpy array, values."""
    import jax

    def global_array(name: str, spec: tuple[str | None, ...]) -> jax.Array:
        full = expected(name, step)
        sharding = _sharding(jax, mesh, spec)
        return jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx])

    state: dict[str, Any] = {n: global_array(n, SAVE_SPECS[n]) for n in SHARDED if _wanted(n)}
    state.update({n: global_array(n, ()) for n in REPLICATED if _wanted(n)})
    state.update({n: global_array(n, spec) for n, (_, spec) in BIG.items() if _wanted(n)})
    state.update({n: expected(n, step) for n in HOST if _wanted(n)})
    state.update(value_leaves(step))
    return state


def _compile(manager: Any, mesh: Any) -> None:
    """Compiles (or loads) a step that sums across the processes, checks what it computes
    and says ``COMPILED loaded=L compiled=C``."""
    import jax

    sharding = _sharding(jax, mesh, ("data",))
    full = np.arange(32, dtype=np.float32).reshape(8, 4)
    shape = jax.ShapeDtypeStruct(full.shape, full.dtype, sharding=sharding)
    step = manager.compile(jax.jit(lambda v: v * 2 + v.sum()).lower(shape))
    out = step(jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx]))
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), (full * 2 + full.sum())[shard.index])
    cache = manager.ledger.executables
    _say(f"COMPILED loaded={cache.loaded} compiled={cache.compiled}")


def _save(manager: Any, mesh: Any, step: int) -> None:
    manager.save(step, build_state(mesh, step))
    _say(f"SAVED {step}")
    manager.wait()
    _say(f"COMMITTED {step}")


def _restore(manager: Any, mesh: Any, spec: tuple[str | None, ...]) -> None:
    import jax

    target: dict[str, Any] = {}
    for name, shape in SHARDED.items():
        if _wanted(name):
            sharding = _sharding(jax, mesh, spec)
            target[name] = jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
    for name, (shape, dtype) in REPLICATED.items():
        if _wanted(name):
            target[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=_sharding(jax, mesh, ()))
    for name, (shape, _) in BIG.items():
        if _wanted(name):
            target[name] = jax.ShapeDtypeStruct(
                shape, np.float32, sharding=_sharding(jax, mesh, ())
            )
    for name, (shape, dtype) in HOST.items():
        if _wanted(name):
            target[name] = np.zeros(shape, dtype)
    target.update(value_leaves(0))
    counter = _CountingStorage(manager._protocol.storage)
    manager._protocol.storage = counter  # every read of the restore goes through it
    start = time.perf_counter()
    restored = manager.restore(target=target)
    _say(f"RESTORE SECONDS {time.perf_counter() - start:.3f}")
    _say(f"BYTES READ {counter.nbytes}")
    step = restored["step"]  # a value leaf: which step this process actually restored
    _say(f"RESTORED {step}")
    checked = 0
    for name in [n for n in [*SHARDED, *REPLICATED, *BIG] if _wanted(n)]:
        checked += _check_array(name, restored[name], target[name].sharding, step)
    for name in [n for n in HOST if _wanted(n)]:
        np.testing.assert_array_equal(restored[name], expected(name, step), err_msg=name)
        checked += 1
    if {k: restored[k] for k in VALUES} != VALUES:
        raise AssertionError(f"values: { ({k: restored[k] for k in VALUES}) } != {VALUES}")
    _say(f"CHECKED {checked}")


class _CountingStorage:
    """Counts the bytes of array data the restore reads (chunk objects and ranges)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.nbytes = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def read_buffer(self, key: str, size: int | None = None) -> Any:
        return self._count(self._inner.read_buffer(key, size))

    def read_range(self, key: str, offset: int, size: int) -> Any:
        return self._count(self._inner.read_range(key, offset, size))

    def _count(self, data: Any) -> Any:
        with self._lock:
            self.nbytes += 0 if data is None else len(data)
        return data


def _check_array(name: str, array: Any, sharding: Any, step: int) -> int:
    """Checks that every addressable shard holds its slice of :func:`expected`."""
    import jax

    if not isinstance(array, jax.Array) or array.sharding != sharding:
        raise AssertionError(f"{name}: {type(array).__name__} {getattr(array, 'sharding', None)}")
    full = expected(name, step)
    if array.dtype != full.dtype or array.shape != full.shape:
        raise AssertionError(f"{name}: {array.shape} {array.dtype} != {full.shape} {full.dtype}")
    shards = array.addressable_shards
    if {s.device for s in shards} != set(jax.local_devices()):
        raise AssertionError(f"{name}: shards on {[s.device for s in shards]}")
    for shard in shards:
        np.testing.assert_array_equal(
            np.asarray(shard.data), full[shard.index], err_msg=f"{name} {shard.index}"
        )
    return len(shards)


def _exit_with_a_dead_peer() -> None:
    """Exits 0 without the shutdown barriers of Orbax and jax.distributed (a peer is dead).
    Process 0 hosts the coordination service: it first waits (bounded) until every other
    surviving process has reported, else its exit kills them before they can."""
    import jax
    from jax._src import distributed

    client = distributed.global_state.client
    client.key_value_set(f"child-exited/{jax.process_index()}", "1")
    if jax.process_index() == 0:
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            if len(client.key_value_dir_get("child-exited/")) >= jax.process_count() - 1:
                break
            time.sleep(0.1)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
