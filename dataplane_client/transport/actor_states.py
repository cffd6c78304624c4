"""Actors' states in Ray's view (ALIVE, RESTARTING, DEAD), asked of the GCS at most once
per actor per ``max_age_s`` in a process.

Every call the client is waiting on checks, about once a second, whether its actor
is restarting (to bound the wait by ``controller_retry_budget_s``). Asked per call,
that is one synchronous GCS query per waiting call per second: a writer process
with hundreds of puts in flight spent a third of its event loop in those queries
(blocking the loop, and loading the GCS that every process shares), and the
service's goodput fell as writers were added. All waiting calls on one actor share
one answer instead; a state at most ``max_age_s`` old only delays noticing a
restart by that much.
"""

from __future__ import annotations

import threading
import time

from ray._private import state as ray_state

UNKNOWN = ("", "")


class ActorStates:
    def __init__(self, max_age_s: float):
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._known: dict[str, tuple[float, tuple[str, str]]] = {}  # id -> (asked at, answer)
        self.queries = 0  # GCS queries made (what sharing saves is observable)

    def get(self, actor_id: str) -> tuple[str, str]:
        """(class name, state) of ``actor_id``, at most ``max_age_s`` old; ('', '') when
        Ray does not know it or the GCS cannot be asked."""
        now = time.monotonic()
        with self._lock:
            known = self._known.get(actor_id)
            if known is not None and now - known[0] < self.max_age_s:
                return known[1]
        answer = self.ask(actor_id)
        with self._lock:
            self._known[actor_id] = (time.monotonic(), answer)
        return answer

    def ask(self, actor_id: str) -> tuple[str, str]:
        """A fresh answer from the GCS (not shared)."""
        self.queries += 1
        try:
            info = ray_state.actors(actor_id)
        except Exception:  # noqa: BLE001 - unknown is treated as not restarting
            return UNKNOWN
        return info.get("ActorClassName", ""), info.get("State", "")
