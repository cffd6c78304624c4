"""The benchmark harness fails loudly: a section that raises makes the run exit 1 and is
named FAILED in the printed summary and in the JSON, while the other sections still report;
and every run says which machine its figures came from (its own one-thread memcpy).

Two throwaway section modules, written to a temporary folder, stand in for real ones; the
harness itself (``python -m benchmarks.run``'s ``main``) runs for real in a subprocess,
with its own local Ray.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FINE = """
from benchmarks.common import Section, Table

def run(opts):
    section = Section("fine")
    section.tables.append(Table("numbers", ["x"], [[1.5]]))
    return section
"""

BROKEN = """
def run(opts):
    raise RuntimeError("forced failure for the harness test")
"""

# main() with the two fake sections as its whole registry; argv comes from the command line.
MAIN = (
    "import sys; from benchmarks import run; "
    "sys.exit(run.main(sys.argv[1:], sections={'broken': 'fake_broken', 'fine': 'fake_fine'}))"
)


def _harness(tmp_path: Path, only: str) -> tuple[subprocess.CompletedProcess, dict]:
    (tmp_path / "fake_fine.py").write_text(FINE)
    (tmp_path / "fake_broken.py").write_text(BROKEN)
    out = tmp_path / "results.json"
    env = dict(
        os.environ,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", MAIN, "--only", only, "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def _summary_rows(stdout: str) -> dict[str, list[str]]:
    summary = stdout.split("## summary", 1)[1]
    rows = [line.strip("|").split("|") for line in summary.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


@pytest.mark.timeout(280)
def test_a_failing_section_makes_the_run_exit_nonzero_and_says_so(tmp_path):
    proc, report = _harness(tmp_path, "broken,fine")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["failed"] == ["broken"]
    assert "RuntimeError: forced failure" in report["errors"]["broken"]
    assert "fine" in report["sections"]  # the broken section hid nothing after it
    rows = _summary_rows(proc.stdout)
    assert rows["broken"][0] == "FAILED"
    assert "forced failure" in rows["broken"][2]
    assert rows["fine"][0] == "ok"
    assert "1 section(s) FAILED: broken" in proc.stdout


@pytest.mark.timeout(280)
def test_the_run_names_its_machine_by_the_memcpy_it_measured(tmp_path):
    proc, report = _harness(tmp_path, "fine")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    machine = report["machine"]
    assert machine["memcpy_1thread_gibps_start"] > 0
    assert machine["memcpy_1thread_gibps_end"] > 0
    first_line = proc.stdout.splitlines()[0]
    assert first_line.startswith("machine: single-thread memcpy "), first_line
    assert "machine: single-thread memcpy " in proc.stdout.split("## summary", 1)[1]
    assert "all ran" in proc.stdout
