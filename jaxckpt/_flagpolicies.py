"""The policies that the ``checkpoint_*`` flags describe (save, retention, promotion,
and the local tier's options), for :mod:`jaxckpt.flags`; import them from there.

absl and the policies are imported inside the functions, like the rest of
:mod:`jaxckpt.flags`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxckpt._flagdefs import flag_error, milestones_problem, tier_problem

if TYPE_CHECKING:
    from absl import flags as absl_flags

    from jaxckpt.policy import RetentionPolicy, SavePolicy

__all__ = [
    "flag_values_or_default",
    "promote_policy_from_flags",
    "retention_from_flags",
    "save_policy_from_flags",
    "tier_fields",
]


def _default_flag_values() -> absl_flags.FlagValues:
    from absl import flags

    return flags.FLAGS


def flag_values_or_default(flag_values: absl_flags.FlagValues | None) -> absl_flags.FlagValues:
    """``flag_values``, else ``absl.flags.FLAGS``."""
    return flag_values if flag_values is not None else _default_flag_values()


def save_policy_from_flags(flag_values: absl_flags.FlagValues | None = None) -> SavePolicy | None:
    """The save policy the flags describe; None (save on every call) when no interval is set."""
    from jaxckpt import policy

    fv = flag_values_or_default(flag_values)
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
      CheckpointFlagError: ``--checkpoint_keep_milestones`` is not a list of positive integers.
    """
    from jaxckpt import policy

    fv = flag_values_or_default(flag_values)
    series = None
    if fv.checkpoint_keep_milestones:
        problem = milestones_problem(fv.checkpoint_keep_milestones)
        if problem is not None:
            raise flag_error(problem)
        series = [int(s) for s in fv.checkpoint_keep_milestones]
    return policy.retention_from(
        keep_last=fv.checkpoint_keep_last,
        keep_milestones=series,
        keep_every=fv.checkpoint_keep_every,
    )


def promote_policy_from_flags(
    flag_values: absl_flags.FlagValues | None = None,
) -> SavePolicy | None:
    """Which local saves the flags promote; None (every one) when no promote interval is set."""

    fv = flag_values_or_default(flag_values)
    parts = _intervals(fv.checkpoint_promote_every_steps, fv.checkpoint_promote_every_seconds)
    return _any_of(parts, fv)


def tier_fields(fv: absl_flags.FlagValues) -> dict[str, Any]:
    """The local tier's options; raises if a tier flag is set without a local root."""
    from jaxckpt import policy

    problem = tier_problem({name: fv[name].value for name in fv})
    if problem is not None:
        raise flag_error(problem)
    if not fv.checkpoint_local_root:
        return {}
    keep = fv.checkpoint_local_keep_last
    return {
        "local_root": fv.checkpoint_local_root,
        "promote_policy": promote_policy_from_flags(fv),
        "local_retention": policy.KeepLast(keep) if keep is not None else None,
        "promotion": fv.checkpoint_promotion,
        "local_replicas": fv.checkpoint_local_replicas or 1,
    }
