"""The capability probe: which backend moves bytes between this process and each unit,
decided once, at connect (or at the first read that needs it).

Per unit: same node with shared memory -> ``shm`` (not a payload backend at all); another
node -> Mooncake's engine (``mooncake-rdma`` where the unit's engine found an RDMA device,
else ``mooncake-tcp``) when (1) the service allows it (``cross_node_transport`` is
``auto`` or ``tcp``), (2) the package imports here, (3) the unit's engine runs (its
``payload_offer``), (4) this process's engine starts, (5) moves bytes over the same
transport as the unit's and (6) pulls the unit's probe bytes, CRC-32C checked (the peer
is reachable); else Ray's object transfer, with the first reason that failed. Each
choice is logged once per process and unit node, and shown in
``service_info().payload_paths``.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Callable

import ray

from dataplane_client.transport.payload import mooncake
from dataplane_client.transport.payload.base import MOONCAKE, RAY, SHM
from dataplane_client.wire.messages import PayloadOffer, PayloadPath

log = logging.getLogger(__name__)

OFFER_TIMEOUT_S = 10.0  # a unit's engine starts on the first ask (about 0.8 s here)
_logged: set[tuple[str, str, str]] = set()
_logged_lock = threading.Lock()


def installed() -> bool:
    """Whether the Mooncake package is importable here (cheap: nothing is loaded)."""
    try:
        return importlib.util.find_spec("mooncake") is not None
    except (ImportError, ValueError):
        return False


def choose(
    units: list,
    nodes: list[str | None],
    shared: list[bool],
    alive: list[bool],
    local_node: str | None,
    mode: str,
    host: Callable[[], str] = ray.util.get_node_ip_address,
    timeout_s: float = OFFER_TIMEOUT_S,
) -> list[PayloadPath]:
    """One :class:`PayloadPath` per unit (see the module's docstring)."""
    paths: list[PayloadPath | None] = [None] * len(units)
    remote = []
    for u, node in enumerate(nodes):
        node_id = node or ""
        if shared[u]:
            paths[u] = PayloadPath(u, node_id, SHM)
        elif node is not None and node == local_node:
            paths[u] = PayloadPath(u, node_id, RAY, "same node, without shared memory")
        elif not alive[u]:
            paths[u] = PayloadPath(u, node_id, RAY, "the unit is not alive")
        elif mode == RAY:
            paths[u] = PayloadPath(u, node_id, RAY, "cross_node_transport is 'ray'")
        elif not installed():
            paths[u] = PayloadPath(
                u,
                node_id,
                RAY,
                "Mooncake is not installed in this process "
                "(pip install 'rl-dataplane[mooncake]', and Debian's libibverbs1)",
            )
        else:
            remote.append(u)
    if remote:
        calls = {units[u].payload_offer.remote(): u for u in remote}
        answered, _ = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
        offers: dict[int, PayloadOffer | str] = {
            u: f"the unit did not answer the probe within {timeout_s:g}s" for u in remote
        }
        for ref in answered:
            try:
                offers[calls[ref]] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a unit that cannot answer is reached through Ray
                offers[calls[ref]] = f"the unit's probe failed: {type(e).__name__}: {e}"
        me = host()
        for u in remote:
            offer, node_id = offers[u], nodes[u] or ""
            if isinstance(offer, str):
                paths[u] = PayloadPath(u, node_id, RAY, offer)
            elif offer.backend not in MOONCAKE:
                paths[u] = PayloadPath(u, node_id, RAY, offer.reason)
            else:
                why_not = mooncake.probe(offer, me, mode)
                paths[u] = (
                    PayloadPath(u, node_id, offer.backend, offer.session)
                    if why_not is None
                    else PayloadPath(u, node_id, RAY, why_not)
                )
    chosen = [p for p in paths if p is not None]
    assert len(chosen) == len(units)
    for p in chosen:
        _log_once(p)
        if p.backend != SHM and alive[p.unit]:
            _tell_unit(units[p.unit], p)
    return chosen


def _tell_unit(unit, path: PayloadPath) -> None:
    """Report our choice to the unit (``dataplane status``, metrics); not awaited, and a
    unit that cannot take it changes nothing here."""
    try:
        unit.payload_chosen.remote(path.backend, path.detail)
    except Exception:  # noqa: BLE001 - Ray shut down, or a stand-in without the method
        pass


def _log_once(path: PayloadPath) -> None:
    if path.backend == SHM:
        return
    key = (path.node_id, path.backend, path.detail)
    with _logged_lock:
        if key in _logged:
            return
        _logged.add(key)
    # A fallback where Mooncake is installed is worth a warning; one where it is not is the
    # expected state of a plain install.
    fallback = path.backend == RAY and installed() and "not installed" not in path.detail
    log.log(
        logging.WARNING if fallback else logging.INFO,
        "dataplane: bytes from unit %d (node %s) travel by %s%s",
        path.unit,
        path.node_id[:12],
        path.backend,
        f" ({path.detail})" if path.detail else "",
    )
