"""The jaxckpt error family.

Every error jaxckpt raises subclasses :class:`CheckpointError`; where a builtin
fits, the error also subclasses it so existing ``except FileNotFoundError``
code keeps working. Each docstring says how to fix the problem.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every jaxckpt error.

    Catch this to handle any checkpoint failure; the message names the root,
    step, tree path or chunk involved.
    """


class StepNotFoundError(CheckpointError, FileNotFoundError):
    """The requested step has no committed checkpoint under the root.

    The message lists the committed steps; pick one of them, or call
    ``restore()`` without a step to get the newest.
    """


class StepAlreadyExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint for this step already exists.

    Steps are immutable once committed. Save under a new step number, or delete
    the old step first (``CheckpointManager.delete(step)``).
    """


class UncommittedStepError(CheckpointError):
    """The step has data but no valid commit marker (a partial save).

    Partial steps are never restored. Restore a committed step instead; the
    partial data is removed by garbage collection (``jaxckpt gc ROOT``).
    """


class CorruptCheckpointError(CheckpointError):
    """Stored data does not match the checksums recorded at commit time.

    The message names the step, the tree path and the chunk. Restore an older
    step (``restore()`` without a step falls back automatically), and check the
    storage system that held the damaged object.
    """


class TreeMismatchError(CheckpointError, ValueError):
    """The restore target's tree differs from the saved tree.

    The message lists every missing, extra or mismatched path with shapes and
    dtypes. Build the target from the same model/optimizer configuration that
    was saved, or restore without a target to inspect what was saved.
    """


class UnsupportedLeafError(CheckpointError, TypeError):
    """A leaf of the state has a type jaxckpt cannot save.

    Supported leaves: jax.Array, numpy arrays and scalars, PRNG key arrays,
    and int, float, bool, str and None. Convert the named leaf, or remove it
    from the saved state.
    """


class StorageError(CheckpointError, OSError):
    """The storage backend failed (permissions, missing bucket, full disk, network).

    The message names the URI. Fix access to the root; committed steps are
    never modified by a failed operation.
    """


class SaveFailedError(CheckpointError):
    """A background save failed; the step was not committed.

    Earlier committed steps are intact. The ``__cause__`` carries the
    underlying error; fix it and save again.
    """


class UnsupportedFormatError(CheckpointError):
    """The checkpoint was written by a newer jaxckpt format version.

    Upgrade jaxckpt to read it.
    """


class NotACheckpointRootError(CheckpointError, FileNotFoundError):
    """The path is not a jaxckpt root (no ``jaxckpt.json`` record).

    Check the path; a root is created by the first ``CheckpointManager`` that
    opens it for writing.
    """


class SaveTimeoutError(CheckpointError, TimeoutError):
    """A save did not finish within its timeout (a dead host or a stalled store).

    The step is not committed. Check the other hosts and the storage endpoint,
    or raise ``save_timeout_s``.
    """


class WriterFencedError(CheckpointError):
    """A newer writer took over the root; this manager may no longer commit or delete.

    Another process opened the root for writing (a restarted job, a duplicate
    pod), which fences every older writer so that a zombie cannot overwrite or
    delete what the new job relies on. Stop this process; if it is the job you
    want to keep, restart it (it will take over again and resume from the
    newest committed step).
    """


class PromotionError(CheckpointError):
    """A step saved to the local tier could not be promoted to the durable root.

    The local copy is kept, and so is its promotion request: fix the cause the
    message names (credentials, a full bucket, a corrupt local chunk) and run
    ``jaxckpt promote LOCAL_ROOT ROOT`` to finish the job, or save again.
    """


class PromotionTimeoutError(PromotionError, TimeoutError):
    """A step did not become durable within the time ``wait_durable`` allowed.

    Promotion goes on in the background (or in the ``jaxckpt promote`` sidecar):
    wait longer, check the promoter's log and metrics, or run ``jaxckpt promote``.
    """


class LocalRootInUseError(CheckpointError):
    """A local root serves another durable root than the one this job was given.

    A local tier records the durable root it serves (``tier.json``) when a
    tiered writer first creates or adopts it, and refuses any other: two jobs
    given one ``local_root`` would otherwise resume from, and promote, each
    other's steps. Give each job a local root of its own (e.g. one per run
    name), or, if the old job is gone for good, delete its local root.
    """


class PlacementError(CheckpointError, ValueError):
    """``local_replicas`` asks for more copies than the job has nodes (failure domains).

    Every copy of a process's local part lives on a distinct node (its host
    name, or ``JAXCKPT_NODE_ID``). Lower ``local_replicas`` to at most the
    number of nodes named in the message, or run on more nodes.
    """


class PeerError(CheckpointError, ConnectionError):
    """A transfer between two processes of the job failed (replication or a fetch).

    The message names the peer process, its address and what failed: a
    refused authentication (the peer is not of this job), a timeout (a dead
    or stalled peer: raise ``peer_timeout_s`` for a slow one), or bytes that
    do not match their CRC32C. The step's local commit fails; older steps are
    intact, and a restore reads another copy or the durable root.
    """


class PeerAuthError(PeerError):
    """A peer connection failed the job's shared-secret authentication.

    Something that is not a process of this job connected (or was connected
    to); nothing was read or written. Check that every process of the job
    uses the same coordination service and that the listener's address is not
    reused by another job.
    """
