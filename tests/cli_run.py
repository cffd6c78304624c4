"""Runs the `dataplane` CLI (``python -m dataplane_server``) in a child process from the
repository root, with none of the caller's ``DATAPLANE_*`` settings: only those in ``env``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_dataplane(
    *args: str, env: dict | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DATAPLANE_")}
    clean.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "dataplane_server", *args],
        cwd=REPO,
        env=clean,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
