"""The deployment recipes in deploy/ stay loadable and in step with DataPlaneConfig."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from dataplane_client.config import DataPlaneConfig

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def test_runtime_env_ships_the_repo():
    env = yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text())
    assert env["working_dir"] == "."
    assert set(env) <= {"working_dir", "excludes", "env_vars", "pip"}


def test_kuberay_manifest_runs_serve_with_a_valid_config():
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kuberay-rayjob.yaml").read_text())}
    assert set(docs) == {"ConfigMap", "RayJob", "Service"}
    job = docs["RayJob"]
    assert job["apiVersion"] == "ray.io/v1"
    entry = job["spec"]["entrypoint"]
    assert re.match(
        r"python -m dataplane_server serve --config /etc/dataplane/dataplane\.yaml$", entry
    )
    cfg = DataPlaneConfig.from_dict(yaml.safe_load(docs["ConfigMap"]["data"]["dataplane.yaml"]))
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in head["env"]}
    assert int(env["RAY_JOB_STOP_WAIT_TIME_S"]["value"]) > cfg.drain_timeout_s
    assert "secretKeyRef" in env["DATAPLANE_ADMIN_TOKEN"]["valueFrom"]
    ports = {p["containerPort"] for p in head["ports"]}
    assert {cfg.admin_port, cfg.metrics_port} <= ports
    service_ports = {p["targetPort"] for p in docs["Service"]["spec"]["ports"]}
    assert service_ports == {cfg.admin_port, cfg.metrics_port}


def test_recipe_names_the_files_that_exist():
    text = (DEPLOY / "ray_job_submit.md").read_text()
    for ref in re.findall(r"deploy/[\w.\-]+", text):
        assert (DEPLOY.parent / ref).exists(), ref
