"""The grpcio / protobuf minimums pyproject declares are real: the admin API runs on them.

The floors come from the pinned proto generator (see dataplane_server/admin/gen_proto.py):
its output has no runtime version gate, so users may keep an older grpcio/protobuf
(NeMo-RL and vLLM images often do). This installs exactly the declared minimums beside
the venv (PYTHONPATH in front of site-packages) and runs the admin gRPC tests on them:
a real Ray, the real admin server with health and reflection, a real client.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FLOORED = ("grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf")
# Not ours, but imported by Ray[default] in every process; these are the releases pip
# picks beside protobuf 4.21 (the venv's newer ones need protobuf >= 5).
COMPANIONS = ("googleapis-common-protos==1.56.4", "opentelemetry-proto==1.24.0")


def declared_floors() -> dict[str, str]:
    text = (ROOT / "pyproject.toml").read_text()
    floors = dict(re.findall(r'^\s*"([a-z-]+)>=([0-9.]+)",', text, flags=re.M))
    return {name: floors[name] for name in FLOORED}


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_admin_api_runs_on_the_declared_minimums(tmp_path):
    floors = declared_floors()
    assert floors["grpcio"] == floors["grpcio-health-checking"] == floors["grpcio-reflection"]
    pins = [f"{name}=={version}" for name, version in floors.items()]
    env = dict(os.environ)
    got = _run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path)]
        + pins
        + list(COMPANIONS),
        env,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-2000:]

    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    probe = "import grpc, google.protobuf as p; print(grpc.__version__, p.__version__)"
    versions = _run([sys.executable, "-c", probe], env, timeout=60)
    assert versions.stdout.split() == [floors["grpcio"], floors["protobuf"]], versions.stderr

    admin = _run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/server/test_admin_grpc.py",
        ],
        env,
        timeout=900,
    )
    assert admin.returncode == 0, admin.stdout[-4000:] + admin.stderr[-2000:]
