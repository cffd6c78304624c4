"""The multi-node scenarios on one loopback cluster (ray.cluster_utils.Cluster), in order.

Run in its own process (it cannot share the test session's Ray); prints one
``RESULT {json}`` line, a key per scenario, that tests/e2e/test_cross_node.py,
tests/e2e/test_replication.py and tests/e2e/test_multinode.py assert on. One cluster serves
all three because each grows or shrinks it the way the next one needs (a cluster
and its interpreter each took 10-20 s to start here):

1. ``cross_node``: the head alone holds the service; it adds node A for its readers.

Cross-node bytes move through Mooncake's transfer engine where it is installed (every
field: ``DATAPLANE_TRANSFER_MIN_BYTES=0``), so each scenario runs on that path, and the
cross-node scenario also reads through Ray's (one cluster start for both backends).
2. ``replication``: node B joins (head, A, B); B is removed during streaming writes.
3. ``multinode``: the head and A hold a unit each; A is removed.

A scenario that raises is reported as ``{"error": traceback}`` under its key and the
next one still runs.
"""

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: polling

import cross_node_reads
import multinode
import ray
import replication

from dataplane_client.wire import failpoints
from dataplane_server.launch.local_ray import start_local_cluster

HEAD = {
    "num_cpus": 4,
    "include_dashboard": False,
    # A removed node is noticed within about 1.5 s (the node-loss scenarios wait on it).
    "_system_config": {
        "health_check_period_ms": 300,
        "health_check_failure_threshold": 3,
        "health_check_timeout_ms": 500,
    },
}


def _part(out: dict, name: str, scenario) -> None:
    try:
        out[name] = scenario()
    except Exception:  # noqa: BLE001 - reported to the scenario's test, which fails on it
        out[name] = {"error": traceback.format_exc()}
    print(f"{name}: {out[name]}", file=sys.stderr, flush=True)


def main() -> None:
    # Before the cluster starts, so every Ray worker inherits them: a failpoint directory
    # (the cross-node scenario spoils pulls), and every field of a cross-node get through
    # the transfer engine where one runs (however small: these scenarios' rows are).
    os.environ.setdefault(failpoints.ENV, tempfile.mkdtemp(prefix="dp-failpoints-"))
    os.environ["DATAPLANE_TRANSFER_MIN_BYTES"] = "0"
    cluster, _ = start_local_cluster([HEAD], attempts=5)
    ray.init(address=cluster.address, log_to_driver=False)
    out: dict = {}
    try:
        _part(out, "cross_node", lambda: cross_node_reads.run(cluster))
        # Node A, which the cross-node scenario added (or a new one if it failed first).
        node_a = next(iter(cluster.worker_nodes), None) or cluster.add_node(num_cpus=2)
        node_b = cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        _part(out, "replication", lambda: replication.run(cluster, node_b))
        _part(out, "multinode", lambda: multinode.run(cluster, node_a))
    finally:  # a failed part must not leave the cluster's processes behind
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
