"""The ledger's events as metrics: ``jax.monitoring`` and, optionally, Prometheus.

The events Orbax 0.12.8 records for a save and a restore are recorded under its
names, so a dashboard built on Orbax's events sees jaxckpt's saves too:
``/jax/orbax/write/blocking_duration_secs``, ``/jax/orbax/write/total_duration_secs``,
``/jax/orbax/write/gbytes``, ``/jax/orbax/write/gbytes_per_sec``,
``/jax/orbax/write/success``, ``/jax/orbax/read/total_duration_secs``,
``/jax/checkpoint/read/gbytes`` and ``/jax/checkpoint/read/gbytes_per_sec`` (bytes are
this process's). The rest are under ``/jax/jaxckpt/``: ``restore/lost_steps``,
``restore/older_step`` (an event with ``why``: fallback, healing), ``promotion/durable_secs``
(from a save's start until it was durable), ``retention/freed_gbytes`` and
``startup/{open,restored,first_save}_secs`` (since the process started) and
``startup/compile_secs`` (``CheckpointManager.compile``, with ``outcome``: loaded,
compiled, recompiled). As Orbax does, only the primary process records them.

With ``metrics_port`` the primary also serves Prometheus metrics (see
:class:`TrainerMetrics`), as the promoter sidecar does.
"""

from __future__ import annotations

import logging
from typing import Any

from jaxckpt.errors import CheckpointError

log = logging.getLogger("jaxckpt")

GIB = float(1 << 30)


def prometheus_client(what: str) -> Any:
    """The ``prometheus_client`` module.

    Raises:
      CheckpointError: it is not installed (the message says how to install it).
    """
    try:
        import prometheus_client as prom
    except ImportError as e:
        raise CheckpointError(
            f"{what} needs prometheus_client: pip install 'jaxckpt[promote]'"
        ) from e
    return prom


class TrainerMetrics:
    """Prometheus metrics of a training job's checkpoints (served by its primary).

    ``jaxckpt_reached_step``, ``jaxckpt_saved_step`` (newest committed save),
    ``jaxckpt_restored_step``, ``jaxckpt_saves_total``,
    ``jaxckpt_save_blocking_seconds_total``, ``jaxckpt_saved_bytes_total``,
    ``jaxckpt_last_save_blocking_seconds``, ``jaxckpt_restores_total``,
    ``jaxckpt_restore_older_steps_total``, ``jaxckpt_lost_steps_total``,
    ``jaxckpt_promotion_durable_seconds`` (the last promoted save's),
    ``jaxckpt_retention_freed_bytes_total`` and ``jaxckpt_ledger_write_failures``.
    """

    def __init__(self) -> None:
        prom = prometheus_client("metrics_port")
        self.registry = r = prom.CollectorRegistry()
        self._prom = prom
        g, c = prom.Gauge, prom.Counter
        self.reached = g("jaxckpt_reached_step", "Newest step save() was called with", registry=r)
        self.saved = g("jaxckpt_saved_step", "Newest committed save", registry=r)
        self.restored = g("jaxckpt_restored_step", "Step the last restore returned", registry=r)
        self.saves = c("jaxckpt_saves", "Committed saves", registry=r)
        self.blocking = c(
            "jaxckpt_save_blocking_seconds", "Seconds save() blocked the loop", registry=r
        )
        self.last_blocking = g(
            "jaxckpt_last_save_blocking_seconds", "Blocking seconds of the last save", registry=r
        )
        self.bytes = c("jaxckpt_saved_bytes", "Bytes this process saved", registry=r)
        self.restores = c("jaxckpt_restores", "Restores", registry=r)
        self.older = c(
            "jaxckpt_restore_older_steps", "Restores that took an older step", registry=r
        )
        self.lost = c("jaxckpt_lost_steps", "Steps redone after restarts", registry=r)
        self.durable = g(
            "jaxckpt_promotion_durable_seconds",
            "Seconds from the last promoted save's start until it was durable",
            registry=r,
        )
        self.freed = c("jaxckpt_retention_freed_bytes", "Bytes retention deleted", registry=r)
        self.failures = g("jaxckpt_ledger_write_failures", "Ledger writes that failed", registry=r)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serves ``/metrics`` on ``addr:port`` from a daemon thread (until :meth:`close`)."""
        served = self._prom.start_http_server(port, addr=addr, registry=self.registry)
        self._server = served[0] if isinstance(served, tuple) else None

    def close(self) -> None:
        server, self._server = getattr(self, "_server", None), None
        if server is not None:
            server.shutdown()
            server.server_close()


class Monitor:
    """Records the ledger's events as metrics (a no-op on processes other than the primary).

    Args:
      primary: this process records (the primary, as Orbax does).
      metrics_port: serve Prometheus metrics on this port (None: none).
    """

    def __init__(self, *, primary: bool, metrics_port: int | None) -> None:
        self._on = primary
        self.prometheus: TrainerMetrics | None = None
        if primary and metrics_port is not None:
            metrics = TrainerMetrics()
            try:
                metrics.serve(metrics_port)
            except OSError as e:  # metrics are not worth failing the job for: said
                log.warning("Prometheus metrics not served on port %d: %s", metrics_port, e)
            else:
                self.prometheus = metrics

    def close(self) -> None:
        """Stops serving Prometheus metrics."""
        if self.prometheus is not None:
            self.prometheus.close()

    def _duration(self, name: str, secs: float) -> None:
        import jax

        jax.monitoring.record_event_duration_secs(name, secs)

    def _scalar(self, name: str, value: float) -> None:
        import jax

        jax.monitoring.record_scalar(name, value)

    def reached(self, step: int) -> None:
        if self.prometheus is not None:
            self.prometheus.reached.set(step)

    def saved(self, step: int, blocking_s: float, total_s: float, nbytes: int) -> None:
        if not self._on:
            return
        import jax

        self._duration("/jax/orbax/write/blocking_duration_secs", blocking_s)
        self._duration("/jax/orbax/write/total_duration_secs", total_s)
        self._scalar("/jax/orbax/write/gbytes", nbytes / GIB)
        if total_s > 0:
            self._scalar("/jax/orbax/write/gbytes_per_sec", nbytes / GIB / total_s)
        jax.monitoring.record_event("/jax/orbax/write/success")
        if (p := self.prometheus) is not None:
            p.saved.set(step)
            p.saves.inc()
            p.blocking.inc(blocking_s)
            p.last_blocking.set(blocking_s)
            p.bytes.inc(nbytes)

    def restored(self, step: int, seconds: float, nbytes: int, why: str | None) -> None:
        if not self._on:
            return
        import jax

        self._duration("/jax/orbax/read/total_duration_secs", seconds)
        self._scalar("/jax/checkpoint/read/gbytes", nbytes / GIB)
        if seconds > 0:
            self._scalar("/jax/checkpoint/read/gbytes_per_sec", nbytes / GIB / seconds)
        if why is not None:
            jax.monitoring.record_event("/jax/jaxckpt/restore/older_step", why=why)
        if (p := self.prometheus) is not None:
            p.restored.set(step)
            p.restores.inc()
            if why is not None:
                p.older.inc()

    def lost(self, steps: int) -> None:
        """The steps the restart lost (the previous run's reached step minus the restored)."""
        if self._on:
            self._scalar("/jax/jaxckpt/restore/lost_steps", steps)
            if (p := self.prometheus) is not None:
                p.lost.inc(steps)

    def startup(self, phase: str, secs: float) -> None:
        if self._on:
            self._duration(f"/jax/jaxckpt/startup/{phase}_secs", secs)

    def compiled(self, outcome: str, secs: float) -> None:
        if self._on:
            import jax

            jax.monitoring.record_event_duration_secs(
                "/jax/jaxckpt/startup/compile_secs", secs, outcome=outcome
            )

    def promoted(self, durable_s: float) -> None:
        if not self._on:
            return
        self._duration("/jax/jaxckpt/promotion/durable_secs", durable_s)
        if self.prometheus is not None:
            self.prometheus.durable.set(durable_s)

    def deleted(self, nbytes: int) -> None:
        if not self._on:
            return
        self._scalar("/jax/jaxckpt/retention/freed_gbytes", nbytes / GIB)
        if self.prometheus is not None:
            self.prometheus.freed.inc(nbytes)

    def failures(self, count: int) -> None:
        if self.prometheus is not None:
            self.prometheus.failures.set(count)
