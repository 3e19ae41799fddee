"""Prometheus metrics and the recent-latency windows behind /v1/stats and the dashboard.

Names follow Prometheus conventions with units: ``kvtier_op_duration_seconds`` is a histogram
per socket op, so ``histogram_quantile(0.99, rate(kvtier_op_duration_seconds_bucket[1m]))``
works; tier figures are gauges and counters built from Engine.stats() at scrape time (a custom
collector, so no second copy of the counters is kept).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
           0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_TIER_COUNTERS = (("hits", "hits_total"), ("misses", "misses_total"),
                  ("promotions", "promotions_total"), ("demotions", "demotions_total"),
                  ("evictions", "evictions_total"), ("bytes_read", "read_bytes_total"),
                  ("bytes_written", "written_bytes_total"))
_TIER_GAUGES = (("capacity_bytes", "capacity_bytes"), ("used_bytes", "used_bytes"),
                ("blocks", "blocks"))


# What an engine connector reports (op report; kvtier.integrations.connector.ConnectorStats
# keeps them on the engine's side): name -> help. Totals since the connector started.
CONNECTOR_COUNTERS = {
    "lookups": "prefix lookups by the engine's scheduler",
    "lookup_errors": "lookups answered as a miss because kvtier was down or slow",
    "hit_tokens": "prompt tokens found in kvtier at lookup",
    "background_loads": "requests whose hit was loaded in the background (some of it was on "
                        "NVMe or Redis): that request waited, the batch did not",
    "loaded_blocks": "blocks loaded into the engine's KV cache",
    "load_errors": "blocks found at lookup but not loaded (evicted, or kvtier down): recomputed",
    "stored_blocks": "blocks stored from the engine's KV cache",
    "store_errors": "blocks not stored because kvtier was down or full",
    "seconds": "seconds spent inside the connector's calls",
}
_MAX_REPORTERS = 1024


class ConnectorReports:
    """The latest totals of each engine connector part (an engine's scheduler, each of its
    workers), summed per engine for stats["connectors"] and /metrics. Thread-safe."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, str], dict[str, float]] = {}
        self._lock = threading.Lock()

    def update(self, engine: str, part: str, counters: dict[str, Any]) -> None:
        from kvtier.errors import BadRequest
        if not 0 < len(engine) <= 100 or not 0 < len(part) <= 100:
            raise BadRequest("report needs an engine and a part name of 1 to 100 characters")
        clean: dict[str, float] = {}
        for name, value in counters.items():
            if name not in CONNECTOR_COUNTERS:
                raise BadRequest(f"unknown connector counter {name!r}; known: "
                                 f"{', '.join(CONNECTOR_COUNTERS)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0 <= value < float("inf")):
                raise BadRequest(f"counter {name} must be a finite number >= 0, got {value!r}")
            clean[name] = float(value)
        with self._lock:
            if (engine, part) not in self._parts and len(self._parts) >= _MAX_REPORTERS:
                self._parts.pop(next(iter(self._parts)))     # the oldest reporter goes
            self._parts[(engine, part)] = clean

    def totals(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        with self._lock:
            for (engine, _part), counters in self._parts.items():
                acc = out.setdefault(engine, dict.fromkeys(CONNECTOR_COUNTERS, 0.0))
                for name, value in counters.items():
                    acc[name] += value
        return out


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        s = self._stats()
        for key, name in _TIER_GAUGES:
            g = GaugeMetricFamily(f"kvtier_tier_{name}", f"tier {key}", labels=["tier"])
            for tier, d in s["tiers"].items():
                g.add_metric([tier], float(d.get(key) or 0))
            yield g
        for key, name in _TIER_COUNTERS:
            c = CounterMetricFamily(f"kvtier_tier_{name.removesuffix('_total')}",
                                    f"tier {key}", labels=["tier"])
            for tier, d in s["tiers"].items():
                c.add_metric([tier], float(d.get(key) or 0))
            yield c
        for key in ("checksum_failures", "gets", "get_hits", "puts", "nvme_full",
                    "flushed_blocks", "compactions", "records_dropped"):
            yield CounterMetricFamily(f"kvtier_{key}", key.replace("_", " "), value=s[key])
        yield GaugeMetricFamily("kvtier_hit_ratio", "get hits / gets since start",
                                value=s["hit_ratio"] or 0.0)
        remote = s["tiers"].get("remote")
        if remote is not None:
            g = GaugeMetricFamily("kvtier_remote_breaker_open",
                                  "1 while a remote shard's circuit breaker is not closed",
                                  labels=["shard", "state"])
            for shard, b in remote.get("breakers", {}).items():
                g.add_metric([shard, b["state"]], float(b["state"] != "closed"))
            yield g
            for key in ("errors", "skipped", "foreign", "checksum_failures"):
                yield CounterMetricFamily(f"kvtier_remote_{key}", f"remote tier {key}",
                                          value=remote.get(key, 0))
        busy = s.get("busy_poll")
        if busy is not None:
            yield CounterMetricFamily("kvtier_busy_poll_seconds",
                                      "seconds the socket loop spent polling instead of sleeping",
                                      value=busy["spun_s"])
        connectors = s.get("connectors") or {}
        for name, doc in CONNECTOR_COUNTERS.items():
            c = CounterMetricFamily(f"kvtier_connector_{name}", doc, labels=["engine"])
            for engine, counters in connectors.items():
                c.add_metric([engine], counters.get(name, 0.0))
            yield c
        yield GaugeMetricFamily("kvtier_leases", "leases held", value=s["leases"])
        yield GaugeMetricFamily("kvtier_uptime_seconds", "seconds since start",
                                value=s["uptime_s"])


class Metrics:
    """Op latencies (histogram + a window of recent samples) and the registry to expose."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.op_duration = Histogram("kvtier_op_duration_seconds", "socket op latency",
                                     ["op"], buckets=BUCKETS, registry=self.registry)
        self.op_errors = Counter("kvtier_op_errors_total", "socket ops answered with an error",
                                 ["op"], registry=self.registry)
        self._recent: dict[str, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=4096))
        self._lock = threading.Lock()
        self._collector: _EngineCollector | None = None

    def bind(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._collector = _EngineCollector(stats)
        self.registry.register(self._collector)

    def observe(self, op: str, seconds: float, ok: bool) -> None:
        self.op_duration.labels(op).observe(seconds)
        if not ok:
            self.op_errors.labels(op).inc()
        with self._lock:
            self._recent[op].append((time.monotonic(), seconds))

    def latency(self, window: float = 60.0) -> dict[str, dict[str, float]]:
        """p50/p99/max in ms and the count per op over the last window seconds."""
        now = time.monotonic()
        out = {}
        with self._lock:
            items = {op: [s for t, s in d if now - t <= window] for op, d in self._recent.items()}
        for op, samples in items.items():
            if samples:
                a = np.asarray(samples) * 1000
                out[op] = {"p50_ms": round(float(np.percentile(a, 50)), 4),
                           "p99_ms": round(float(np.percentile(a, 99)), 4),
                           "max_ms": round(float(a.max()), 4), "count": int(a.size)}
        return out

    def histogram(self) -> dict[str, Any]:
        """Bucket counts of all ops together, for the dashboard's histogram and CDF."""
        counts = np.zeros(len(BUCKETS) + 1, dtype=np.int64)
        for metric in self.op_duration.collect():
            for sample in metric.samples:
                if sample.name.endswith("_bucket"):
                    le = sample.labels["le"]
                    i = len(BUCKETS) if le == "+Inf" else BUCKETS.index(float(le))
                    counts[i] += int(sample.value)
        cumulative = counts.tolist()
        per_bucket = [cumulative[0]] + [cumulative[i] - cumulative[i - 1]
                                        for i in range(1, len(cumulative))]
        return {"le_seconds": [*BUCKETS, None], "counts": per_bucket, "cumulative": cumulative}

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
