"""Prometheus metrics of a watching promoter (``jaxckpt promote --watch --metrics-port``)."""

from __future__ import annotations

import logging
import time
from typing import Any

from jaxckpt.commit import CommitProtocol
from jaxckpt.errors import CheckpointError
from jaxckpt.records import (
    FAILED,
    PROMOTED,
    REPLICAS,
    PromotionResult,
    ReplicaIndex,
    read_requests,
    replica_holdings,
    replica_index_key,
)

log = logging.getLogger("jaxckpt")


class PromoterMetrics:
    """Gauges and counters an SRE scrapes from the promoter sidecar.

    ``jaxckpt_newest_local_step``, ``jaxckpt_newest_durable_step``,
    ``jaxckpt_promotion_lag_seconds`` (age of the oldest requested step not yet
    durable; 0 when none waits), ``jaxckpt_promotion_lag_steps`` (newest local
    step minus newest durable step), ``jaxckpt_promoted_steps_total``,
    ``jaxckpt_promoted_bytes_total``, ``jaxckpt_promotion_failures_total``; with
    replicas (``local_replicas``): ``jaxckpt_replica_bytes`` (bytes of the other
    processes' parts this local tier holds) and ``jaxckpt_replication_lag_steps``
    (this tier's newest step minus the newest step it holds a replica of).
    """

    def __init__(self, local: CommitProtocol, durable: CommitProtocol) -> None:
        try:
            import prometheus_client as prom
        except ImportError as e:
            raise CheckpointError(
                "--metrics-port needs prometheus_client: pip install 'jaxckpt[promote]'"
            ) from e
        self._local, self._durable = local, durable
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.newest_local = prom.Gauge(
            "jaxckpt_newest_local_step", "Newest step committed on the local tier", registry=r
        )
        self.newest_durable = prom.Gauge(
            "jaxckpt_newest_durable_step", "Newest step committed on the durable root", registry=r
        )
        self.lag_seconds = prom.Gauge(
            "jaxckpt_promotion_lag_seconds",
            "Seconds since the oldest requested step not yet durable was requested",
            registry=r,
        )
        self.lag_steps = prom.Gauge(
            "jaxckpt_promotion_lag_steps", "Newest local step minus newest durable step", registry=r
        )
        self.promoted = prom.Counter(
            "jaxckpt_promoted_steps", "Steps promoted to the durable root", registry=r
        )
        self.bytes = prom.Counter(
            "jaxckpt_promoted_bytes", "Chunk bytes promoted to the durable root", registry=r
        )
        self.failures = prom.Counter(
            "jaxckpt_promotion_failures", "Promotions that failed or were fenced", registry=r
        )
        self.replica_bytes = prom.Gauge(
            "jaxckpt_replica_bytes",
            "Bytes of other processes' parts (replicas) held on the local tier",
            registry=r,
        )
        self.replication_lag = prom.Gauge(
            "jaxckpt_replication_lag_steps",
            "Newest local step minus the newest step the local tier holds a replica of",
            registry=r,
        )
        self._prom: Any = prom

    def serve(self, port: int, addr: str) -> None:
        """Serves ``/metrics`` on ``addr:port`` from a daemon thread."""
        self.refresh()
        self._prom.start_http_server(port, addr=addr, registry=self.registry)

    def result(self, result: PromotionResult) -> None:
        if result.outcome == PROMOTED:
            self.promoted.inc()
            self.bytes.inc(result.nbytes)
        elif result.outcome in (FAILED, "fenced"):
            self.failures.inc()

    def refresh(self) -> None:
        """Re-reads the newest steps and the waiting requests of both roots."""
        try:
            local = self._local.latest()
            durable_refs = self._durable.visible_refs()
            requests = read_requests(self._local)
        except CheckpointError as e:
            log.warning("metrics refresh failed: %s", e)
            return
        newest_local = local.step if local is not None else -1
        newest_durable = max(durable_refs, default=-1)
        self.newest_local.set(newest_local)
        self.newest_durable.set(newest_durable)
        self.lag_steps.set(max(0, newest_local - newest_durable) if newest_local >= 0 else 0)
        waiting = [r.requested for s, r in requests.items() if s not in durable_refs]
        self.lag_seconds.set(time.time() - min(waiting) if waiting else 0.0)
        self._refresh_replicas(newest_local)

    def _refresh_replicas(self, newest_local: int) -> None:
        storage = self._local.storage
        try:
            held = replica_holdings(storage.list(REPLICAS))
            nbytes = 0
            for step, process, attempt in held:
                key = replica_index_key(step, process, attempt)
                data = storage.read(key)
                if data is not None:
                    index = ReplicaIndex.from_bytes(data, self._local.where(key))
                    nbytes += sum(d.size for d in index.files.values())
        except CheckpointError as e:
            log.warning("metrics refresh of the replicas failed: %s", e)
            return
        self.replica_bytes.set(nbytes)
        newest = max((s for s, _, _ in held), default=None)
        lag = 0 if newest is None or newest_local < 0 else max(0, newest_local - newest)
        self.replication_lag.set(lag)
