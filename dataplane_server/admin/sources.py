"""Where the admin endpoint and the metrics collector get their numbers: the actors.

The controller and the storage units keep their own counters (see
``dataplane_server.core.stats``); this module only calls them through Ray with a
deadline and turns "actor gone" into ``None`` where a partial answer is still
useful (one dead unit must not hide the others from a scrape).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from dataplane_client.wire.messages import ControllerSnapshot, StalenessInfo, UnitSnapshot

DEFAULT_TIMEOUT_S = 10.0
# The health probe: a controller verb that answers only once the key space is rebuilt
# (every served verb waits for recovery), cheap and free of side effects. A controller
# that is restarting or rebuilding does not answer within PROBE_TIMEOUT_S: down.
PROBE_METHOD = "metrics_snapshot"
PROBE_TIMEOUT_S = 2.0


def unwrap(exc: BaseException) -> BaseException:
    """The error raised inside the actor, when Ray wrapped it in a RayTaskError."""
    cause = getattr(exc, "cause", None) if isinstance(exc, RayTaskError) else None
    return cause if isinstance(cause, BaseException) else exc


@dataclass(frozen=True)
class PartitionFigures:
    partition_id: str
    num_samples: int
    bytes: int  # summed over the units that answered
    staleness: StalenessInfo | None = None  # a versioned partition's async-RL figures


@dataclass
class StatsPull:
    """One round of snapshots: the controller's, and each unit's (None = unreachable)."""

    timestamp: float
    controller: ControllerSnapshot
    units: list[UnitSnapshot | None]

    def partitions(self) -> list[PartitionFigures]:
        """Every live partition with its samples and the bytes the units hold for it."""
        return [
            PartitionFigures(
                partition_id=p.partition_id,
                num_samples=p.num_samples,
                bytes=sum(u.partition_bytes.get(p.partition_id, 0) for u in self.units if u),
                staleness=p.staleness,
            )
            for p in self.controller.partitions
        ]


class ActorSources:
    """Handles to one service's actors, reached by name like any other client."""

    def __init__(self, name: str, namespace: str, controller: Any = None):
        self.name = name
        self.namespace = namespace
        self.controller = (
            controller if controller is not None else ray.get_actor(name, namespace=namespace)
        )
        self._client = None
        self._client_lock = threading.Lock()

    def call(self, method: str, *args: Any, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> Any:
        """Call a controller method and wait at most ``timeout_s`` (None: as long as it takes);
        errors come back unwrapped."""
        ref = getattr(self.controller, method).remote(*args)
        try:
            return ray.get(ref, timeout=timeout_s)
        except RayTaskError as exc:
            raise unwrap(exc) from None

    def controller_ready(self, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
        """The probe behind gRPC health and ``dataplane_up``: True only when the controller
        answers PROBE_METHOD (its key space rebuilt) within ``timeout_s``; any error or a
        timeout (down, restarting, rebuilding) is False."""
        try:
            ray.get(getattr(self.controller, PROBE_METHOD).remote(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - every way of not answering means "not ready"
            return False
        return True

    def units(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
        """Storage-unit actor handles in index order (asked afresh: units may be replaced)."""
        return list(self.call("unit_handles", timeout_s=timeout_s))

    def call_unit(self, index: int, method: str, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S):
        units = self.units(timeout_s)
        if not 0 <= index < len(units):
            raise IndexError(f"no storage unit {index}; the service has {len(units)}")
        try:
            return ray.get(getattr(units[index], method).remote(*args), timeout=timeout_s)
        except RayTaskError as exc:
            raise unwrap(exc) from None

    def client(self):
        """A data-plane client (for mutations, which go through the client's own protocol)."""
        with self._client_lock:
            if self._client is None:
                from dataplane_client.client import connect

                # mutations only: no TensorDict is ever read through it
                self._client = connect(self.name, self.namespace, warm_reads=False)
            return self._client

    def stats(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> StatsPull:
        """Snapshots of the controller and every unit, fetched in parallel under one deadline.

        Raises when the controller does not answer; a unit that does not answer is None.
        """
        deadline = time.monotonic() + timeout_s
        units = self.units(timeout_s)
        unit_refs = [u.metrics_snapshot.remote() for u in units]
        controller = self.call("metrics_snapshot", timeout_s=max(0.0, deadline - time.monotonic()))
        unit_snaps: list[UnitSnapshot | None] = []
        for ref in unit_refs:
            try:
                unit_snaps.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except (RayActorError, RayTaskError, GetTimeoutError):
                unit_snaps.append(None)
        return StatsPull(timestamp=time.time(), controller=controller, units=unit_snaps)


def counter(stats: dict[str, Any] | None, name: str) -> float:
    """A counter from a ``Stats.snapshot()`` (0 when never incremented)."""
    if not stats:
        return 0.0
    return float(stats.get("counters", {}).get(name, 0.0))
