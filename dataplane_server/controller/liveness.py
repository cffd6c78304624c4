"""The controller's background watch: which storage units died, and when to look again.

A unit is lost when its node is dead in Ray's view (a node can vanish without
its actors ever answering an error) or when the unit's actor itself died. The
watch runs every ``liveness_interval_s`` so a death shows within seconds, not
at the next failed read. With ``replicas: 2`` the controller then hands the lost
unit's samples to their second copies (``KeySpace.fail_over``); only samples
with no copy left are lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import ray

from dataplane_client.wire.messages import UnitInfo
from dataplane_server.core import unit_calls


async def dead_units(
    units: list, unit_info: list[UnitInfo], watched: list[int], timeout_s: float
) -> list[int]:
    """The watched units that are gone: on a dead node, or a dead actor."""
    nodes = await asyncio.to_thread(ray.nodes)
    dead_nodes = {n["NodeID"] for n in nodes if not n.get("Alive")}
    gone = [i for i in watched if unit_info[i].node_id in dead_nodes]
    rest = [i for i in watched if i not in gone]
    checks = await asyncio.gather(
        *[unit_calls.is_dead(units[i], max(timeout_s, 1.0)) for i in rest]
    )
    return gone + [i for i, dead in zip(rest, checks) if dead]


async def every(
    interval_s: float, round_: Callable[[], Awaitable[None]], on_error: Callable[[], None]
) -> None:
    """Run ``round_`` every ``interval_s`` until cancelled; a failed round is reported to
    ``on_error`` and does not end the watch."""
    while True:
        await asyncio.sleep(interval_s)  # a periodic timer, not synchronisation
        try:
            await round_()
        except Exception:  # noqa: BLE001 - one failed round must not end watching; counted
            on_error()
