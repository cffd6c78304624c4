"""The seam: what a cross-node payload backend does, and what the probe chose.

A backend answers two questions for a get's rows on one unit of another node: which
call to send the unit (``read_call``: the unit answers with the bytes themselves or with
where to pull them), and how its answer becomes the fields' bytes in this process
(``complete``: nothing to do for Ray's object transfer; pull, check and release for a
transfer engine). ``complete`` may block (it moves the bytes): the transport runs it on a
worker thread, so a get of several units pulls them in parallel and an ``*_async`` verb
never blocks its event loop.

To add a backend (NIXL, UCX, Ray's RDT...): subclass :class:`PayloadBackend`, give the
unit the call its ``read_call`` sends and an offer its probe can judge
(``dataplane_server/unit/payload.py``), and teach ``probe.choose`` when to pick it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from dataplane_client.wire.encoded import EncodedField

SHM = "shm"  # same node: shared memory, not a payload backend (transport/bulk.py)
RAY = "ray"
MOONCAKE_TCP = "mooncake-tcp"
MOONCAKE_RDMA = "mooncake-rdma"
MOONCAKE = (MOONCAKE_TCP, MOONCAKE_RDMA)  # Mooncake's engine, by what it moves bytes over


class PayloadBackend(ABC):
    name: str

    @abstractmethod
    def read_call(
        self,
        unit: Any,
        partition_id: str,
        sample_ids: list[str],
        fields: list[str],
        expect: list[int] | None,
        token: list | bytes | None,
    ) -> Any:
        """The unit's read call (an ObjectRef) for these rows; ``token``: this process's
        reader token for the unit (the unit ends a dead reader's leases)."""

    @abstractmethod
    def complete(self, unit: Any, answer: Any) -> dict[str, EncodedField]:
        """The unit's answer made into each field's bytes in this process (may block)."""

    def needs_completion(self, answer: Any) -> bool:
        """Whether ``complete`` has work to do for this answer (else it is used as is)."""
        return False


class RayObjects(PayloadBackend):
    """Ray's object transfer (the fallback, and the path before there was a seam): the
    unit's ``read`` returns the bytes, which Ray copies into its node's object store and
    moves to ours."""

    name = RAY

    def read_call(self, unit, partition_id, sample_ids, fields, expect, token):
        return unit.read.remote(partition_id, sample_ids, fields, expect)

    def complete(self, unit: Any, answer: Any) -> dict[str, EncodedField]:
        return answer
