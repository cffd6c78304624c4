"""The service start benchmark runs a round, and a base checkout's code is what a linked
directory imports.

Speed is not asserted (a shared machine); what is: the round ran in a fresh process on
this checkout and the JSON holds its start and each controller restart.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_run import run_benchmark

from benchmarks.common import linked_checkout
from benchmarks.service_start import RESTARTS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_one_round_reports_a_start_and_each_restart(tmp_path):
    report, _ = run_benchmark(
        "benchmarks.service_start", "--rounds", "1", out=tmp_path / "start.json", timeout=300
    )
    [only] = report["rounds"]["this"]
    assert only["code"] == str(ROOT / "dataplane_client" / "__init__.py")
    assert only["start_s"] > 0
    assert len(only["restart_s"]) == RESTARTS
    assert all(s > 0 for s in only["restart_s"])


def test_a_linked_checkout_imports_the_other_checkouts_packages(tmp_path):
    other = tmp_path / "other"
    (other / "dataplane_client").mkdir(parents=True)
    (other / "dataplane_client" / "__init__.py").write_text("WHICH = 'other'\n")
    for pkg in ("dataplane_server", "policy_workers"):
        (other / pkg).mkdir()
    with linked_checkout(str(other)) as code:
        which = subprocess.run(
            [
                sys.executable,
                "-c",
                "import dataplane_client, benchmarks; print(dataplane_client.WHICH)",
            ],
            cwd=code,
            env=dict(os.environ, PYTHONPATH=str(code)),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert which.stdout.strip() == "other", which.stderr
    assert not code.exists()  # the links go with the block
