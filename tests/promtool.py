"""promtool, Prometheus's own checker, for the tests that judge our metrics with it.

A developer's machine without it skips those tests. CI must run them: under ``CI=true``
(set by ``.ci/run``, which installs Debian's ``prometheus`` package when it runs as root)
a missing promtool fails the test instead of passing CI with the check unrun.
"""

from __future__ import annotations

import os
import shutil

import pytest

MISSING_IN_CI = (
    "promtool is not installed, and CI=true: CI must run this check. Install Debian's "
    "prometheus package (apt-get install prometheus; .ci/run does it when run as root)."
)


def promtool_or_skip() -> str:
    """The promtool executable; skips the test where there is none, fails it under CI."""
    found = shutil.which("promtool")
    if found is not None:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail(MISSING_IN_CI)
    pytest.skip("promtool (Debian's prometheus package) is not installed")
