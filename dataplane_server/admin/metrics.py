"""Prometheus metrics: a collector that asks the actors for their numbers on each scrape.

The hot path never touches a metrics library: the controller and the units
count into plain ``Stats`` objects, and this collector turns one round of their
snapshots into metric families, one family per meaning so that a ``sum`` or a
``rate`` of any of them is a quantity someone can read. deploy/README.md lists
every family; the tables below give each its name and help text.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from dataplane_client.wire.messages import CheckpointSummary
from dataplane_client.wire.version import __version__
from dataplane_server.admin.server import advertised_host, join_host_port
from dataplane_server.admin.sources import ActorSources, StatsPull, counter

if TYPE_CHECKING:
    import threading
    from wsgiref.simple_server import WSGIServer

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0

# Stats counter -> (family name, help). CounterMetricFamily appends "_total".
CONTROLLER_COUNTERS = {
    "commits_total": ("dataplane_commits", "Commits (one per put_samples call) made visible."),
    "commit_batches_total": (
        "dataplane_commit_batches",
        "commit_many calls: the commits of one writer process's concurrent puts, sent together.",
    ),
    "committed_samples_total": (
        "dataplane_committed_samples",
        "Samples whose fields became visible through a commit.",
    ),
    "puts_admitted_total": (
        "dataplane_puts_admitted",
        "Puts that got a writer process's put credit (admission), summed over writers.",
    ),
    "put_admission_waits_total": (
        "dataplane_put_admission_waits",
        "Puts that waited in their writer process's admission queue before their credit.",
    ),
    "put_admission_wait_seconds_total": (
        "dataplane_put_admission_wait_seconds",
        "Seconds puts waited in admission queues, summed (over the waits: the mean wait).",
    ),
    "puts_rejected_total": (
        "dataplane_puts_rejected",
        "Puts refused with Overloaded: not admitted within put_admission_timeout_s, or "
        "their writer's queue was full (put_queue_limit). Nothing of them was staged.",
    ),
    "locates_total": (
        "dataplane_locates",
        "Gets located by the controller (a get with known routes goes to the units only).",
    ),
    "claims_total": ("dataplane_claims", "claim_meta calls that handed out samples."),
    "claimed_samples_total": ("dataplane_claimed_samples", "Samples handed out by claim_meta."),
    "claims_replayed_total": (
        "dataplane_claims_replayed",
        "Claims answered again by request id (a retry after a lost answer), not twice.",
    ),
    "policy_version_bumps_total": (
        "dataplane_policy_version_bumps",
        "set_policy_version calls that moved a versioned partition's policy version.",
    ),
    "stale_samples_dropped_total": (
        "dataplane_stale_samples_dropped",
        "Samples dropped because they fell out of a task's staleness window.",
    ),
    "expired_groups_dropped_total": (
        "dataplane_expired_groups_dropped",
        "GRPO groups dropped because members had not all arrived by group_deadline_s.",
    ),
    "expired_group_samples_dropped_total": (
        "dataplane_expired_group_samples_dropped",
        "Samples (the members present) of groups dropped at their group_deadline_s.",
    ),
    "samples_evicted_total": (
        "dataplane_samples_evicted",
        "Samples evicted (oldest unclaimed version first, or by id) to make room.",
    ),
    "rollouts_admitted_total": (
        "dataplane_rollouts_admitted",
        "Trajectories admit_rollouts granted (leave to start).",
    ),
    "rollouts_refused_total": (
        "dataplane_rollouts_refused",
        "Trajectories admit_rollouts did not grant (no room within the staleness bound).",
    ),
    "admission_waits_total": (
        "dataplane_admission_waits",
        "admit_rollouts calls that had to wait for room within the staleness bound.",
    ),
    "partial_tokens_resumed_total": (
        "dataplane_partial_tokens_resumed",
        "Tokens of partial rollouts kept across a weight update: stored under one policy "
        "version, then resumed by append_tokens under a newer one (not regenerated).",
    ),
    "journal_write_errors_total": (
        "dataplane_journal_write_errors",
        "Journal writes or compactions that failed (the verb changed nothing).",
    ),
    "claim_timeouts_total": (
        "dataplane_claim_timeouts",
        "Blocking claims that ran out of time with no batch ready (normal when polling).",
    ),
    "acked_samples_total": (
        "dataplane_acked_samples",
        "Leased samples acknowledged as done by their task.",
    ),
    "cleared_samples_total": (
        "dataplane_cleared_samples",
        "Samples dropped by clear_samples or by deleting their partition.",
    ),
    "partitions_deleted_total": ("dataplane_partitions_deleted", "Partitions deleted."),
    "units_lost_total": (
        "dataplane_units_lost",
        "Storage units found dead; the samples they held are lost.",
    ),
    "redeliveries_total": (
        "dataplane_redeliveries",
        "Leased samples handed out again after their lease ran out unacknowledged.",
    ),
    "partitions_retired_total": (
        "dataplane_partitions_retired",
        "Emptied partitions deleted by the retention policy.",
    ),
    "controller_restarts_total": (
        "dataplane_controller_restarts",
        "Times the controller restarted and rebuilt its key space from the units.",
    ),
    "liveness_check_errors_total": (
        "dataplane_liveness_check_errors",
        "Rounds of the controller's unit liveness / retention check that failed.",
    ),
    "checkpoints_total": ("dataplane_checkpoints", "Checkpoints of the whole store written."),
    "restores_total": ("dataplane_restores", "Checkpoints restored into this service."),
    "checkpoint_bytes_written_total": (
        "dataplane_checkpoint_bytes_written",
        "Bytes checkpoints copied (an incremental one copies only what its parent lacks).",
    ),
}
UNIT_COUNTERS = {
    "put_bytes_total": ("dataplane_put_bytes", "Bytes written into the storage unit."),
    "get_bytes_total": ("dataplane_get_bytes", "Bytes read out of the storage unit."),
    "put_requests_total": ("dataplane_put_requests", "Put requests served by the unit."),
    "get_requests_total": ("dataplane_get_requests", "Get requests served by the unit."),
    "put_waits_total": ("dataplane_put_waits", "Puts that had to wait for room in a full unit."),
    "direct_read_misses_total": (
        "dataplane_direct_read_misses",
        "Direct reads refused: a sample was not here at the generation asked for (the reader "
        "asks the controller instead).",
    ),
    "stages_reclaimed_total": (
        "dataplane_stages_reclaimed",
        "Staged writes never committed whose bytes were reclaimed.",
    ),
    "stage_sweep_errors_total": (
        "dataplane_stage_sweep_errors",
        "Failures of the unit's sweep of expired staged writes.",
    ),
    "write_leases_reclaimed_total": (
        "dataplane_write_leases_reclaimed",
        "Write regions set aside for a writer's next put and taken back unused "
        "(deadline, room needed, or the writer died).",
    ),
    "payload_registered_total": (
        "dataplane_payload_registered",
        "Memory regions (chunks, the probe buffer) registered with the unit's transfer "
        "engine for readers on other nodes to pull.",
    ),
    "payload_unregistered_total": (
        "dataplane_payload_unregistered",
        "Chunks unregistered from the unit's transfer engine (closed, and no remote read "
        "lease named them any more).",
    ),
    "payload_put_corrupt_total": (
        "dataplane_payload_put_corrupt",
        "Writes pushed by a writer on another node whose bytes did not match its CRC-32C "
        "(refused before the commit; the writer pushes once more).",
    ),
    "payload_register_failures_total": (
        "dataplane_payload_register_failures",
        "Registrations the unit's transfer engine refused.",
    ),
    "unit_restores_total": (
        "dataplane_unit_restores",
        "Starts of a durable unit that re-attached its files and row index (a restart, or "
        "the whole service served again from its state directory).",
    ),
    "unit_restore_seconds_total": (
        "dataplane_unit_restore_seconds",
        "Seconds durable units spent re-attaching their files and replaying their row index.",
    ),
}
# Stats histogram -> (family name, help); the controller's have no labels, the units' {unit}.
CONTROLLER_HISTOGRAMS = {
    "claim_wait_seconds": (
        "dataplane_claim_wait_seconds",
        "Time a blocking claim_meta waited before it returned or timed out.",
    ),
    "recovery_seconds": (
        "dataplane_recovery_seconds",
        "Time the controller took to rebuild its key space at start or restart.",
    ),
}
UNIT_HISTOGRAMS = {
    "put_latency_seconds": (
        "dataplane_put_latency_seconds",
        "Time a storage unit spends storing one put.",
    ),
    "get_latency_seconds": (
        "dataplane_get_latency_seconds",
        "Time a storage unit spends serving one get.",
    ),
}


def _undescribed(name: str) -> tuple[str, str]:
    # A counter added in an actor but not yet to the tables above still gets its own
    # family (never silently dropped); the help says where to describe it.
    family = "dataplane_" + re.sub(r"[^a-zA-Z0-9_]", "_", name).removesuffix("_total")
    return family, f"{name} (not yet described in dataplane_server/admin/metrics.py)."


def _histogram_buckets(snap: dict) -> list[tuple[str, float]]:
    """Stats.snapshot() histogram -> prometheus (le, cumulative count) pairs, +Inf last."""
    counts = snap["cumulative_counts"]
    les = [floatToGoString(b) for b in snap["buckets"]] + ["+Inf"]
    return list(zip(les, (float(c) for c in counts), strict=True))


class _Families:
    """Families by name, created on first use, so each name is emitted exactly once."""

    def __init__(self) -> None:
        self._by_name: dict[str, Metric] = {}

    def counter(self, table: dict, key: str, labels: list[str]) -> CounterMetricFamily:
        name, doc = table.get(key) or _undescribed(key)
        return self._get(name, lambda: CounterMetricFamily(name, doc, labels=labels))

    def histogram(self, table: dict, key: str, labels: list[str]) -> HistogramMetricFamily:
        name, doc = table.get(key) or _undescribed(key)
        return self._get(name, lambda: HistogramMetricFamily(name, doc, labels=labels))

    def _get(self, name, make):
        family = self._by_name.get(name)
        if family is None:
            family = self._by_name[name] = make()
        return family

    def __iter__(self):
        return iter(self._by_name.values())


class DataPlaneCollector(Collector):
    """Pulls controller and unit snapshots through Ray at scrape time."""

    def __init__(
        self,
        sources: ActorSources,
        timeout_s: float = SCRAPE_TIMEOUT_S,
        durability: tuple[str, str] = ("memory", ""),
    ):
        self.sources = sources
        self.timeout_s = timeout_s
        self.durability = durability  # (level, state directory) of the service's config

    def describe(self) -> Iterable[Metric]:
        return []  # do not scrape the actors when the collector is registered

    def collect(self) -> Iterable[Metric]:
        info = InfoMetricFamily("dataplane_build", "Version of the data-plane service.")
        info.add_metric([], {"version": __version__})
        yield info
        level = InfoMetricFamily(
            "dataplane_durability",
            "What a committed sample survives (memory, process, machine) and where it is kept.",
        )
        level.add_metric([], {"level": self.durability[0], "state_dir": self.durability[1]})
        yield level
        up = GaugeMetricFamily(
            "dataplane_up",
            "1 if the controller answered this scrape (the probe gRPC health uses); "
            "0 while it is down or restarting.",
        )
        pull = None
        if self.sources.controller_ready():
            try:
                pull = self.sources.stats(timeout_s=self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - any failure means "down" for this scrape
                logger.warning("metrics scrape: controller unreachable: %s", type(exc).__name__)
        if pull is None:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from _controller_families(pull)
        yield from _unit_families(pull)


def _last_checkpoint(last: CheckpointSummary | None) -> Iterable[Metric]:
    """The last checkpoint's cut: its position and time (-1, 0 and 0 before the first)."""
    for name, text, value in (
        (
            "dataplane_last_checkpoint_position",
            "The last commit sequence number in the last checkpoint's cut (-1: none yet).",
            -1 if last is None else last.position,
        ),
        (
            "dataplane_last_checkpoint_timestamp_seconds",
            "When the last checkpoint's cut was taken (Unix time; 0: none yet).",
            0.0 if last is None else last.taken_at,
        ),
        (
            "dataplane_last_checkpoint_bytes_written",
            "Bytes the last checkpoint wrote (its parent's are linked, not counted).",
            0 if last is None else last.bytes_written,
        ),
    ):
        gauge = GaugeMetricFamily(name, text)
        gauge.add_metric([], float(value))
        yield gauge


def _controller_families(pull: StatsPull) -> Iterable[Metric]:
    ctrl = pull.controller
    claims = GaugeMetricFamily("dataplane_claims_waiting", "claim_meta calls blocked now.")
    claims.add_metric([], float(ctrl.claims_waiting))
    yield claims
    waiting = GaugeMetricFamily(
        "dataplane_puts_waiting",
        "Puts waiting for a put credit in their writer process's admission queue now "
        "(writers heard from in the last 10 s).",
    )
    waiting.add_metric([], float(ctrl.puts_waiting))
    yield waiting
    in_flight = GaugeMetricFamily(
        "dataplane_puts_in_flight",
        "Puts holding a put credit now (staging or committing), over the writer processes.",
    )
    in_flight.add_metric([], float(ctrl.puts_in_flight))
    yield in_flight
    yield from _last_checkpoint(ctrl.last_checkpoint)

    # Rebuilt from the live partitions on every scrape: a deleted partition's series end.
    p_samples = GaugeMetricFamily(
        "dataplane_partition_samples", "Samples in the partition.", labels=["partition"]
    )
    p_bytes = GaugeMetricFamily(
        "dataplane_partition_stored_bytes",
        "Stored bytes of the partition's samples (their own bytes, as `dataplane partitions`).",
        labels=["partition"],
    )
    for p in pull.partitions():
        p_samples.add_metric([p.partition_id], float(p.num_samples))
        p_bytes.add_metric([p.partition_id], float(p.bytes))
    yield p_samples
    yield p_bytes
    yield from _async_rl_families(pull)

    families = _Families()
    # Every described family is emitted even at 0 (or empty), so dashboards and alerts
    # see the name from the first scrape, not only after the first event.
    for key in CONTROLLER_COUNTERS:
        families.counter(CONTROLLER_COUNTERS, key, []).add_metric([], counter(ctrl.stats, key))
    for key, value in (ctrl.stats.get("counters") or {}).items():
        if key not in CONTROLLER_COUNTERS:
            families.counter(CONTROLLER_COUNTERS, key, []).add_metric([], float(value))
    for key in CONTROLLER_HISTOGRAMS:
        families.histogram(CONTROLLER_HISTOGRAMS, key, [])
    for key, hist in (ctrl.stats.get("histograms") or {}).items():
        family = families.histogram(CONTROLLER_HISTOGRAMS, key, [])
        family.add_metric([], _histogram_buckets(hist), float(hist["sum"]))
    yield from families


# Versioned partitions (async RL): gauge name -> (help, the StalenessInfo figure).
ASYNC_RL_GAUGES = {
    "dataplane_partition_policy_version": ("The partition's current policy version.", "version"),
    "dataplane_partition_rollouts_in_flight": (
        "Trajectories granted by admit_rollouts and not yet released or expired.",
        "granted_in_flight",
    ),
    "dataplane_partition_untrained_samples": (
        "Live samples a bounded task has not consumed and still may (admission counts them).",
        "untrained",
    ),
    "dataplane_partition_stale_dropped_samples": (
        "Samples dropped as too stale, summed over the tasks whose window they left.",
        "dropped_total",
    ),
    "dataplane_partition_evicted_samples": ("Samples evicted to make room.", "evicted"),
    "dataplane_partition_partial_rollouts_in_flight": (
        "Partial rollouts being generated (append_tokens, not finished): not claimable yet.",
        "partial_in_progress",
    ),
    "dataplane_partition_filtered_samples": (
        "Samples refused by filtered claims (no longer owed), summed over the tasks.",
        "filtered_total",
    ),
    "dataplane_partition_admission_limit": (
        "Samples admission lets be started and not trained now: (max_staleness + 1) x "
        "admission_batch, or less when paced (only partitions that declare admission).",
        "admission_limit",
    ),
}


def _async_rl_families(pull: StatsPull) -> Iterable[Metric]:
    """One series per versioned partition (none for a partition without versions)."""
    families = {
        name: GaugeMetricFamily(name, help_text, labels=["partition"])
        for name, (help_text, _) in ASYNC_RL_GAUGES.items()
    }
    for p in pull.partitions():
        st = p.staleness
        if st is None:
            continue
        figures = {
            **vars(st),
            "dropped_total": sum(st.dropped_stale.values()),
            "filtered_total": sum(st.filtered.values()),
        }
        for name, (_, figure) in ASYNC_RL_GAUGES.items():
            if figures[figure] is not None:  # no admission declared: no admission limit
                families[name].add_metric([p.partition_id], float(figures[figure]))
    yield from families.values()


def _unit_families(pull: StatsPull) -> Iterable[Metric]:
    unit_labels = ["unit", "node_id"]
    u_up = GaugeMetricFamily("dataplane_unit_up", "1 if the unit answered.", labels=unit_labels)
    # Two figures, labelled: what the samples take (stored) and the memory set aside for
    # them in whole chunks (allocated), which is what capacity limits.
    u_stored = GaugeMetricFamily(
        "dataplane_unit_stored_bytes",
        "Stored bytes of the samples the unit holds (their own bytes).",
        labels=unit_labels,
    )
    u_bytes = GaugeMetricFamily(
        "dataplane_unit_allocated_bytes",
        "Memory the unit has allocated for samples (whole chunks; what capacity limits).",
        labels=unit_labels,
    )
    u_samples = GaugeMetricFamily("dataplane_unit_samples", "Samples held.", labels=unit_labels)
    u_cap = GaugeMetricFamily(
        "dataplane_unit_capacity_bytes", "Capacity of the unit.", labels=unit_labels
    )
    u_paths = CounterMetricFamily(
        "dataplane_payload_path_choices",
        "Reader processes on other nodes whose capability probe chose this path to the "
        "unit's bytes (mooncake-rdma, mooncake-tcp, or ray with the reason it fell back), "
        "since it started.",
        labels=["unit", "path", "reason"],
    )
    errors = CounterMetricFamily(
        "dataplane_errors",
        "Typed data-plane errors raised, by class (expected outcomes such as ClaimTimeout "
        "are counted under their own names).",
        labels=["type", "actor"],
    )
    for kind, n in (pull.controller.stats.get("errors") or {}).items():
        errors.add_metric([kind, "controller"], float(n))

    families = _Families()
    for key in UNIT_COUNTERS:
        families.counter(UNIT_COUNTERS, key, ["unit"])
    for key in UNIT_HISTOGRAMS:
        families.histogram(UNIT_HISTOGRAMS, key, ["unit"])
    for position, snap in enumerate(pull.units):
        if snap is None:
            u_up.add_metric([str(position), ""], 0)
            continue
        unit = str(snap.index)
        labels = [unit, snap.node_id]
        u_up.add_metric(labels, 1)
        u_stored.add_metric(labels, float(sum(snap.partition_bytes.values())))
        u_bytes.add_metric(labels, float(snap.bytes))
        u_samples.add_metric(labels, float(snap.samples))
        u_cap.add_metric(labels, float(snap.capacity_bytes))
        stats = snap.stats
        keys = dict.fromkeys([*UNIT_COUNTERS, *(stats.get("counters") or {})])
        for key in keys:
            families.counter(UNIT_COUNTERS, key, ["unit"]).add_metric([unit], counter(stats, key))
        for key, hist in (stats.get("histograms") or {}).items():
            family = families.histogram(UNIT_HISTOGRAMS, key, ["unit"])
            family.add_metric([unit], _histogram_buckets(hist), float(hist["sum"]))
        for kind, n in (stats.get("errors") or {}).items():
            errors.add_metric([kind, f"unit-{unit}"], float(n))
        for path, detail, readers in stats.get("payload_paths") or []:
            u_paths.add_metric([unit, path, detail], float(readers))
    yield from (u_up, u_stored, u_bytes, u_samples, u_cap, u_paths)
    yield from families
    yield errors


class MetricsServer:
    """The collector on its own registry, served over HTTP at ``/metrics``."""

    def __init__(
        self,
        sources: ActorSources,
        host: str,
        port: int,
        durability: tuple[str, str] = ("memory", ""),
    ):
        self.host = host
        self.port = port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DataPlaneCollector(sources, durability=durability))
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.address: str | None = None

    def start(self) -> str:
        httpd, self._thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        self._httpd = httpd
        self.address = join_host_port(advertised_host(self.host), httpd.server_port)
        return self.address

    def stop(self) -> None:
        httpd, thread = self._httpd, self._thread
        if httpd is None or thread is None:  # not started (start sets both)
            return
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
        self._httpd = None
