"""Prometheus metrics of one buffer instance (its own registry, so several apps can share a process).

- ``headrace_buffer_groups{state=queued|leased|held|dead_lettered}`` (held groups are also
  leased) and the counters ``headrace_buffer_*_total`` (consumed, evicted_stale, duplicates, rejected, throttled) are read from the store's counts at
  scrape time, so they always agree with GET /v1/stats; counts are of groups (throttled: requests).
- ``headrace_buffer_request_seconds{method,route,status}``: latency histogram of every request,
  labelled by method (GET/HEAD/POST/PUT, any other ``other``), route template
  (``/v1/leases/{lease_id}/ack``; unknown paths ``other``) and status, so label sets stay bounded.
- ``headrace_buffer_ingest_bytes_total``: bytes of accepted POST /v1/groups bodies.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _StoreCollector:
    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        g = GaugeMetricFamily("headrace_buffer_groups", "groups held, by state", labels=["state"])
        g.add_metric(["queued"], s["queued"])
        g.add_metric(["leased"], s["leased"])
        g.add_metric(["held"], s["held"])
        g.add_metric(["dead_lettered"], s["dead_lettered"])
        yield g
        yield GaugeMetricFamily("headrace_buffer_capacity", "max queued + leased groups (held not counted)", value=s["capacity"])
        yield GaugeMetricFamily("headrace_buffer_policy_version", "latest trainer policy version",
                                value=s["policy_version"])
        for key, doc in (("consumed", "groups acked"), ("evicted_stale", "groups evicted as stale"),
                         ("duplicates", "groups refused as already seen"),
                         ("rejected", "groups refused as invalid (422/413)"),
                         ("throttled", "requests answered 429")):
            yield CounterMetricFamily(f"headrace_buffer_{key}", doc, value=s[key])


class BufferMetrics:
    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StoreCollector(stats))  # type: ignore[arg-type]
        self.latency = Histogram("headrace_buffer_request_seconds", "request latency", ["method", "route", "status"],
                                 buckets=_BUCKETS, registry=self.registry)
        self.ingest_bytes = Counter("headrace_buffer_ingest_bytes", "bytes of accepted POST /v1/groups bodies",
                                    registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
