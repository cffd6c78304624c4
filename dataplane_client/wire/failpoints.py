"""Failpoints: named places where a test injects a fault or a delay, off unless armed.

The one way tests reach into a running service or client, in two forms:

- Armed by a file, across processes: a failpoint is armed while a file of its name
  exists in the directory named by ``RL_DATAPLANE_FAILPOINTS`` (read in the process
  that reaches it; Ray workers inherit the environment of the process that started
  Ray). The file's content is the failpoint's argument where it takes one (a delay
  in seconds). Each firing is counted in ``<name>.fired`` beside it, so a test can
  see that its fault happened (:func:`fired`). Unset, reaching one costs one
  environment lookup; set, one failed ``open``.
- Armed with a callable, in this process only (:func:`run_at`), for faults that must
  act, not just wait: e.g. reclaim a chunk just before a reader opens it. Unset,
  reaching one costs one dictionary lookup.

Used for faults whose window is too narrow or too timing-dependent to hit
otherwise (tests/server/test_faults.py, test_claim_identity.py, test_chunk_identity.py,
test_service.py). This module lives on the client side so both sides can reach
failpoints: the client must not import the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ENV = "RL_DATAPLANE_FAILPOINTS"

# Armed by a file (any process):
CONTROLLER_RESTART = "controller-restart"  # a restarted controller holds in its constructor
# The controller dies (once) after a claim is journaled and applied, before it answers.
CLAIM_ANSWER_LOST = "claim-answer-lost"
JOURNAL_WRITE = "journal-write"  # the journal's disk is full while armed
# The controller dies (once) after a clear is journaled and applied to the key space,
# before the units free the samples' bytes.
CLEAR_BEFORE_FREE = "clear-before-free"
# The controller pauses (the file holds the seconds) between publishing a commit's
# metadata to the units and applying it to the key space: clears race into that window.
COMMIT_AFTER_PUBLISH = "commit-after-publish"
# The same, between checking a commit and publishing it: a clear in that window frees the
# samples on their units before the commit's bytes are published there.
COMMIT_BEFORE_PUBLISH = "commit-before-publish"
# The same, as a batch of commits reaches the controller, before anything of it is
# checked: commits that queued that long behind other writers' (put deadlines).
COMMIT_QUEUED = "commit-queued"

# A storage unit pauses (the file holds the seconds) after a checkpoint's cut is pinned,
# before it copies the bytes: commits, claims and clears go on in that window.
CHECKPOINT_COPY = "checkpoint-copy"

# A storage unit's constructor sleeps (the file holds the seconds): a unit process
# still starting on a loaded node, slow to answer the controller's first ping.
UNIT_START = "unit-start"

# A storage unit's ping answers only after the seconds its file holds: a unit slow to
# answer on a loaded node, which is alive, not lost.
UNIT_PING = "unit-ping"

# A storage unit forgets the process tokens of its same-node readers (once, before its
# next same-node read), as a unit's restart or many other readers would.
READER_TOKENS_LOST = "reader-tokens-lost"

# A reader on another node flips one byte of the next field it pulled through the transfer
# engine, before checking it (the file's content is how many pulls to spoil before it
# disarms, default 1): what a truncated or corrupted transfer looks like. One spoiled pull
# is pulled again; two in a row raise CorruptPayload.
PAYLOAD_CORRUPT = "payload-corrupt"
# The transfer engine refuses the next registration of memory (the file's content: how
# many, default 1), in whichever process registers next (a unit's chunk, a reader's
# destination buffer).
PAYLOAD_REGISTER = "payload-register"
# A writer's push through the transfer engine reports failure after its bytes were
# written into the unit's staged region (as an engine timeout after the remote write does).
PAYLOAD_WRITE_FAILED = "payload-write-failed"

# Armed with a callable (this process): called with a chunk's path just before a
# same-node reader or writer opens it, the window in which its unit may free it.
CHUNK_OPEN = "chunk-open"
# Called with the bytes pulled so far after each slice of a pull through the transfer
# engine lands: a test kills the peer there, mid-transfer.
PAYLOAD_PULLED = "payload-pulled"

_MAX_HOLD_S = 300.0  # a forgotten file must not wedge a service forever
_FIRED_SUFFIX = ".fired"

_actions: dict[str, Callable[..., None]] = {}


# ---- armed by a file -------------------------------------------------------------
def _directory() -> Path:
    directory = os.environ.get(ENV)
    if not directory:
        raise RuntimeError(f"{ENV} is not set: failpoints cannot be armed")
    return Path(directory)


def arm(name: str, argument: str = "") -> Path:
    """Arm ``name`` in every process that reads this directory; its firings count from 0."""
    directory = _directory()
    (directory / f"{name}{_FIRED_SUFFIX}").unlink(missing_ok=True)
    path = directory / name
    path.write_text(argument)
    return path


def disarm(name: str) -> None:
    (_directory() / name).unlink(missing_ok=True)


def fired(name: str) -> int:
    """How often ``name`` fired, in any process, since it was last armed."""
    try:
        return (_directory() / f"{name}{_FIRED_SUFFIX}").stat().st_size
    except FileNotFoundError:
        return 0


def _record_firing(path: str) -> None:
    # One byte per firing; appends of one byte never interleave, so the size is the count.
    with open(path + _FIRED_SUFFIX, "ab") as f:
        f.write(b".")


def _armed(name: str) -> str | None:
    directory = os.environ.get(ENV)
    if not directory:
        return None
    path = os.path.join(directory, name)
    return path if os.path.exists(path) else None


def hold_while_armed(name: str, poll_s: float = 0.05) -> None:
    """Block while the failpoint ``name`` is armed (at most _MAX_HOLD_S)."""
    path = _armed(name)
    if path is None:
        return
    _record_firing(path)
    deadline = time.monotonic() + _MAX_HOLD_S
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(poll_s)  # a constructor: nothing else runs in this actor yet


def once_if_armed(name: str) -> bool:
    """True, once, if ``name`` is armed: it is disarmed as it fires (one process takes it)."""
    path = _armed(name)
    if path is None:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False  # another process took it
    _record_firing(path)
    return True


def countdown_if_armed(name: str) -> bool:
    """True while ``name`` is armed, for as many firings as its file says (default 1): each
    firing counts one down, and the last disarms it. For one process at a time."""
    path = _armed(name)
    if path is None:
        return False
    try:
        with open(path) as f:
            left = int(f.read().strip() or 1)
    except (FileNotFoundError, ValueError):
        return False
    _record_firing(path)
    if left <= 1:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    else:
        with open(path, "w") as f:
            f.write(str(left - 1))
    return True


def die_once_if_armed(name: str) -> None:
    """Kill this process at once (as a crash would) if ``name`` is armed; disarmed first,
    so the restarted process goes on."""
    if once_if_armed(name):
        os._exit(1)


def fail_if_armed(name: str, error: BaseException) -> None:
    """Raise ``error`` while ``name`` is armed."""
    path = _armed(name)
    if path is not None:
        _record_firing(path)
        raise error


def _delay(name: str) -> float | None:
    """The seconds ``name``'s file says (a firing is counted), or None when unarmed."""
    directory = os.environ.get(ENV)
    if not directory:
        return None
    path = os.path.join(directory, name)
    try:
        with open(path) as f:
            seconds = float(f.read() or 0)
    except FileNotFoundError:
        return None
    _record_firing(path)
    return min(seconds, _MAX_HOLD_S)


async def pause_if_armed(name: str) -> None:
    """While ``name`` is armed, sleep as many seconds as its file says; other coroutines
    of this event loop run meanwhile (that is the window a test widens)."""
    seconds = _delay(name)
    if seconds is not None:
        await asyncio.sleep(seconds)


def sleep_if_armed(name: str) -> None:
    """``pause_if_armed`` for code that may block its thread (a constructor)."""
    seconds = _delay(name)
    if seconds is not None:
        time.sleep(seconds)


# ---- armed with a callable ---------------------------------------------------------
@contextlib.contextmanager
def run_at(name: str, action: Callable[..., None]) -> Iterator[None]:
    """Call ``action`` whenever this process reaches ``name``, until the block ends."""
    if name in _actions:
        raise RuntimeError(f"failpoint {name!r} already has an action")
    _actions[name] = action
    try:
        yield
    finally:
        del _actions[name]


def reached(name: str, *args: object) -> None:
    """Run the action set for ``name`` in this process, if any, with ``args``."""
    action = _actions.get(name)
    if action is not None:
        action(*args)
