"""Prometheus metrics: a collector that asks the actors for their numbers on each scrape.

The hot path never touches a metrics library: the controller and the units
count into plain ``Stats`` objects, and this collector turns one round of their
snapshots into metric families. Exposed (all prefixed ``dataplane_``):

    up                                      1 if the controller answered this scrape
    put_bytes_total / get_bytes_total       {unit}  bytes stored / served by each unit
    put_requests_total / get_requests_total {unit}
    put_latency_seconds / get_latency_seconds {unit}  histograms, measured in the unit
    unit_up / unit_bytes / unit_samples / unit_capacity_bytes {unit, node_id}
    partition_samples / partition_bytes     {partition}
    claims_waiting                          blocked claim_meta calls right now
    errors_total                            {type, actor}  typed errors raised, by class
    controller_events_total                 {event}  the controller's own counters
    controller_<histogram>                  the controller's own histograms
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from dataplane_server.admin.server import advertised_host, join_host_port
from dataplane_server.admin.sources import ActorSources, counter

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0
_UNIT_COUNTERS = (
    ("put_bytes", "put_bytes_total", "Bytes written into the storage unit."),
    ("get_bytes", "get_bytes_total", "Bytes read out of the storage unit."),
    ("put_requests", "put_requests_total", "Put requests served by the storage unit."),
    ("get_requests", "get_requests_total", "Get requests served by the storage unit."),
)
_UNIT_HISTOGRAMS = (
    ("put_latency_seconds", "Time a storage unit spends storing one put."),
    ("get_latency_seconds", "Time a storage unit spends serving one get."),
)


def _metric_name(raw: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", raw)


def _histogram_buckets(snap: dict) -> list[tuple[str, float]]:
    """Stats.snapshot() histogram -> prometheus (le, cumulative count) pairs, +Inf last."""
    counts = snap["cumulative_counts"]
    les = [floatToGoString(b) for b in snap["buckets"]] + ["+Inf"]
    return list(zip(les, (float(c) for c in counts), strict=True))


class DataPlaneCollector(Collector):
    """Pulls controller and unit snapshots through Ray at scrape time."""

    def __init__(self, sources: ActorSources, timeout_s: float = SCRAPE_TIMEOUT_S):
        self.sources = sources
        self.timeout_s = timeout_s

    def describe(self) -> Iterable[Metric]:
        return []  # do not scrape the actors when the collector is registered

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("dataplane_up", "1 if the controller answered this scrape.")
        try:
            pull = self.sources.stats(timeout_s=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure means "down" for this scrape
            logger.warning("metrics scrape: controller unreachable: %s", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        ctrl = pull.controller

        claims = GaugeMetricFamily("dataplane_claims_waiting", "claim_meta calls blocked now.")
        claims.add_metric([], float(ctrl.claims_waiting))
        yield claims

        p_samples = GaugeMetricFamily(
            "dataplane_partition_samples", "Samples in the partition.", labels=["partition"]
        )
        p_bytes = GaugeMetricFamily(
            "dataplane_partition_bytes", "Bytes held for the partition.", labels=["partition"]
        )
        for p in pull.partitions():
            p_samples.add_metric([p.partition_id], float(p.num_samples))
            p_bytes.add_metric([p.partition_id], float(p.bytes))
        yield p_samples
        yield p_bytes

        unit_labels = ["unit", "node_id"]
        u_up = GaugeMetricFamily("dataplane_unit_up", "1 if the unit answered.", labels=unit_labels)
        u_bytes = GaugeMetricFamily("dataplane_unit_bytes", "Bytes held.", labels=unit_labels)
        u_samples = GaugeMetricFamily("dataplane_unit_samples", "Samples held.", labels=unit_labels)
        u_cap = GaugeMetricFamily(
            "dataplane_unit_capacity_bytes", "Capacity of the unit.", labels=unit_labels
        )
        counters = {
            key: CounterMetricFamily(f"dataplane_{name}", doc, labels=["unit"])
            for name, key, doc in _UNIT_COUNTERS
        }
        histograms = {
            name: HistogramMetricFamily(f"dataplane_{name}", doc, labels=["unit"])
            for name, doc in _UNIT_HISTOGRAMS
        }
        errors = CounterMetricFamily(
            "dataplane_errors",
            "Typed data-plane errors raised, by class.",
            labels=["type", "actor"],
        )
        for kind, n in (ctrl.stats.get("errors") or {}).items():
            errors.add_metric([kind, "controller"], float(n))

        for position, snap in enumerate(pull.units):
            if snap is None:
                u_up.add_metric([str(position), ""], 0)
                continue
            unit = str(snap.index)
            labels = [unit, snap.node_id]
            u_up.add_metric(labels, 1)
            u_bytes.add_metric(labels, float(snap.bytes))
            u_samples.add_metric(labels, float(snap.samples))
            u_cap.add_metric(labels, float(snap.capacity_bytes))
            stats = snap.stats
            for key, family in counters.items():
                family.add_metric([unit], counter(stats, key))
            for name, family in histograms.items():
                hist = (stats.get("histograms") or {}).get(name)
                if hist:
                    family.add_metric([unit], _histogram_buckets(hist), float(hist["sum"]))
            for kind, n in (stats.get("errors") or {}).items():
                errors.add_metric([kind, f"unit-{unit}"], float(n))
        yield from (u_up, u_bytes, u_samples, u_cap)
        yield from counters.values()
        yield from histograms.values()
        yield errors

        ctrl_stats = ctrl.stats
        events = CounterMetricFamily(
            "dataplane_controller_events", "The controller's own counters.", labels=["event"]
        )
        for name, value in (ctrl_stats.get("counters") or {}).items():
            events.add_metric([name.removesuffix("_total")], float(value))
        yield events
        for name, hist in (ctrl_stats.get("histograms") or {}).items():
            family = HistogramMetricFamily(
                f"dataplane_controller_{_metric_name(name)}", f"Controller histogram {name}."
            )
            family.add_metric([], _histogram_buckets(hist), float(hist["sum"]))
            yield family


class MetricsServer:
    """The collector on its own registry, served over HTTP at ``/metrics``."""

    def __init__(self, sources: ActorSources, host: str, port: int):
        self.host = host
        self.port = port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DataPlaneCollector(sources))
        self._httpd = None
        self._thread = None
        self.address: str | None = None

    def start(self) -> str:
        self._httpd, self._thread = start_http_server(
            self.port, addr=self.host, registry=self.registry
        )
        self.address = join_host_port(advertised_host(self.host), self._httpd.server_port)
        return self.address

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
        self._httpd = None
