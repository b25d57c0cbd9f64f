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

Flags (all prefixed ``checkpoint_``; ``define_flags`` makes them key flags of its caller,
so the script's ``--help`` lists them):

* ``--checkpoint_root``: where checkpoints go (a path, ``gs://`` or ``s3://``); required
  unless ``--nocheckpoint_enabled``, which gives a manager that saves nothing and finds
  no step.
* ``--checkpoint_every_steps`` / ``--checkpoint_every_seconds``: periodic saves.
* ``--checkpoint_mtbf_hours``: save at Daly's optimal interval for this MTBF
  (:class:`jaxckpt.policy.Adaptive`), capped by ``--checkpoint_max_overhead``.
* ``--checkpoint_on_preemption``: save at the next step after SIGTERM (default on).
* ``--checkpoint_keep_last``, ``--checkpoint_keep_milestones``, ``--checkpoint_keep_every``:
  retention; unset keeps every step.
* ``--checkpoint_async``: when off, ``save`` returns only once the step is committed.
* ``--checkpoint_timeout_seconds``: a save must commit within this.
* ``--checkpoint_tolerate_failed_saves``: failed saves in a row training goes on after
  (``tolerate_failed_saves``); 0 (default): the first raises.
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
* ``--checkpoint_local_keep_last``: retention of the local tier (the newest
  ``promote_backlog`` steps waiting for promotion are kept too); the ``keep`` flags
  above apply to the durable root.
* ``--checkpoint_local_replicas``: ``local_replicas``, how many nodes hold each process's
  local part (1: its own only); a restore after a lost node fetches the missing parts
  from the others.
* ``--checkpoint_promotion``: ``background`` (a thread of the trainer promotes) or
  ``external`` (a ``jaxckpt promote --watch`` sidecar does).
* ``--checkpoint_restore_memory_mib``: ``restore_memory_bytes`` in MiB, the memory a
  restore from ``gs://`` or ``s3://`` may use beyond the restored arrays.
* ``--checkpoint_writer_nice``: ``writer_nice``, niceness 0-19 of the background save's
  own threads.
* ``--checkpoint_init_from=ROOT[:STEP]``, ``--checkpoint_init_partial``,
  ``--checkpoint_init_rename=SAVED=NEW,...``: a new run starts from another root's step
  (:func:`init_from_flags`), e.g. pretrained params.

A missing or inconsistent flag raises :class:`CheckpointFlagError`, an
``absl.app.UsageError`` (under ``app.run``: the usage and the problem, no traceback);
inconsistent combinations are refused when the command line is parsed already. A
config-file trainer builds the same options from a plain mapping
(:func:`options_from_mapping`, :func:`manager_from_mapping`).

With no interval flag, every ``save`` call saves. The save policies combine with ``|``: a
step is saved when any of them says so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from jaxckpt._flagdefs import FLAG_NAMES, _flag_error_class, define_all, flag_error, init_problem
from jaxckpt._flagpolicies import flag_values_or_default, tier_fields
from jaxckpt._flagpolicies import promote_policy_from_flags as promote_policy_from_flags
from jaxckpt._flagpolicies import retention_from_flags as retention_from_flags
from jaxckpt._flagpolicies import save_policy_from_flags as save_policy_from_flags

if TYPE_CHECKING:
    from absl import flags as absl_flags

    from jaxckpt import CheckpointManager
    from jaxckpt._options import CheckpointOptions
    from jaxckpt.restoring import ResumeReport

CheckpointFlagError: type[Exception]
"""A ``checkpoint_*`` flag is missing or inconsistent (an ``absl.app.UsageError``, a
``CheckpointError`` and a ``ValueError``): made on first use, as ``absl.app`` defines
flags when imported."""

__all__ = [
    "FLAG_NAMES",
    "CheckpointFlagError",
    "define_flags",
    "flags_from_mapping",
    "init_from_flags",
    "manager_from_flags",
    "manager_from_mapping",
    "options_from_flags",
    "options_from_mapping",
    "preflight_from_flags",
    "promote_policy_from_flags",
    "retention_from_flags",
    "save_policy_from_flags",
]


def define_flags(flag_values: absl_flags.FlagValues | None = None) -> None:
    """Defines the ``checkpoint_*`` flags in ``flag_values`` (default ``absl.flags.FLAGS``)
    and makes them key flags of the calling module, so its ``--help`` lists them.

    Calling it again on the same ``flag_values`` defines nothing new, so a library and
    its script may both call it (each gets them as key flags). A library that calls it
    for its scripts: they list the flags with ``flags.adopt_module_key_flags(library)``.
    """
    from absl import flags

    fv = flag_values if flag_values is not None else flags.FLAGS
    if "checkpoint_root" not in fv:
        define_all(fv)
    flags.disclaim_key_flags()  # this module: the key flags go to the caller of define_flags
    for name in FLAG_NAMES:
        flags.declare_key_flag(name, flag_values=fv)


def options_from_flags(
    flag_values: absl_flags.FlagValues | None = None, **overrides: Any
) -> CheckpointOptions:
    """A :class:`jaxckpt.CheckpointOptions` from the parsed flags.

    ``--checkpoint_root`` and ``--checkpoint_async`` are not options; see
    :func:`manager_from_flags`. ``overrides`` replace fields (e.g. ``storage_options``).

    Raises:
      CheckpointFlagError: a local tier flag is set without ``--checkpoint_local_root``.
    """
    from jaxckpt._options import CheckpointOptions

    fv = flag_values_or_default(flag_values)
    fields: dict[str, Any] = {
        "save_policy": save_policy_from_flags(fv),
        "retention": retention_from_flags(fv),
        "save_timeout_s": fv.checkpoint_timeout_seconds,
        "tolerate_failed_saves": fv.checkpoint_tolerate_failed_saves,
        "writer_nice": fv.checkpoint_writer_nice,
        **tier_fields(fv),
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
    committed before returning (a :class:`CheckpointManager` subclass). With
    ``--nocheckpoint_enabled`` it is a manager that saves nothing and finds no step.

    Raises:
      CheckpointFlagError: ``--checkpoint_root`` is not set (and checkpointing is on), or
        the flags are inconsistent. Raised in ``main`` under ``absl.app.run``, it is
        reported as a usage error: the usage message and the problem, no traceback.
    """
    fv = flag_values_or_default(flag_values)
    problem = init_problem({name: fv[name].value for name in fv})
    if not fv.checkpoint_enabled:
        from jaxckpt._disabled import DisabledCheckpointManager

        return DisabledCheckpointManager(fv.checkpoint_root)
    if not fv.checkpoint_root:
        problem = "--checkpoint_root is required (or --nocheckpoint_enabled: no checkpoints)"
    elif fv.checkpoint_init_from and _same_root(fv.checkpoint_init_from, fv.checkpoint_root):
        problem = "--checkpoint_init_from names --checkpoint_root itself (a run resumes it anyway)"
    if problem is not None:
        raise flag_error(problem)
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
    fv = flag_values_or_default(flag_values)
    if not fv.checkpoint_preflight_steps:
        return None
    from jaxckpt.workflows import check_resume

    return check_resume(
        step_fn,
        state,
        batches,
        steps=fv.checkpoint_preflight_steps,
        root=fv.checkpoint_preflight_root,
        options=options_from_flags(fv),
        **kwargs,
    )


def init_from_flags(
    mgr: CheckpointManager,
    target: Any,
    flag_values: absl_flags.FlagValues | None = None,
    **restore_kwargs: Any,
) -> Any:
    """The state a new run starts from with ``--checkpoint_init_from`` (like MaxText's
    ``load_parameters_path``); None when the flag is not set, or when ``mgr`` already has a
    step (a restarted run resumes its own checkpoint instead: restore that).

    The step (``ROOT:STEP``, else the newest) is restored into ``target`` with
    ``partial=--checkpoint_init_partial`` and ``rename=--checkpoint_init_rename``: pass the
    params' abstract tree and ``--checkpoint_init_partial`` to take only the params of a
    saved train state, or the whole abstract state to continue a run under a new root.

    Args:
      mgr: this run's manager (its ``latest_step`` is asked; collective).
      target: as ``CheckpointManager.restore``'s ``target``.
      restore_kwargs: more arguments of ``restore`` (e.g. ``allow_lossy_cast``).

    Raises:
      CheckpointFlagError: the init flags are inconsistent, or ``--checkpoint_init_from``
        names no root or a step it does not hold (a usage error under ``absl.app.run``).
      TreeMismatchError: as ``CheckpointManager.restore``.
    """
    import logging

    from jaxckpt import CheckpointManager
    from jaxckpt.cli import split_source
    from jaxckpt.errors import NotACheckpointRootError, StepNotFoundError, StorageError

    fv = flag_values_or_default(flag_values)
    problem = init_problem({name: fv[name].value for name in fv})
    if problem is not None:
        raise flag_error(problem)
    if not fv.checkpoint_init_from:
        return None
    log = logging.getLogger("jaxckpt")
    if (own := mgr.latest_step()) is not None:
        log.info("--checkpoint_init_from ignored: %s has step %d to resume", mgr.root, own)
        return None
    root, step = split_source(fv.checkpoint_init_from)
    rename = dict(r.split("=", 1) for r in fv.checkpoint_init_rename) or None
    try:  # a root or step that is not there is the flag's mistake: a usage error
        source = CheckpointManager(root, read_only=True)
        if step is not None:
            source.metadata(step)
    except (NotACheckpointRootError, StepNotFoundError, StorageError) as e:
        raise flag_error(f"--checkpoint_init_from={fv.checkpoint_init_from}: {e}") from e
    with source:
        state = source.restore(
            step, target=target, partial=fv.checkpoint_init_partial, rename=rename, **restore_kwargs
        )
        log.info("initialised from step %d of %s", source.restored_step, source.root)
    return state


def flags_from_mapping(config: Mapping[str, Any]) -> absl_flags.FlagValues:
    """A parsed, validated ``FlagValues`` of the ``checkpoint_*`` flags set from ``config``.

    Keys are flag names with or without the ``checkpoint_`` prefix (``root``,
    ``every_steps``, ``keep_milestones``, ...); values are what the flag holds (``5``,
    ``[1, 2, 5]``, ``None``) or its command-line text (``"5"``, ``"1,2,5"``).

    Raises:
      CheckpointFlagError: an unknown key, or a value the flag refuses (named).
    """
    from absl import flags

    fv = flags.FlagValues()
    define_all(fv)
    try:
        for key, value in dict(config).items():
            name = key if key.startswith("checkpoint_") else f"checkpoint_{key}"
            if name not in FLAG_NAMES:
                known = ", ".join(n.removeprefix("checkpoint_") for n in FLAG_NAMES)
                raise flag_error(f"unknown checkpoint setting {key!r}; known: {known}")
            if value is None:
                fv[name].value = None
            else:
                fv[name].parse(value)
            fv[name].using_default_value = False
        fv.mark_as_parsed()
        fv.validate_all_flags()
    except flags.Error as e:
        raise flag_error(str(e)) from None
    return fv


def options_from_mapping(config: Mapping[str, Any], **overrides: Any) -> CheckpointOptions:
    """:func:`options_from_flags` for a config-file trainer: the settings of ``config``
    (see :func:`flags_from_mapping`), e.g. ``{"every_steps": 500, "keep_last": 3}``."""
    return options_from_flags(flags_from_mapping(config), **overrides)


def manager_from_mapping(config: Mapping[str, Any], **overrides: Any) -> CheckpointManager:
    """:func:`manager_from_flags` for a config-file trainer, e.g. from a YAML section
    ``{"root": "gs://b/run", "every_steps": 500, "keep_last": 3}`` (see
    :func:`flags_from_mapping`); ``{"enabled": False}`` gives a manager that saves nothing.

    >>> import tempfile
    >>> with manager_from_mapping({"root": tempfile.mkdtemp(), "every_steps": 2}) as mgr:
    ...     mgr.save(1, {"w": 1.0}), mgr.save(2, {"w": 2.0})
    (False, True)
    """
    return manager_from_flags(flags_from_mapping(config), **overrides)


def __getattr__(name: str) -> Any:
    if name == "CheckpointFlagError":  # a class made on first use: absl.app defines flags
        return _flag_error_class()
    raise AttributeError(f"module 'jaxckpt.flags' has no attribute {name!r}")


def _same_root(a: str, b: str) -> bool:
    from jaxckpt.cli import split_source
    from jaxckpt.errors import CheckpointError
    from jaxckpt.storage import parse_root

    try:
        return bool(parse_root(split_source(a)[0]) == parse_root(b))
    except (CheckpointError, ValueError):  # an invalid root is reported when it is opened
        return False


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
