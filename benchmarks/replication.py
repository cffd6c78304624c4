"""What ``replicas: 2`` costs a put: throughput and small-put latency against ``replicas: 1``.

Replication needs units on two nodes, so this runs on its own two-node loopback
cluster (``ray.cluster_utils.Cluster``: a head and one worker node, one unit
each), never on the single-node Ray of ``benchmarks.run``; that harness runs
this module in a subprocess (``python -m benchmarks.run --only replication``).
Standalone::

    python -m benchmarks.replication [--quick] [--repeats 3] [--out bench_results/replication.json]

The writer is the driver on the head node: with ``replicas: 1`` half of a put's
rows go to the head's unit (shared memory) and half to the worker's (through
Ray); with ``replicas: 2`` every row goes to both, so each put moves twice the
bytes and its commit is always two-phase (prepare, then publish, on both units).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

MiB = 1 << 20


def _measure(replicas: int, total: int, row_bytes: int, repeats: int, small_puts: int) -> dict:
    import torch

    from benchmarks.common import median, percentile
    from dataplane_client.wire.config import DataPlaneConfig
    from dataplane_server.launch.service import start

    handle = start(
        DataPlaneConfig(
            name=f"bench-replicas-{replicas}",
            num_storage_units=2,
            replicas=replicas,
            admin_enabled=False,
            unit_warm_reserve_bytes=64 * MiB,
            unit_capacity_bytes=4 * total + 256 * MiB,
        )
    )
    try:
        client = handle.client()
        n = total // row_bytes
        rows = torch.randint(0, 255, (n, row_bytes), dtype=torch.uint8)
        seconds, held = [], 0
        for r in range(repeats + 1):  # the first put warms the units up and is not counted
            pid = f"bulk{r}"
            client.register_partition(pid, ["x"])
            ids = [f"{pid}-{i}" for i in range(n)]
            t0 = time.perf_counter()
            client.put_samples(ids, pid, {"x": rows})
            if r:
                seconds.append(time.perf_counter() - t0)
            if r == 1:  # what the units hold for these bytes, and they read back exactly
                held = sum(u.bytes for u in client.service_info().units)
                assert torch.equal(client.get_samples(ids, pid, ["x"])["x"], rows)
            client.delete_partition(pid)
        client.register_partition("small", ["x"])
        one = torch.ones(1, 4096, dtype=torch.uint8)
        latencies = []
        for i in range(small_puts):
            t0 = time.perf_counter()
            client.put_samples([f"s{i}"], "small", {"x": one})
            latencies.append(time.perf_counter() - t0)
        return {
            "replicas": replicas,
            "put_bytes": total,
            "put_s": seconds,
            "put_mib_s": total / MiB / median(seconds),
            "units_hold_per_byte": held / total,
            "small_put_p50_ms": 1e3 * percentile(latencies, 50),
            "small_put_p99_ms": 1e3 * percentile(latencies, 99),
        }
    finally:
        handle.shutdown()


def measure_all(quick: bool, repeats: int) -> dict:
    """Both settings on one fresh two-node cluster; raw numbers."""
    import ray

    from dataplane_server.launch.local_ray import start_local_cluster

    total, row_bytes = (16 * MiB, 64 * 1024) if quick else (64 * MiB, 256 * 1024)
    small_puts = 30 if quick else 200
    store = 4 * total + 256 * MiB
    cluster, _ = start_local_cluster(
        [
            {"num_cpus": cpus, "object_store_memory": store, "include_dashboard": False}
            for cpus in (4, 2)
        ]
    )
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        runs = [_measure(r, total, row_bytes, repeats, small_puts) for r in (1, 2)]
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {
        "runs": runs,
        "row_bytes": row_bytes,
        "small_put_bytes": 4096,
        "load_avg": os.getloadavg(),
        "layout": "2 nodes (head + 1 worker, ray.cluster_utils.Cluster), one unit per node, "
        "writer on the head node",
    }


def table_rows(data: dict) -> list[list[Any]]:
    base = data["runs"][0]["put_mib_s"]
    return [
        [
            r["replicas"],
            f"{r['put_bytes'] // MiB} MiB in {data['row_bytes'] // 1024} KiB rows",
            f"{r['put_mib_s']:.0f}",
            f"{r['put_mib_s'] / base:.2f}",
            f"{r['units_hold_per_byte']:.2f}",
            f"{r['small_put_p50_ms']:.1f} / {r['small_put_p99_ms']:.1f}",
        ]
        for r in data["runs"]
    ]


HEADERS = [
    "replicas",
    "put",
    "put MiB/s (median)",
    "vs replicas 1",
    "bytes held per byte put",
    "1-sample 4 KiB put p50 / p99 ms",
]


def run(opts: Any) -> Any:
    """The ``benchmarks.run`` section: this module in a subprocess (its own cluster)."""
    from benchmarks.common import Section, Table

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "replication.json")
        argv = [sys.executable, "-m", "benchmarks.replication", "--out", out]
        argv += ["--repeats", str(opts.repeats)] + (["--quick"] if opts.quick else [])
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        env.pop("RAY_ADDRESS", None)  # the child makes its own cluster
        # The child's own table is not printed twice: the harness renders the section.
        subprocess.run(argv, check=True, env=env, timeout=1200, stdout=subprocess.DEVNULL)
        with open(out) as f:
            data = json.load(f)
    return Section(
        name="replication",
        tables=[Table("put cost of a second copy on another node", HEADERS, table_rows(data))],
        data=data,
        notes=[data["layout"] + f"; load average {data['load_avg'][0]:.1f} (2 shared cores)"],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--repeats", type=int, default=3, help="timed puts per setting (median)")
    p.add_argument("--out", default="bench_results/replication.json")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    from benchmarks.common import markdown_table

    data = measure_all(args.quick, args.repeats)
    print(markdown_table(HEADERS, table_rows(data)))
    print(f"\n{data['layout']}; load average {data['load_avg'][0]:.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
