"""gRPC health that follows the controller: SERVING only while it answers and no drain.

A thread asks the controller's ``ready`` every ``interval_s`` (the probe in
``ActorSources.controller_ready``, ``timeout_s`` each; the very first probe
waits longer, so a busy machine does not start the endpoint as NOT_SERVING)
and sets the standard health status of the
overall server ("") and of AdminService: NOT_SERVING while the controller is
down, restarting or rebuilding its key space, SERVING again once it answers. A
drain wins over the probe: once draining, the status stays NOT_SERVING.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from grpc_health.v1 import health, health_pb2

logger = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DEFAULT_INTERVAL_S = 1.0
DEFAULT_TIMEOUT_S = 2.0
FIRST_TIMEOUT_S = 10.0


class HealthWatch:
    """Keeps ``servicer``'s status for ``services`` in step with ``probe(timeout_s)`` and
    the drain."""

    def __init__(
        self,
        servicer: health.HealthServicer,
        probe: Callable[[float], bool],
        services: Iterable[str],
        interval_s: float = DEFAULT_INTERVAL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        self._servicer = servicer
        self._probe = probe
        self._services = tuple(services)
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._draining = False
        self._status: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def status(self) -> int | None:
        return self._status

    def start(self) -> None:
        """Probe once (so the first health answer is already true), then keep probing."""
        self.check(FIRST_TIMEOUT_S)
        self._thread = threading.Thread(target=self._run, name="dataplane-health", daemon=True)
        self._thread.start()

    def check(self, timeout_s: float | None = None) -> bool:
        """Probe the controller now and publish the result; True when it answered."""
        ready = self._probe(self._timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            self._publish(SERVING if ready and not self._draining else NOT_SERVING)
        return ready

    def drain(self) -> None:
        with self._lock:
            self._draining = True
            self._publish(NOT_SERVING)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _publish(self, status: int) -> None:
        if status == self._status:
            return
        if self._status is not None:
            logger.warning(
                "admin health: %s", health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            )
        self._status = status
        for name in self._services:
            self._servicer.set(name, status)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.check()
