"""The deployment recipes in deploy/ stay loadable and in step with DataPlaneConfig."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from dataplane_client.wire.config import DataPlaneConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"


def test_runtime_env_ships_the_repo():
    env = yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text())
    assert env["working_dir"] == "."
    assert set(env) <= {"working_dir", "excludes", "env_vars", "pip"}


# KubeRay's own head ports: it adds each (by name) unless the container already has one
# of that name, and its PodMonitor for Ray scrapes "metrics". Ours must use neither.
KUBERAY_PORT_NAMES = {"client", "redis", "dashboard", "metrics", "serve"}
KUBERAY_PORT_NUMBERS = {10001, 6379, 8265, 8080, 52365, 8000}


def _manifest() -> dict:
    docs = yaml.safe_load_all((DEPLOY / "kuberay-rayjob.yaml").read_text())
    return {d["kind"]: d for d in docs}


def _head(docs) -> dict:
    return docs["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]


def test_kuberay_rayjob_matches_the_crd_schema():
    schema = json.loads((SCHEMAS / "rayjob-v1-subset.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(_manifest()["RayJob"], schema)
    broken = _manifest()["RayJob"]
    broken["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    with pytest.raises(jsonschema.ValidationError):  # rayStartParams values are strings
        jsonschema.validate(broken, schema)


def test_kuberay_manifest_runs_serve_with_a_valid_config():
    docs = _manifest()
    assert set(docs) == {"ConfigMap", "RayJob", "Service", "PodMonitor"}
    entry = docs["RayJob"]["spec"]["entrypoint"]
    assert re.match(
        r"python -m dataplane_server serve --config /etc/dataplane/dataplane\.yaml$", entry
    )
    cfg = DataPlaneConfig.from_dict(yaml.safe_load(docs["ConfigMap"]["data"]["dataplane.yaml"]))
    container = _head(docs)["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert "secretKeyRef" in env["DATAPLANE_ADMIN_TOKEN"]["valueFrom"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"dp-admin": cfg.admin_port, "dp-metrics": cfg.metrics_port}
    assert not set(ports) & KUBERAY_PORT_NAMES
    assert not set(ports.values()) & KUBERAY_PORT_NUMBERS
    service = {p["name"]: p for p in docs["Service"]["spec"]["ports"]}
    assert {name: p["targetPort"] for name, p in service.items()} == {
        "dp-admin": "dp-admin",
        "dp-metrics": "dp-metrics",
    }
    assert service["dp-metrics"]["port"] == cfg.metrics_port


def test_kuberay_grace_period_outlasts_the_drain():
    docs = _manifest()
    cfg = DataPlaneConfig.from_dict(yaml.safe_load(docs["ConfigMap"]["data"]["dataplane.yaml"]))
    head = _head(docs)["spec"]
    env = {e["name"]: e.get("value") for e in head["containers"][0]["env"]}
    stop_wait = int(env["RAY_JOB_STOP_WAIT_TIME_S"])
    # drain < Ray's wait before SIGKILL of the job < the kubelet's wait before SIGKILL.
    assert cfg.drain_timeout_s < stop_wait < head["terminationGracePeriodSeconds"]


def test_pod_monitor_scrapes_our_port_on_the_head_pod():
    docs = _manifest()
    monitor = docs["PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    head = _head(docs)
    labels = {**head["metadata"]["labels"], "ray.io/node-type": "head"}  # set by KubeRay
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    assert docs["Service"]["spec"]["selector"].items() <= labels.items()
    port_names = {p["name"] for p in head["spec"]["containers"][0]["ports"]}
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert [(e["port"], e["path"]) for e in endpoints] == [("dp-metrics", "/metrics")]
    assert endpoints[0]["port"] in port_names


def test_recipe_names_the_files_that_exist():
    text = (DEPLOY / "ray_job_submit.md").read_text()
    for ref in re.findall(r"deploy/[\w.\-]+", text):
        assert (DEPLOY.parent / ref).exists(), ref
