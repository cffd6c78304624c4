"""Units on two nodes, one node lost (part of tests/scenarios/one_cluster.py).

tests/e2e/test_multinode.py asserts on what it observed.
"""

import time

import ray
import torch

from dataplane_client import DataPlaneConfig
from dataplane_client.wire.errors import SamplesLost
from dataplane_server import start


def run(cluster, worker) -> dict:
    """On the head and one worker node (alive, nothing else on them); removes the worker."""
    out: dict = {}
    handle = start(DataPlaneConfig(name="mn", num_storage_units=2, admin_enabled=False))
    units = [ray.get(u.ping.remote()) for u in handle.units]
    out["unit_nodes"] = [u.node_id for u in units]
    c = handle.client()
    # Known size (40): it must still reach done once the lost node's samples are terminal.
    c.register_partition("p", ["x"], 40, ["t"])
    ids = [f"s{i}" for i in range(40)]
    rows = [torch.arange(i + 1, dtype=torch.float32) for i in range(40)]
    c.put_samples(ids, "p", {"x": rows})
    got = c.get_samples(ids, "p", ["x"])["x"].unbind()
    out["cross_node_roundtrip"] = all(torch.equal(a, b) for a, b in zip(got, rows))
    out["paths"] = sorted({p.backend for p in c.service_info().payload_paths})
    where = ray.get(handle.controller.lookup_units.remote("p", ids))
    doomed_unit = next(i for i, u in enumerate(units) if u.node_id == worker.node_id)
    doomed = sorted(s for s, u in zip(ids, where) if u == doomed_unit)
    survivors = [s for s, u in zip(ids, where) if u != doomed_unit]
    out["doomed"] = doomed
    cluster.remove_node(worker)
    # The controller notices from Ray's node state, before anyone reads a lost sample.
    t0 = time.monotonic()
    out["detect_s"] = None
    while time.monotonic() - t0 < 60:
        if not c.service_info().units[doomed_unit].alive:
            out["detect_s"] = round(time.monotonic() - t0, 2)
            break
        time.sleep(0.1)  # polling the service's own view, with a deadline
    try:
        c.get_samples(ids, "p", ["x"])
        out["lost_reported"] = None
    except SamplesLost as e:
        out["lost_reported"] = sorted(e.ids)
    # Every other sample stays readable, bit for bit.
    got = c.get_samples(survivors, "p", ["x"])["x"].unbind()
    out["survivors_readable"] = all(
        torch.equal(g, rows[ids.index(s)]) for g, s in zip(got, survivors)
    )
    # A second client learns about the loss from the controller.
    try:
        handle.client().get_samples(doomed[:1], "p", ["x"])
        out["second_client_lost"] = False
    except SamplesLost:
        out["second_client_lost"] = True
    # Claims hand out only the survivors, and the known-size partition then counts as done.
    claimed = c.claim_meta("p", "t", ["x"], 100, blocking=False).sample_ids
    out["claim_skips_lost"] = sorted(claimed) == sorted(survivors)
    out["partition_done"] = c.check_consumption_status("p", ["t"])
    # A blocking claim only lost samples could satisfy fails at once, naming them.
    c.register_partition("q", ["x"], None, ["t"])
    c.put_samples(ids, "q", {"x": rows})  # all on the surviving unit now
    try:
        c.claim_meta("p", "t", ["x"], 1, timeout_s=60)
        out["unsatisfiable_claim"] = None
    except SamplesLost as e:
        out["unsatisfiable_claim"] = sorted(e.ids)
    # New puts route to the surviving unit; the service keeps serving.
    new_ids = [f"n{i}" for i in range(10)]
    c.put_samples(new_ids, "q", {"x": [torch.ones(3)] * 10})
    out["new_units"] = sorted(set(ray.get(handle.controller.lookup_units.remote("q", new_ids))))
    out["doomed_unit"] = doomed_unit
    out["new_readable"] = bool(c.get_samples(new_ids, "q", ["x"])["x"].values().sum().item() == 30)
    handle.shutdown()
    return out
