"""``make rdma-check`` (benchmarks/rdma_check.py): the RDMA probe reads sysfs as
``ibv_devinfo`` would (a device counts only with an ACTIVE port); without one the check
is one JSON line and exit 0; with ``--device`` given, its measuring path runs (here over
TCP alone, at a tiny size: no NIC here) and checks the bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from scenario_run import mooncake_loads

from benchmarks.rdma_check import rdma_devices

REPO = Path(__file__).resolve().parents[2]


def _port(root: Path, device: str, port: int, state: str) -> None:
    d = root / device / "ports" / str(port)
    d.mkdir(parents=True)
    (d / "state").write_text(f"{state}\n")


def test_the_probe_counts_only_devices_with_an_active_port(tmp_path):
    assert rdma_devices(tmp_path / "absent")[1].endswith("(no InfiniBand/RoCE driver loaded)")
    tmp_path.joinpath("empty").mkdir()
    assert rdma_devices(tmp_path / "empty") == ([], f"no RDMA device: {tmp_path}/empty is empty")
    root = tmp_path / "ib"
    _port(root, "mlx5_1", 1, "1: DOWN")
    assert rdma_devices(root) == ([], "no RDMA device with an active port (found mlx5_1, all down)")
    _port(root, "mlx5_0", 1, "1: DOWN")
    _port(root, "mlx5_0", 2, "4: ACTIVE")
    assert rdma_devices(root) == (["mlx5_0"], "")


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.rdma_check", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_a_nic_the_check_is_one_line_and_exit_0():
    if rdma_devices()[0]:
        pytest.skip("this machine has an RDMA device: the check runs instead of skipping")
    done = _check()
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    assert json.loads(line) == {"check": "rdma", "skipped": rdma_devices()[1]}


@pytest.mark.skipif(not mooncake_loads(), reason="Mooncake's engine does not load")
def test_the_measuring_path_pulls_and_checks_the_bytes():
    done = _check("--device", "none", "--protocols", "tcp", "--sizes", "1MiB", "--repeats", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    (row,) = result["results"]
    assert (row["protocol"], row["bytes"], row["intact"]) == ("tcp", 1 << 20, True)
    assert row["GiB/s"] > 0
    assert [p["GB/s"] for p in result["published"]] == [87, 190]
    assert "| 1 MiB | " in done.stdout
