"""deploy/grafana-dashboard.json: valid, importable, and asking only for metrics we export."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from promtool import promtool_or_skip

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"
_METRIC = re.compile(r"\bdataplane_[a-zA-Z0-9_]+")
# Grafana replaces these before the query reaches Prometheus.
_GRAFANA_MACROS = {"$__rate_interval": "5m", "$__interval": "1m"}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _expressions() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p["targets"]]


def test_panels_are_well_formed():
    dash = _dashboard()
    assert dash["uid"]
    assert dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dash["panels"]:
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("x", "y", "w", "h")), panel["title"]
        assert grid["x"] + grid["w"] <= 24, f"{panel['title']} is wider than the 24-column grid"
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs, panel["title"]
        assert len(refs) == len(set(refs)), panel["title"]


def test_dashboard_covers_what_an_operator_needs():
    text = " ".join(_expressions())
    needed = {
        "throughput": "dataplane_put_bytes_total",
        "latency percentiles": "histogram_quantile(0.99, sum by (le) "
        "(rate(dataplane_put_latency_seconds_bucket",
        "store fill": "dataplane_unit_capacity_bytes",
        "claim wait": "dataplane_claim_wait_seconds_bucket",
        "errors": "dataplane_errors_total",
        "lost samples": "dataplane_units_lost_total",
        "controller restarts": "dataplane_controller_restarts_total",
        "recovery time": "dataplane_recovery_seconds_bucket",
        "checkpoints": "dataplane_checkpoints_total",
        "restores": "dataplane_restores_total",
        "journal errors": "dataplane_journal_write_errors_total",
        "policy version": "dataplane_partition_policy_version",
        "stale drops": "dataplane_partition_stale_dropped_samples",
        "filtered samples": "dataplane_partition_filtered_samples",
        "rollout admission waits": "dataplane_admission_waits_total",
        "rollouts in flight": "dataplane_partition_rollouts_in_flight",
        "untrained samples": "dataplane_partition_untrained_samples",
        "evictions": "dataplane_partition_evicted_samples",
        "admission room (paced)": "dataplane_partition_admission_limit",
        "straggler groups dropped": "dataplane_expired_groups_dropped_total",
        "partial rollouts in progress": "dataplane_partition_partial_rollouts_in_flight",
        "partial rollout tokens resumed": "dataplane_partial_tokens_resumed_total",
    }
    missing = [topic for topic, expr in needed.items() if expr not in text]
    assert not missing


def _scrape(service) -> str:
    """The service's metrics endpoint, as Prometheus reads it."""
    with urllib.request.urlopen(f"http://{service.metrics_address}/metrics", timeout=10) as r:
        return r.read().decode()


def _exported_names(service) -> set[str]:
    text = _scrape(service)
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        if family.type == "histogram":  # a histogram with no observation yet has no samples
            names.update(f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        if family.type == "counter":
            names.add(f"{family.name}_total")
        else:
            names.add(family.name)
    return names


def test_every_expression_uses_only_exported_metrics(service):
    exported = _exported_names(service)
    used = {name for expr in _expressions() for name in _METRIC.findall(expr)}
    assert used
    assert used <= exported, f"not exported: {sorted(used - exported)}"


def test_promtool_parses_every_expression(tmp_path):
    promtool = promtool_or_skip()
    # promtool has no "check expression"; a rule file with one recording rule per
    # panel query makes it parse each one as PromQL.
    rules = []
    for i, expr in enumerate(_expressions()):
        for macro, value in _GRAFANA_MACROS.items():
            expr = expr.replace(macro, value)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_missing_promtool_fails_under_ci_and_skips_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # a folder without promtool
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="apt-get install prometheus"):
        promtool_or_skip()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        promtool_or_skip()


def _series_of(text: str) -> list[dict]:
    """A /metrics scrape as promtool input series, each value held for 10 minutes."""
    series = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            series.append({"series": f"{s.name}{{{labels}}}", "values": f"{s.value}+0x10"})
    return series


def _panel(title: str) -> dict:
    [panel] = [p for p in _dashboard()["panels"] if p["title"] == title]
    return panel


def test_the_claim_wait_panel_shows_zero_on_a_fresh_service_not_no_data(service_factory, tmp_path):
    """A service nobody has claimed from: its histogram has no buckets yet and no claim
    has timed out. Each query of the panel, evaluated by promtool over that scrape, is one
    sample of 0 (Grafana's "no data" was an empty or NaN result)."""
    promtool = promtool_or_skip()
    fresh = service_factory("dash-fresh", num_storage_units=1)
    scrape = _scrape(fresh)
    tests = []
    for target in _panel("Claim wait")["targets"]:
        expr = target["expr"]
        for macro, value in _GRAFANA_MACROS.items():
            expr = expr.replace(macro, value)
        tests.append({"expr": expr, "eval_time": "10m", "exp_samples": [{"value": 0}]})
    _promtool_says(promtool, tmp_path / "fresh-service-test.yaml", scrape, tests)


def test_the_recovery_checkpoint_and_async_rl_panels_show_a_services_figures(
    service_factory, tmp_path
):
    """A service with one checkpoint saved and a versioned partition at version 2 whose
    four version-0 samples were dropped as stale: each query of the new panels, evaluated
    by promtool over its scrape, gives exactly those figures (not "no data")."""
    import torch

    from dataplane_client import StalenessSpec

    promtool = promtool_or_skip()
    svc = service_factory("dash-async", num_storage_units=1)
    client = svc.client()
    client.register_partition(
        "p", fields=["x"], consumer_tasks=["train"], staleness=StalenessSpec(max_staleness=1)
    )
    client.put_samples([f"s{i}" for i in range(4)], "p", {"x": torch.ones(4, 2)}, version=0)
    client.set_policy_version("p", 2)  # version 0 is now 2 behind: all four dropped
    client.checkpoint(str(tmp_path / "ckpt"))
    scrape = _scrape(svc)
    expected = {  # panel -> (target index, labels, value)
        "Controller restarts": [(0, "{}", 0)],
        "Checkpoints saved / restored": [(0, "{}", 1), (1, "{}", 0)],
        "Journal write errors": [(0, "{}", 0)],
        "Async RL: policy version": [(0, 'dataplane_partition_policy_version{partition="p"}', 2)],
        "Async RL: stale, filtered, evicted": [
            (0, 'dataplane_partition_stale_dropped_samples{partition="p"}', 4),
            (1, 'dataplane_partition_filtered_samples{partition="p"}', 0),
            (2, 'dataplane_partition_evicted_samples{partition="p"}', 0),
        ],
    }
    tests = []
    for title, rows in expected.items():
        targets = _panel(title)["targets"]
        for index, labels, value in rows:
            tests.append(
                {
                    "expr": targets[index]["expr"],
                    "eval_time": "10m",
                    "exp_samples": [{"labels": labels, "value": value}],
                }
            )
    _promtool_says(promtool, tmp_path / "new-panels-test.yaml", scrape, tests)


def _promtool_says(promtool: str, path, scrape: str, tests: list[dict]) -> None:
    """``promtool test rules`` of these query tests over one scrape (taken as a series
    flat for ten minutes) passes."""
    unit = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {"interval": "1m", "input_series": _series_of(scrape), "promql_expr_test": tests}
        ],
    }
    path.write_text(yaml.safe_dump(unit))
    proc = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_admission_room_panel_shows_the_paced_limit(service_factory, tmp_path):
    """A paced partition at version 1 with one rollout granted at version 0 still in
    flight: the panel's queries give 1 started and not trained and a limit of one batch
    (the straggler's window closes after this version), not the declared two."""
    from dataplane_client import StalenessSpec

    promtool = promtool_or_skip()
    svc = service_factory("dash-paced", num_storage_units=1)
    client = svc.client()
    spec = StalenessSpec(max_staleness=1, admission_batch=4, pace=True)
    client.register_partition("p", fields=["x"], consumer_tasks=["train"], staleness=spec)
    assert client.admit_rollouts("p", 1) is not None
    client.set_policy_version("p", 1)
    scrape = _scrape(svc)
    started, limit = (t["expr"] for t in _panel("Async RL: admission room")["targets"])
    tests = [
        {
            "expr": started,
            "eval_time": "10m",
            "exp_samples": [{"labels": '{partition="p"}', "value": 1}],
        },
        {
            "expr": limit,
            "eval_time": "10m",
            "exp_samples": [
                {"labels": 'dataplane_partition_admission_limit{partition="p"}', "value": 4}
            ],
        },
    ]
    _promtool_says(promtool, tmp_path / "paced-panel-test.yaml", scrape, tests)


def test_the_partial_rollouts_panel_counts_rollouts_in_progress(service_factory, tmp_path):
    """Two samples started by ``append_tokens`` and one finished: the panel's in-progress
    query gives 1 for the partition (the finished one is claimable, no longer partial)."""
    import torch

    from dataplane_client import StalenessSpec

    promtool = promtool_or_skip()
    svc = service_factory("dash-partial", num_storage_units=1)
    client = svc.client()
    spec = StalenessSpec(max_staleness=1)
    client.register_partition("p", fields=["tokens"], consumer_tasks=["train"], staleness=spec)
    two = [torch.arange(3), torch.arange(4)]
    client.append_tokens(["a", "b"], "p", {"tokens": two}, 0, start=True)
    client.set_policy_version("p", 1)
    client.append_tokens(["a"], "p", {"tokens": [torch.arange(2)]}, 1, finish=True)
    scrape = _scrape(svc)
    in_progress, _ = (t["expr"] for t in _panel("Async RL: partial rollouts")["targets"])
    tests = [
        {
            "expr": in_progress,
            "eval_time": "10m",
            "exp_samples": [
                {
                    "labels": 'dataplane_partition_partial_rollouts_in_flight{partition="p"}',
                    "value": 1,
                }
            ],
        }
    ]
    _promtool_says(promtool, tmp_path / "partial-panel-test.yaml", scrape, tests)
