"""Opt-in absl flags for the checkpoint manager.

Nothing is defined at import: call :func:`define_flags` before parsing, then build the
manager with :func:`manager_from_flags` (or the options with :func:`options_from_flags`).
absl is imported only by these functions, so the rest of jaxckpt never depends on it.

>>> from absl import flags
>>> fv = flags.FlagValues()
>>> define_flags(fv)
>>> _ = fv(["train", "--checkpoint_root=/tmp/run", "--checkpoint_every_steps=500",
...         "--checkpoint_keep_last=3", "--checkpoint_keep_milestones=1,2,5"])
>>> opts = options_from_flags(fv)
>>> opts.save_policy
AnySave(policies=(EveryNSteps(n=500), OnPreemption()))
>>> opts.retention
AnyKeep(policies=(KeepLast(k=3), KeepMilestones(series=(1, 2, 5))))

Flags (all prefixed ``checkpoint_``):

* ``--checkpoint_root``: where checkpoints go (a path, ``gs://`` or ``s3://``).
* ``--checkpoint_every_steps`` / ``--checkpoint_every_seconds``: periodic saves.
* ``--checkpoint_mtbf_hours``: save at Daly's optimal interval for this MTBF
  (:class:`jaxckpt.policy.Adaptive`), capped by ``--checkpoint_max_overhead``.
* ``--checkpoint_on_preemption``: save at the next step after SIGTERM (default on).
* ``--checkpoint_keep_last``, ``--checkpoint_keep_milestones``, ``--checkpoint_keep_every``:
  retention; unset keeps every step.
* ``--checkpoint_async``: when off, ``save`` returns only once the step is committed.
* ``--checkpoint_timeout_seconds``: a save must commit within this.
* ``--checkpoint_preflight_steps``: before training, prove that a checkpoint of the
  starting state resumes bit-exactly for N steps (:func:`preflight_from_flags`, which
  runs :func:`jaxckpt.check_resume`); 0 (default) skips it.
* ``--checkpoint_preflight_root``: an empty scratch root for that check (default: a
  temporary local directory).
* ``--checkpoint_local_root``: a fast local tier (one per host, e.g. on local NVMe);
  saves commit there and ``--checkpoint_root`` becomes the durable tier.
* ``--checkpoint_promote_every_steps`` / ``--checkpoint_promote_every_seconds``: which
  local saves are promoted to the durable root (with ``--checkpoint_on_preemption``, also
  the first after SIGTERM); unset: every one.
* ``--checkpoint_local_keep_last``: retention of the local tier (steps waiting for
  promotion are always kept); the ``keep`` flags above apply to the durable root.
* ``--checkpoint_local_replicas``: ``local_replicas``, how many nodes hold each process's
  local part (1: its own only); a restore after a lost node fetches the missing parts
  from the others.
* ``--checkpoint_promotion``: ``background`` (a thread of the trainer promotes) or
  ``external`` (a ``jaxckpt promote --watch`` sidecar does).
* ``--checkpoint_restore_memory_mib``: ``restore_memory_bytes`` in MiB, the memory a
  restore from ``gs://`` or ``s3://`` may use beyond the restored arrays.
* ``--checkpoint_writer_nice``: ``writer_nice``, niceness 0-19 of the background save's
  own threads.

With no interval flag, every ``save`` call saves. The save policies combine with ``|``: a
step is saved when any of them says so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from absl import flags as absl_flags

    from jaxckpt import CheckpointManager
    from jaxckpt._options import CheckpointOptions
    from jaxckpt._preflight import ResumeReport
    from jaxckpt.policy import RetentionPolicy, SavePolicy

__all__ = [
    "FLAG_NAMES",
    "define_flags",
    "manager_from_flags",
    "options_from_flags",
    "preflight_from_flags",
    "promote_policy_from_flags",
    "retention_from_flags",
    "save_policy_from_flags",
]

FLAG_NAMES = (
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
)
_TIER_FLAGS = (
    "checkpoint_promote_every_steps",
    "checkpoint_promote_every_seconds",
    "checkpoint_local_keep_last",
    "checkpoint_local_replicas",
)


def _default_flag_values() -> absl_flags.FlagValues:
    from absl import flags

    return flags.FLAGS


def define_flags(flag_values: absl_flags.FlagValues | None = None) -> None:
    """Defines the ``checkpoint_*`` flags in ``flag_values`` (default ``absl.flags.FLAGS``).

    Calling it again on the same ``flag_values`` does nothing, so a library and its
    script may both call it.
    """
    from absl import flags

    fv = flag_values if flag_values is not None else flags.FLAGS
    if "checkpoint_root" in fv:
        return
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
        "With a local tier: keep the N newest local steps (and any waiting for promotion).",
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


def _fv(flag_values: absl_flags.FlagValues | None) -> absl_flags.FlagValues:
    return flag_values if flag_values is not None else _default_flag_values()


def save_policy_from_flags(flag_values: absl_flags.FlagValues | None = None) -> SavePolicy | None:
    """The save policy the flags describe; None (save on every call) when no interval is set."""
    from jaxckpt import policy

    fv = _fv(flag_values)
    parts = _intervals(fv.checkpoint_every_steps, fv.checkpoint_every_seconds)
    if fv.checkpoint_mtbf_hours is not None:
        parts.append(
            policy.Adaptive(fv.checkpoint_mtbf_hours, max_overhead=fv.checkpoint_max_overhead)
        )
    return _any_of(parts, fv)


def _intervals(steps: int | None, seconds: float | None) -> list[SavePolicy]:
    """EveryNSteps and EveryNSeconds for the interval flags that are set."""
    from jaxckpt import policy

    parts: list[SavePolicy] = []
    if steps is not None:
        parts.append(policy.EveryNSteps(steps))
    if seconds is not None:
        parts.append(policy.EveryNSeconds(seconds))
    return parts


def _any_of(parts: list[SavePolicy], fv: absl_flags.FlagValues) -> SavePolicy | None:
    """The interval policies combined, plus OnPreemption if asked; None without an interval."""
    from jaxckpt import policy

    if not parts:
        return None
    if fv.checkpoint_on_preemption:
        parts.append(policy.OnPreemption())
    return parts[0] if len(parts) == 1 else policy.AnySave(policies=tuple(parts))


def retention_from_flags(
    flag_values: absl_flags.FlagValues | None = None,
) -> RetentionPolicy | None:
    """The retention policy the flags describe; None (keep everything) when none is set.

    Raises:
      ValueError: ``--checkpoint_keep_milestones`` is not a list of positive integers.
    """
    from jaxckpt import policy

    fv = _fv(flag_values)
    series = None
    if fv.checkpoint_keep_milestones:
        try:
            series = [int(s) for s in fv.checkpoint_keep_milestones]
        except ValueError:
            raise ValueError(
                "--checkpoint_keep_milestones must be integers such as 1,2,5, got "
                f"{','.join(fv.checkpoint_keep_milestones)!r}"
            ) from None
    return policy.retention_from(
        keep_last=fv.checkpoint_keep_last,
        keep_milestones=series,
        keep_every=fv.checkpoint_keep_every,
    )


def promote_policy_from_flags(
    flag_values: absl_flags.FlagValues | None = None,
) -> SavePolicy | None:
    """Which local saves the flags promote; None (every one) when no promote interval is set."""

    fv = _fv(flag_values)
    parts = _intervals(fv.checkpoint_promote_every_steps, fv.checkpoint_promote_every_seconds)
    return _any_of(parts, fv)


def _tier_fields(fv: absl_flags.FlagValues) -> dict[str, Any]:
    """The local tier's options; raises if a tier flag is set without a local root."""
    from jaxckpt import policy

    if not fv.checkpoint_local_root:
        given = [f"--{name}" for name in _TIER_FLAGS if fv[name].value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --checkpoint_local_root")
        return {}
    keep = fv.checkpoint_local_keep_last
    return {
        "local_root": fv.checkpoint_local_root,
        "promote_policy": promote_policy_from_flags(fv),
        "local_retention": policy.KeepLast(keep) if keep is not None else None,
        "promotion": fv.checkpoint_promotion,
        "local_replicas": fv.checkpoint_local_replicas or 1,
    }


def options_from_flags(
    flag_values: absl_flags.FlagValues | None = None, **overrides: Any
) -> CheckpointOptions:
    """A :class:`jaxckpt.CheckpointOptions` from the parsed flags.

    ``--checkpoint_root`` and ``--checkpoint_async`` are not options; see
    :func:`manager_from_flags`. ``overrides`` replace fields (e.g. ``storage_options``).

    Raises:
      ValueError: a local tier flag is set without ``--checkpoint_local_root``.
    """
    from jaxckpt._options import CheckpointOptions

    fv = _fv(flag_values)
    fields: dict[str, Any] = {
        "save_policy": save_policy_from_flags(fv),
        "retention": retention_from_flags(fv),
        "save_timeout_s": fv.checkpoint_timeout_seconds,
        "writer_nice": fv.checkpoint_writer_nice,
        **_tier_fields(fv),
    }
    if fv.checkpoint_restore_memory_mib is not None:
        fields["restore_memory_bytes"] = fv.checkpoint_restore_memory_mib << 20
    fields.update(overrides)
    return CheckpointOptions(**fields)


def manager_from_flags(
    flag_values: absl_flags.FlagValues | None = None, **overrides: Any
) -> CheckpointManager:
    """Opens the manager of ``--checkpoint_root`` with the options the flags describe.

    With ``--nocheckpoint_async`` the returned manager's ``save`` waits until the step is
    committed before returning (a :class:`CheckpointManager` subclass).

    Raises:
      ValueError: ``--checkpoint_root`` is not set.
    """
    fv = _fv(flag_values)
    if not fv.checkpoint_root:
        raise ValueError("--checkpoint_root is required")
    options = options_from_flags(fv, **overrides)
    if fv.checkpoint_async:
        from jaxckpt import CheckpointManager

        return CheckpointManager(fv.checkpoint_root, options)
    return _sync_manager_class()(fv.checkpoint_root, options)


def preflight_from_flags(
    step_fn: Callable[[Any, Any], Any],
    state: Any,
    batches: Any,
    flag_values: absl_flags.FlagValues | None = None,
    **kwargs: Any,
) -> ResumeReport | None:
    """Runs :func:`jaxckpt.check_resume` when ``--checkpoint_preflight_steps`` is set.

    Uses ``--checkpoint_preflight_root`` (or a temporary directory) and the options the
    other flags describe; ``kwargs`` go to ``check_resume`` (e.g. ``target=``).

    Returns:
      The report (log or print it; stop the launch when ``not report.ok``), or None when
      the flag is 0.
    """
    fv = _fv(flag_values)
    if not fv.checkpoint_preflight_steps:
        return None
    from jaxckpt._preflight import check_resume

    return check_resume(
        step_fn,
        state,
        batches,
        steps=fv.checkpoint_preflight_steps,
        root=fv.checkpoint_preflight_root,
        options=options_from_flags(fv),
        **kwargs,
    )


@functools.cache
def _sync_manager_class() -> type[CheckpointManager]:
    from jaxckpt import CheckpointManager

    class SyncCheckpointManager(CheckpointManager):
        """A manager whose ``save`` returns only once the step is committed."""

        def save(self, step: int, state: Any, **kwargs: Any) -> bool:
            started = super().save(step, state, **kwargs)
            if started:
                self.wait()
            return started

    return SyncCheckpointManager
