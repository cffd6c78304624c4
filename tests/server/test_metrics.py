"""The Prometheus endpoint, scraped over HTTP: names, labels and values follow the traffic.

Counters are compared before/after this file's own puts and gets (other test
files share the service, so absolute values are not ours to assert).
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from promtool import promtool_or_skip

from dataplane_client.wire.errors import ClaimTimeout, SamplesNotFound
from dataplane_client.wire.version import __version__
from dataplane_server.admin.metrics import CONTROLLER_COUNTERS


def scrape(service) -> dict[str, list]:
    """{metric family name: [Sample(name, labels, value, ...)]} of one scrape."""
    with urllib.request.urlopen(f"http://{service.metrics_address}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _values(families, sample_name: str, labels: dict) -> list[float]:
    return [
        s.value
        for family in families.values()
        for s in family
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def total(families, sample_name: str, **labels) -> float:
    """Sum of every sample with that name and those labels (0 when there is none)."""
    return sum(_values(families, sample_name, labels))


def one(families, sample_name: str, **labels) -> float:
    matches = _values(families, sample_name, labels)
    assert len(matches) == 1, f"{sample_name}{labels}: {matches}"
    return matches[0]


@pytest.fixture(scope="module")
def traffic(client, service):
    """Puts and gets on a fresh partition, with scrapes taken before and after."""
    pid = f"metrics-{uuid.uuid4().hex[:8]}"
    before = scrape(service)
    client.register_partition(pid, fields=["input_ids", "reward"])
    ids = [f"m{i}" for i in range(8)]
    client.put_samples(
        ids,
        pid,
        {
            "input_ids": [torch.arange(100 + i, dtype=torch.int64) for i in range(8)],
            "reward": torch.ones(8, dtype=torch.float32),
        },
    )
    got = client.get_samples(ids, pid, ["reward"])
    assert torch.equal(got["reward"], torch.ones(8))
    with pytest.raises(SamplesNotFound):
        client.get_samples(["never-written"], pid, ["reward"])
    after = scrape(service)
    payload = sum(100 + i for i in range(8)) * 8 + 8 * 4
    return {
        "pid": pid,
        "before": before,
        "after": after,
        "payload": payload,
        "metrics_address": service.metrics_address,
    }


def test_service_is_up_with_every_unit(traffic):
    after = traffic["after"]
    assert one(after, "dataplane_up") == 1
    units = {s.labels["unit"]: s.value for s in after["dataplane_unit_up"]}
    assert units == {"0": 1.0, "1": 1.0}
    assert all(s.labels["node_id"] for s in after["dataplane_unit_up"])
    for s in after["dataplane_unit_capacity_bytes"]:
        assert s.value == 4 * (1 << 30)


def test_put_and_get_bytes_counters_grow_with_traffic(traffic):
    before, after = traffic["before"], traffic["after"]
    put = total(after, "dataplane_put_bytes_total") - total(before, "dataplane_put_bytes_total")
    assert put >= traffic["payload"]
    get = total(after, "dataplane_get_bytes_total") - total(before, "dataplane_get_bytes_total")
    assert get >= 8 * 4
    puts = total(after, "dataplane_put_requests_total") - total(
        before, "dataplane_put_requests_total"
    )
    assert puts >= 1
    gets = total(after, "dataplane_get_requests_total") - total(
        before, "dataplane_get_requests_total"
    )
    assert gets >= 1
    assert {s.labels["unit"] for s in after["dataplane_put_bytes"]} == {"0", "1"}


@pytest.mark.parametrize("op", ["put", "get"])
def test_latency_histograms(traffic, op):
    name = f"dataplane_{op}_latency_seconds"
    before, after = traffic["before"], traffic["after"]
    grew = total(after, f"{name}_count") - total(before, f"{name}_count")
    assert grew >= 1
    for unit in {s.labels["unit"] for s in after[name]}:
        buckets = [
            s for s in after[name] if s.name == f"{name}_bucket" and s.labels["unit"] == unit
        ]
        counts = [s.value for s in buckets]
        assert counts == sorted(counts), "buckets are cumulative"
        assert buckets[-1].labels["le"] == "+Inf"
        assert counts[-1] == one(after, f"{name}_count", unit=unit)
        assert one(after, f"{name}_sum", unit=unit) >= 0


def test_samples_and_bytes_per_partition_and_unit(traffic):
    after, pid = traffic["after"], traffic["pid"]
    assert one(after, "dataplane_partition_samples", partition=pid) == 8
    assert one(after, "dataplane_partition_stored_bytes", partition=pid) >= traffic["payload"]
    assert total(after, "dataplane_unit_samples") >= 8
    assert total(after, "dataplane_unit_stored_bytes") >= traffic["payload"]
    assert total(after, "dataplane_unit_allocated_bytes") >= total(
        after, "dataplane_unit_stored_bytes"
    )


def test_errors_are_counted_by_type(traffic):
    before, after = traffic["before"], traffic["after"]
    label = {"type": "SamplesNotFound", "actor": "controller"}
    grew = total(after, "dataplane_errors_total", **label) - total(
        before, "dataplane_errors_total", **label
    )
    assert grew >= 1


def test_one_counter_family_per_meaning(traffic):
    before, after = traffic["before"], traffic["after"]
    assert "dataplane_controller_events" not in after  # the mixed family is gone

    def grew(name):
        return one(after, name) - one(before, name)

    assert grew("dataplane_commits_total") >= 1
    assert grew("dataplane_committed_samples_total") >= 8
    for name in CONTROLLER_COUNTERS.values():  # emitted from the first scrape, at 0 or more
        assert one(after, f"{name[0]}_total") >= 0


def test_every_counter_the_actors_keep_is_described(traffic):
    # An actor's new counter without an entry in metrics.py is still exported, but with
    # a placeholder help; the traffic of this file must not produce any.
    with urllib.request.urlopen(f"http://{traffic['metrics_address']}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert "not yet described" not in text


def test_build_info_carries_the_package_version(traffic):
    info = traffic["after"]["dataplane_build_info"]
    assert [(s.name, s.labels, s.value) for s in info] == [
        ("dataplane_build_info", {"version": __version__}, 1.0)
    ]
    assert __version__ == importlib.metadata.version("rl-dataplane")


def test_claim_timeouts_are_counted_apart_from_errors(service, client):
    pid = f"metrics-timeout-{uuid.uuid4().hex[:8]}"
    client.register_partition(pid, fields=["x"], consumer_tasks=["train"])
    before = scrape(service)
    for _ in range(3):  # a trainer polling an empty partition
        with pytest.raises(ClaimTimeout):
            client.claim_meta(pid, "train", ["x"], 2, blocking=True, timeout_s=0.05)
    after = scrape(service)
    timeouts = one(after, "dataplane_claim_timeouts_total") - one(
        before, "dataplane_claim_timeouts_total"
    )
    assert timeouts == 3
    label = {"type": "ClaimTimeout"}
    assert total(after, "dataplane_errors_total", **label) == 0
    client.delete_partition(pid)


def test_deleted_partitions_leave_no_series(service, client):
    def series(families):
        return sum(len(samples) for samples in families.values())

    start = scrape(service)
    for i in range(300):
        pid = f"metrics-churn-{i}"
        client.register_partition(pid, fields=["x"])
        client.put_samples(["a"], pid, {"x": torch.zeros(1, 4)})
        client.delete_partition(pid)
    end = scrape(service)
    assert not [
        s
        for s in end["dataplane_partition_samples"]
        if s.labels["partition"].startswith("metrics-churn-")
    ]
    assert series(end) == series(start)


def test_promtool_accepts_the_exposition(traffic):
    promtool = promtool_or_skip()
    with urllib.request.urlopen(f"http://{traffic['metrics_address']}/metrics", timeout=10) as resp:
        text = resp.read()
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()


def test_claims_waiting_counts_a_blocked_claim(service, client):
    pid = f"metrics-claim-{uuid.uuid4().hex[:8]}"
    client.register_partition(pid, fields=["x"], consumer_tasks=["train"])
    claimer = service.client()
    result = {}

    def claim():
        result["meta"] = claimer.claim_meta(pid, "train", ["x"], 2, blocking=True, timeout_s=30)

    thread = threading.Thread(target=claim, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while one(scrape(service), "dataplane_claims_waiting") < 1:
            assert time.monotonic() < deadline, "the blocked claim never showed up"
            time.sleep(0.05)  # scrape interval while polling, not synchronisation
    finally:
        client.put_samples(["a", "b"], pid, {"x": torch.zeros(2, 3)})
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert result["meta"] is not None
    assert sorted(result["meta"].sample_ids) == ["a", "b"]


def test_readme_table_lists_exactly_the_exported_families(traffic):
    readme = (Path(__file__).resolve().parents[2] / "deploy" / "README.md").read_text()
    section = readme[readme.index("## Metrics") :]
    documented = set(re.findall(r"^\| `(dataplane_\w+)` \|", section, re.MULTILINE))
    with urllib.request.urlopen(f"http://{traffic['metrics_address']}/metrics", timeout=10) as resp:
        families = list(text_string_to_metric_families(resp.read().decode()))
    exported = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    assert documented == exported


def test_every_counter_and_histogram_in_the_code_is_described():
    """Statically: every stats name the actors' code counts or observes has a family and
    help text, so none waits for the traffic that first increments it to show undescribed
    (write_leases_reclaimed_total, claims_replayed_total and journal_write_errors_total
    once did)."""
    from dataplane_server.admin.metrics import (
        CONTROLLER_HISTOGRAMS,
        UNIT_COUNTERS,
        UNIT_HISTOGRAMS,
    )

    source = "\n".join(
        p.read_text()
        for p in (Path(__file__).resolve().parents[2] / "dataplane_server").rglob("*.py")
    )
    used = set(re.findall(r"stats\.(?:inc|observe)\(\s*\"([a-z_]+)\"", source))
    used |= set(re.findall(r"self\.stats\.inc,\s*\"([a-z_]+)\"", source))
    assert len(used) >= 20, used  # the scan finds the code's names
    described = {*CONTROLLER_COUNTERS, *UNIT_COUNTERS, *CONTROLLER_HISTOGRAMS, *UNIT_HISTOGRAMS}
    assert sorted(used - described) == []
