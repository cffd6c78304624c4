"""Failpoints: named places where a test can hold a service process, off unless armed.

A failpoint is armed while a file of its name exists in the directory named by
``RL_DATAPLANE_FAILPOINTS`` (read in the process that reaches it; Ray workers
inherit the environment of the process that started Ray). Unset, every call is
one dictionary lookup. Used for faults whose window is too narrow or too
timing-dependent to hit otherwise, e.g. a controller restart that outlasts the
clients' retry budget (tests/test_faults.py).
"""

from __future__ import annotations

import os
import time

ENV = "RL_DATAPLANE_FAILPOINTS"
CONTROLLER_RESTART = "controller-restart"  # a restarted controller holds in its constructor
# The controller dies (once) after a claim is journaled and applied, before it answers.
CLAIM_ANSWER_LOST = "claim-answer-lost"
JOURNAL_WRITE = "journal-write"  # the journal's disk is full while armed
_MAX_HOLD_S = 300.0  # a forgotten file must not wedge a service forever


def hold_while_armed(name: str, poll_s: float = 0.05) -> None:
    """Block while the failpoint ``name`` is armed (at most _MAX_HOLD_S)."""
    directory = os.environ.get(ENV)
    if not directory:
        return
    path = os.path.join(directory, name)
    deadline = time.monotonic() + _MAX_HOLD_S
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(poll_s)  # a constructor: nothing else runs in this actor yet


def _armed(name: str) -> str | None:
    directory = os.environ.get(ENV)
    if not directory:
        return None
    path = os.path.join(directory, name)
    return path if os.path.exists(path) else None


def die_once_if_armed(name: str) -> None:
    """Kill this process at once (as a crash would) if ``name`` is armed; disarmed first,
    so the restarted process goes on."""
    path = _armed(name)
    if path is None:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        return  # another process took it
    os._exit(1)


def fail_if_armed(name: str, error: BaseException) -> None:
    """Raise ``error`` while ``name`` is armed."""
    if _armed(name) is not None:
        raise error
