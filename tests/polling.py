"""Waiting for an observable state in a test, with a deadline (never a bare sleep)."""

import time


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.02) -> None:
    """Return once ``predicate()`` is true; fail the test after ``timeout_s`` naming
    ``what`` it waited for."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(interval_s)  # the polling interval, not synchronisation
