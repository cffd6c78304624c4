"""Where a put's copies go when the service keeps two (config ``replicas: 2``).

Each sample has a unit (chosen by the client, see ``RayDataPlaneClient._assign_new``)
and a second copy on a unit of another node, so that losing one unit or one node
leaves a copy. The second unit is a function of the first and of which units are
alive: the next alive unit after it, in index order, that sits on another node.
Every writer of a sample therefore picks the same pair without asking anyone;
the controller records the pair at the first commit and re-routes a writer whose
pair differs (after a unit died and the samples' survivors took over).
"""

from __future__ import annotations

import numpy as np


def second_units(units: np.ndarray, alive: list[bool], nodes: list[str]) -> np.ndarray:
    """Per sample, the unit of its second copy; -1 where no alive unit sits on another node
    than the sample's unit (the sample is then written once)."""
    out = np.full(len(units), -1, dtype=np.int64)
    n = len(alive)
    for u in np.unique(units).tolist():
        ring = [(u + k) % n for k in range(1, n)]
        other = next((v for v in ring if alive[v] and nodes[v] != nodes[u]), -1)
        out[units == u] = other
    return out


def stage_plan(units: np.ndarray, replicas: np.ndarray | None) -> dict[int, np.ndarray]:
    """Rows to stage per unit: its samples' first copies and the second copies it keeps."""
    held = units if replicas is None else np.concatenate([units, replicas[replicas >= 0]])
    plan = {}
    for u in np.unique(held).tolist():
        mine = units == u if replicas is None else (units == u) | (replicas == u)
        plan[int(u)] = np.nonzero(mine)[0]
    return plan
