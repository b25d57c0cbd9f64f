"""Joins a test child to its group of real JAX processes on this machine."""

from __future__ import annotations

import os


def join_group(coordinator: str, num_processes: int, process_id: int) -> None:
    """Starts JAX on the CPU (one device, gloo collectives) and joins the group whose
    coordination service runs at ``coordinator`` (process 0 binds it)."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        coordinator_bind_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )
