"""Calling storage units from the controller: pings, frees, and what a failure means.

Only a dead actor is proof that a unit is lost; a slow answer is not. A typed
error a unit raised reaches the caller as itself, without Ray's wrapper.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Mapping

from dataplane_client.wire.errors import DataPlaneError
from dataplane_client.wire.messages import UnitInfo, UnitSnapshot

UNIT_PING_TIMEOUT_S = 5.0


def is_dead_actor(exc: BaseException) -> bool:
    # Only Ray raises RayActorError, so while Ray is not loaded nothing raised one. Looked
    # up, not imported: recovery, which uses this module, imports without Ray
    # (tests/core/test_core_imports.py).
    ray = sys.modules.get("ray")
    if ray is None or isinstance(exc, ray.exceptions.ActorUnavailableError):
        return False  # restarting (a durable unit) or unreachable for now: not proof
    return isinstance(exc, ray.exceptions.RayActorError)


def typed(exc: BaseException) -> BaseException:
    """The typed error a unit raised, without Ray's task-error wrapper."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, DataPlaneError) else exc


async def ping(unit, timeout_s: float = UNIT_PING_TIMEOUT_S) -> UnitInfo | None:
    """The unit's info, or None when it does not answer in time."""
    try:
        return await asyncio.wait_for(unit.ping.remote(), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - no answer: the caller decides what that means
        return None


async def is_dead(unit, timeout_s: float) -> bool:
    """True only when Ray says the unit's actor died (a slow unit is alive)."""
    try:
        await asyncio.wait_for(unit.ping.remote(), timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - only a dead actor is proof; slow is not
        return is_dead_actor(e)
    return False


async def free(units: list, partition_id: str, targets: Mapping[int, list[str] | None]) -> int:
    """Free samples (None: the whole partition) on each target unit; bytes freed in all.
    A unit that fails to answer frees nothing and is not an error here (its bytes are lost
    with it, or freed by its own deadline)."""
    freed = await asyncio.gather(
        *[units[u].clear.remote(partition_id, ids) for u, ids in targets.items()],
        return_exceptions=True,
    )
    return sum(f for f in freed if isinstance(f, int))


async def snapshots(units: list, alive: list[bool]) -> list[UnitSnapshot | None]:
    """Each unit's metrics snapshot; None for a lost or unreachable unit (shown as absent)."""

    async def one(i: int) -> UnitSnapshot | None:
        if not alive[i]:
            return None
        try:
            return await asyncio.wait_for(
                units[i].metrics_snapshot.remote(), timeout=UNIT_PING_TIMEOUT_S
            )
        except Exception:  # noqa: BLE001 - an unreachable unit shows as absent
            return None

    return list(await asyncio.gather(*[one(i) for i in range(len(units))]))
