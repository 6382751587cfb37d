"""The node's Prometheus metrics (text format at GET /metrics).

Each app gets its own registry (no process-global state): lifecycle
latencies as histograms, errors by class, warm-pool hits; sandboxes by state,
the chunk cache's counters and each sandbox's network traffic are read when
scraped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from layerstore.errors import StrataError

log = logging.getLogger("strata.api")
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _Live(Collector):
    """Gauges computed at scrape time from callbacks."""

    def __init__(self, states: Callable[[], dict[str, int]], cache: Callable[[], dict[str, int]],
                 traffic: Callable[[], dict[str, dict[str, int]]]) -> None:
        self.states = states
        self.cache = cache
        self.traffic = traffic

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("strata_sandboxes", "sandboxes on this node by state", labels=["state"])
        for state, count in sorted(self.states().items()):
            family.add_metric([state], count)
        yield family
        try:
            stats = self.cache()
        except Exception:  # a scrape must not fail because the mount is down
            stats = {}
        for key, help_text in (("hits", "chunk cache hits"), ("misses", "chunk cache misses"),
                               ("memory_hits", "in-memory chunk hits"), ("bytes_fetched", "bytes fetched from the store"),
                               ("size", "bytes in the chunk cache"), ("capacity", "chunk cache cap in bytes"),
                               ("evictions", "chunks evicted"), ("pinned", "pinned chunks")):
            if key in stats:
                yield GaugeMetricFamily(f"strata_cache_{key}", help_text, value=stats[key])
        family = GaugeMetricFamily("strata_sandbox_network_bytes", "bytes a sandbox's guest sent and received "
                                   "since its VM started", labels=["sandbox", "direction"])
        for sid, counters in sorted(self.traffic().items()):
            for direction in ("sent", "received"):
                family.add_metric([sid, direction], counters.get(f"{direction}_bytes", 0))
        yield family


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.lifecycle = Histogram("strata_lifecycle_seconds", "time spent in the VMM layer per operation",
                                   ["op"], buckets=BUCKETS, registry=self.registry)
        self.requests = Histogram("strata_http_request_seconds", "API request latency", ["method", "route", "status"],
                                  buckets=BUCKETS, registry=self.registry)
        self.errors = Counter("strata_errors_total", "errors by class (BackendUnavailable = the object store)",
                              ["kind"], registry=self.registry)
        self.pool_hits = Counter("strata_warm_pool_hits_total", "creates served from a warm pool",
                                 registry=self.registry)

    def watch(self, states: Callable[[], dict[str, int]], cache: Callable[[], dict[str, int]],
              traffic: Callable[[], dict[str, dict[str, int]]] = dict) -> None:
        self.registry.register(_Live(states, cache, traffic))

    def quietly(self, action: Callable[..., object], *args: object) -> None:
        """`action(*args)` for background work, which must go on: a
        StrataError is logged and counted, not raised."""
        try:
            action(*args)
        except StrataError as exc:
            log.error("%s%s: %s", getattr(action, "__name__", action), args, exc)
            self.error(exc)

    def error(self, exc: BaseException) -> None:
        self.errors.labels(type(exc).__name__).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
