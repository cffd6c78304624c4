"""The README's examples run as printed (a newcomer copies them first)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Runs the example in a fresh interpreter: the full suite, not make test-fast.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_usage_example_runs():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Using it from your code") :]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[:2] == ["tensor([1.,", "0.])"], proc.stdout


def test_async_rl_example_prints_what_its_comment_says():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Async RL: versions") :]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    promised = re.search(r"# prints (.*)\n", example).group(1)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == promised, proc.stdout
