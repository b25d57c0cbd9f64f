"""The definitions of jaxckpt's absl flags and their validators (see :mod:`jaxckpt.flags`).

:func:`define_all` is called by :func:`jaxckpt.flags.define_flags`; absl is imported
only inside it. The flags are registered under the module name ``jaxckpt.flags`` (so
``--helpfull`` lists them there) and made key flags of the caller by ``define_flags``
(so ``--help`` of the script that defines them lists them). :func:`flag_error` makes the
``CheckpointFlagError`` that :mod:`jaxckpt.flags` exports.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from absl import flags as absl_flags

FLAG_NAMES = (
    "checkpoint_enabled",
    "checkpoint_root",
    "checkpoint_every_steps",
    "checkpoint_every_seconds",
    "checkpoint_mtbf_hours",
    "checkpoint_max_overhead",
    "checkpoint_on_preemption",
    "checkpoint_keep_last",
    "checkpoint_keep_milestones",
    "checkpoint_keep_every",
    "checkpoint_async",
    "checkpoint_timeout_seconds",
    "checkpoint_tolerate_failed_saves",
    "checkpoint_preflight_steps",
    "checkpoint_preflight_root",
    "checkpoint_local_root",
    "checkpoint_promote_every_steps",
    "checkpoint_promote_every_seconds",
    "checkpoint_local_keep_last",
    "checkpoint_local_replicas",
    "checkpoint_promotion",
    "checkpoint_restore_memory_mib",
    "checkpoint_writer_nice",
    "checkpoint_init_from",
    "checkpoint_init_partial",
    "checkpoint_init_rename",
)
TIER_FLAGS = (
    "checkpoint_promote_every_steps",
    "checkpoint_promote_every_seconds",
    "checkpoint_local_keep_last",
    "checkpoint_local_replicas",
)


def tier_problem(values: dict[str, Any]) -> str | None:
    """Why the tier flags in ``values`` are inconsistent (set without a local root), or None."""
    if values.get("checkpoint_local_root"):
        return None
    given = [f"--{name}" for name in TIER_FLAGS if values.get(name) is not None]
    return f"{', '.join(given)} need --checkpoint_local_root" if given else None


def milestones_problem(series: list[Any]) -> str | None:
    """Why ``--checkpoint_keep_milestones`` is not a list of positive integers, or None."""
    try:
        if all(int(s) > 0 for s in series):
            return None
    except (TypeError, ValueError):
        pass
    return (
        "--checkpoint_keep_milestones must be positive integers such as 1,2,5, got "
        f"{','.join(map(str, series))!r}"
    )


def init_problem(values: dict[str, Any]) -> str | None:
    """Why the ``--checkpoint_init_*`` flags in ``values`` are inconsistent, or None."""
    rename = values.get("checkpoint_init_rename") or []
    if not values.get("checkpoint_init_from"):
        given = ["--checkpoint_init_partial"] * bool(values.get("checkpoint_init_partial"))
        given += ["--checkpoint_init_rename"] * bool(rename)
        return f"{', '.join(given)} need --checkpoint_init_from" if given else None
    bad = [r for r in rename if "=" not in r]
    if bad:
        return f"--checkpoint_init_rename takes SAVED=NEW path prefixes, got {bad[0]!r}"
    return None


def define_all(fv: absl_flags.FlagValues) -> None:
    """Defines every ``checkpoint_*`` flag in ``fv``, with its validators."""
    from absl import flags

    module = "jaxckpt.flags"
    kw: dict[str, Any] = {"flag_values": fv, "module_name": module}
    flags.DEFINE_string(
        "checkpoint_root", None, "Checkpoint root: a directory, gs://bucket/path or s3://...", **kw
    )
    flags.DEFINE_integer(
        "checkpoint_every_steps",
        None,
        "Save at steps that are multiples of N.",
        lower_bound=1,
        **kw,
    )
    flags.DEFINE_float(
        "checkpoint_every_seconds", None, "Save when this many seconds passed.", lower_bound=0, **kw
    )
    flags.DEFINE_float(
        "checkpoint_mtbf_hours",
        None,
        "Mean time between failures of the job: save at Daly's optimal interval.",
        lower_bound=0,
        **kw,
    )
    flags.DEFINE_float(
        "checkpoint_max_overhead",
        0.02,
        "With --checkpoint_mtbf_hours: at most this fraction of time blocked on saves.",
        lower_bound=0,
        upper_bound=1,
        **kw,
    )
    flags.DEFINE_bool(
        "checkpoint_on_preemption",
        True,
        "Save at the next step after SIGTERM/SIGINT (see CheckpointManager.preempted).",
        **kw,
    )
    flags.DEFINE_integer(
        "checkpoint_keep_last", None, "Keep the N newest steps.", lower_bound=1, **kw
    )
    flags.DEFINE_list(
        "checkpoint_keep_milestones",
        [],
        "Keep a logarithmic trail of steps s*10^j for these s, e.g. 1,2,5.",
        **kw,
    )
    flags.DEFINE_integer(
        "checkpoint_keep_every", None, "Keep steps that are multiples of N.", lower_bound=1, **kw
    )
    flags.DEFINE_bool(
        "checkpoint_async",
        True,
        "Write checkpoints in the background; off: save() returns once the step is committed.",
        **kw,
    )
    flags.DEFINE_float(
        "checkpoint_timeout_seconds", 600.0, "A save must commit within this.", lower_bound=0, **kw
    )
    flags.DEFINE_integer(
        "checkpoint_tolerate_failed_saves",
        0,
        "Failed saves in a row training goes on after (logged, counted; the next save tries "
        "again); 0: the first raises.",
        lower_bound=0,
        **kw,
    )
    flags.DEFINE_integer(
        "checkpoint_preflight_steps",
        0,
        "Before training, check that a checkpoint of the starting state resumes bit-exactly "
        "for N steps (jaxckpt.check_resume); 0 skips the check.",
        lower_bound=0,
        **kw,
    )
    flags.DEFINE_string(
        "checkpoint_preflight_root",
        None,
        "An empty scratch root for the pre-flight check (default: a temporary local directory).",
        **kw,
    )
    flags.DEFINE_string(
        "checkpoint_local_root",
        None,
        "A fast local tier, one per host (e.g. local NVMe): saves commit there and the steps "
        "chosen for promotion are copied to --checkpoint_root.",
        **kw,
    )
    flags.DEFINE_integer(
        "checkpoint_promote_every_steps",
        None,
        "With a local tier: promote saves at steps that are multiples of N (default: every save).",
        lower_bound=1,
        **kw,
    )
    flags.DEFINE_float(
        "checkpoint_promote_every_seconds",
        None,
        "With a local tier: promote a save when this many seconds passed since the last one.",
        lower_bound=0,
        **kw,
    )
    flags.DEFINE_integer(
        "checkpoint_local_keep_last",
        None,
        "With a local tier: keep the N newest local steps (and 2 more waiting for promotion).",
        lower_bound=1,
        **kw,
    )
    flags.DEFINE_integer(
        "checkpoint_local_replicas",
        None,
        "With a local tier: keep each process's local part on N distinct nodes (a ring over "
        "the host names or JAXCKPT_NODE_ID), so a lost node's newest steps survive (default 1).",
        lower_bound=1,
        **kw,
    )
    flags.DEFINE_integer(
        "checkpoint_restore_memory_mib",
        None,
        "Restores from gs:// or s3:// use at most this much memory beyond the restored arrays "
        "(default: a tenth of each restore, 16 MiB to 1 GiB).",
        lower_bound=1,
        **kw,
    )
    flags.DEFINE_integer(
        "checkpoint_writer_nice",
        0,
        "Niceness 0-19 of the background save's own threads (Linux), below the training loop.",
        lower_bound=0,
        upper_bound=19,
        **kw,
    )
    flags.DEFINE_enum(
        "checkpoint_promotion",
        "background",
        ["background", "external"],
        "With a local tier: who promotes, a thread of this process or a `jaxckpt promote` sidecar.",
        **kw,
    )
    flags.DEFINE_bool(
        "checkpoint_enabled",
        True,
        "Save and restore checkpoints; off: the manager saves nothing and finds no step "
        "(a scratch or evaluation run), and --checkpoint_root is not needed.",
        **kw,
    )
    flags.DEFINE_string(
        "checkpoint_init_from",
        None,
        "Start a new run (no step under --checkpoint_root yet) from another root's newest "
        "step, or ROOT:STEP, e.g. pretrained params: see jaxckpt.flags.init_from_flags.",
        **kw,
    )
    flags.DEFINE_bool(
        "checkpoint_init_partial",
        False,
        "With --checkpoint_init_from: the target may name a subset of the saved paths (e.g. "
        "only the params of a saved train state).",
        **kw,
    )
    flags.DEFINE_list(
        "checkpoint_init_rename",
        [],
        "With --checkpoint_init_from: SAVED=NEW tree path prefixes (as jax.tree_util.keystr "
        "writes them), e.g. ['params']['enc']=['params']['encoder'].",
        **kw,
    )

    def check(problem: Callable[[Any], str | None]) -> Callable[[Any], bool]:
        def checker(value: Any) -> bool:
            if (message := problem(value)) is not None:
                raise flags.ValidationError(message)
            return True

        return checker

    multi = flags.register_multi_flags_validator
    multi(["checkpoint_local_root", *TIER_FLAGS], check(tier_problem), flag_values=fv)
    flags.register_validator(
        "checkpoint_keep_milestones", check(milestones_problem), flag_values=fv
    )
    init = ["checkpoint_init_from", "checkpoint_init_partial", "checkpoint_init_rename"]
    multi(init, check(init_problem), flag_values=fv)


def flag_error(message: str) -> Exception:
    """A :class:`CheckpointFlagError` (an ``absl.app.UsageError``) saying ``message``."""
    return _flag_error_class()(message)


@functools.cache
def _flag_error_class() -> type[Exception]:
    from absl import app

    from jaxckpt.errors import CheckpointError

    class CheckpointFlagError(app.UsageError, CheckpointError, ValueError):
        """A ``checkpoint_*`` flag is missing or inconsistent with another.

        It is an ``absl.app.UsageError``: raised in ``main`` under ``absl.app.run``, the
        program prints its usage and the problem and exits with status 1, no traceback.
        Fix the flags as the message says (``--help`` lists them).
        """

    CheckpointFlagError.__module__ = "jaxckpt.flags"  # its public home
    CheckpointFlagError.__qualname__ = "CheckpointFlagError"
    return CheckpointFlagError
