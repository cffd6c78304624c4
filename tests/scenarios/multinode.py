"""Multi-node scenario on one machine (ray.cluster_utils.Cluster), run in its own process.

Prints one JSON line with what it observed; tests/test_multinode.py asserts on it.
"""

import json
import os
import sys

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray
import torch
from ray.cluster_utils import Cluster

from dataplane_client import DataPlaneConfig
from dataplane_client.errors import SamplesLost
from dataplane_server import start


def main() -> None:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "include_dashboard": False,
            "_system_config": {
                "health_check_period_ms": 300,
                "health_check_failure_threshold": 3,
                "health_check_timeout_ms": 500,
            },
        },
    )
    worker = cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    out: dict = {}
    handle = start(DataPlaneConfig(name="mn", num_storage_units=2, admin_enabled=False))
    units = [ray.get(u.ping.remote()) for u in handle.units]
    out["unit_nodes"] = [u.node_id for u in units]
    c = handle.client()
    c.register_partition("p", ["x"], None, ["t"])
    ids = [f"s{i}" for i in range(40)]
    rows = [torch.arange(i + 1, dtype=torch.float32) for i in range(40)]
    c.put_samples(ids, "p", {"x": rows})
    got = c.get_samples(ids, "p", ["x"])["x"].unbind()
    out["cross_node_roundtrip"] = all(torch.equal(a, b) for a, b in zip(got, rows))
    where = ray.get(handle.controller.lookup_units.remote("p", ids))
    doomed_unit = next(i for i, u in enumerate(units) if u.node_id == worker.node_id)
    doomed = sorted(s for s, u in zip(ids, where) if u == doomed_unit)
    survivors = [s for s, u in zip(ids, where) if u != doomed_unit]
    out["doomed"] = doomed
    cluster.remove_node(worker)
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
    # New puts route to the surviving unit; the service keeps serving claims.
    new_ids = [f"n{i}" for i in range(10)]
    c.put_samples(new_ids, "p", {"x": [torch.ones(3)] * 10})
    out["new_units"] = sorted(set(ray.get(handle.controller.lookup_units.remote("p", new_ids))))
    out["doomed_unit"] = doomed_unit
    out["new_readable"] = bool(c.get_samples(new_ids, "p", ["x"])["x"].values().sum().item() == 30)
    claimed = c.claim_meta("p", "t", ["x"], 100, blocking=False).sample_ids
    out["claim_skips_lost"] = sorted(claimed) == sorted(survivors + new_ids)
    handle.shutdown()
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
