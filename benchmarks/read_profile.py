"""Where a steady-state same-node get's time goes: round trip, mapping and faults, touching.

A writer (this driver) puts the store section's simple workload (4 float32 fields of
``[batch, 8192]``), a reader actor gets it and touches one element per 4 KiB page, as
the store section does, then the driver clears it: the put / get / clear cycle of a
training loop, which recycles the unit's chunks. After warm-up rounds, per get:

- ``get ms``: ``get_samples`` inside the reader (no driver round trip);
- ``touch ms``: reading one element per page of what it returned;
- ``faults get`` / ``faults touch``: the reader's minor page faults in each (a fresh
  mapping faults once per page it touches; a kept one, none);
- ``unit call ms``: a same-node ``read_shm`` of the same rows alone (its answer only:
  nothing mapped), and ``no-op ms``: an empty call to the same unit, from the reader;
- ``memcpy ms``: one thread copying the same bytes into a touched buffer, in the reader.

Runs against whatever ``dataplane_client`` is importable, so the same script measures
another tree (``PYTHONPATH=<worktree>``)::

    python -m benchmarks.read_profile --sizes 128M,1G --rounds 7 --out /tmp/read_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from typing import Any

import numpy as np
import ray

from benchmarks.common import MiB, median, parse_size, start_ray
from benchmarks.store_throughput import FIELDS_SIMPLE, SEQ_LEN, make_workload, touch
from dataplane_client.wire.messages import read_request, unpack_read_answer

SERVICE_NAME = "bench-read-profile"
NAMESPACE = "bench"
WARM_UP_ROUNDS = 3


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@ray.remote
class Reader:
    def __init__(self, name: str, namespace: str):
        from dataplane_client.client import connect

        self.client = connect(name, namespace)

    def get(self, ids: list[str], partition: str, fields: list[str]) -> dict[str, float]:
        f0, t0 = _faults(), time.perf_counter()
        out = self.client.get_samples(ids, partition, fields)
        f1, t1 = _faults(), time.perf_counter()
        touch(out)
        f2, t2 = _faults(), time.perf_counter()
        del out
        unit = self.client._transport.units[0]
        owner = self.client._transport._stage_owner()
        t3 = time.perf_counter()
        answer = unpack_read_answer(
            ray.get(unit.read_shm.remote(read_request(partition, ids, fields, owner)))
        )
        t4 = time.perf_counter()
        ray.get(unit.recycled_chunks.remote())
        t5 = time.perf_counter()
        leases = {v.lease for v in answer.values() if getattr(v, "lease", None) is not None}
        ray.get(unit.release_reads.remote(sorted(leases)))
        return {
            "get_s": t1 - t0,
            "touch_s": t2 - t1,
            "faults_get": f1 - f0,
            "faults_touch": f2 - f1,
            "unit_call_s": t4 - t3,
            "noop_s": t5 - t4,
        }

    def memcpy(self, nbytes: int, repeats: int) -> float:
        src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t0)
        return median(times)


def profile(size: int, rounds: int) -> dict[str, Any]:
    from dataplane_client.wire.config import DataPlaneConfig
    from dataplane_server.launch.service import start

    handle = start(
        DataPlaneConfig(
            name=SERVICE_NAME, namespace=NAMESPACE, admin_enabled=False, metrics_enabled=False
        )
    )
    try:
        writer = handle.client()
        batch = max(2, size // (SEQ_LEN * 4 * FIELDS_SIMPLE))
        fields, nbytes = make_workload("simple", batch, SEQ_LEN, FIELDS_SIMPLE)
        ids, partition = [f"k{i}" for i in range(batch)], "profile"
        writer.register_partition(partition, fields=list(fields))
        ip = ray.util.get_node_ip_address()
        reader = Reader.options(num_cpus=0.001, resources={f"node:{ip}": 0.001}).remote(
            SERVICE_NAME, NAMESPACE
        )
        samples = []
        for r in range(WARM_UP_ROUNDS + rounds):
            writer.put_samples(ids, partition, fields)
            got = ray.get(reader.get.remote(ids, partition, list(fields)))
            writer.clear_samples(ids, partition)
            if r >= WARM_UP_ROUNDS:
                samples.append(got)
        memcpy_s = ray.get(reader.memcpy.remote(nbytes, rounds))
        ray.kill(reader)
    finally:
        handle.shutdown()
    row = {k: median([s[k] for s in samples]) for k in samples[0]}
    row.update(bytes=nbytes, rounds=rounds, memcpy_s=memcpy_s)
    return row


def main() -> None:
    import dataplane_client
    from benchmarks.run import RAY_NUM_CPUS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="128M,1G")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default="bench_results/read_profile.json")
    opts = p.parse_args()
    sizes = [parse_size(s) for s in opts.sizes.split(",")]
    start_ray(RAY_NUM_CPUS, 3 * max(sizes) + 512 * MiB)
    rows = [profile(size, opts.rounds) for size in sizes]
    tree = os.path.dirname(os.path.dirname(dataplane_client.__file__))
    print(f"\nsteady-state same-node get, medians of {opts.rounds} rounds ({tree})\n")
    head = "| size | get ms | touch ms | faults get | faults touch | unit call ms | no-op ms | memcpy ms | (get+touch)/memcpy |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        print(
            f"| {r['bytes'] // MiB} MiB | {1e3 * r['get_s']:.2f} | {1e3 * r['touch_s']:.2f} "
            f"| {r['faults_get']:.0f} | {r['faults_touch']:.0f} | {1e3 * r['unit_call_s']:.2f} "
            f"| {1e3 * r['noop_s']:.2f} | {1e3 * r['memcpy_s']:.2f} "
            f"| {(r['get_s'] + r['touch_s']) / r['memcpy_s']:.2f} |"
        )
    os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
    with open(opts.out, "w") as f:
        json.dump({"tree": tree, "rows": rows}, f, indent=2)
    ray.shutdown()


if __name__ == "__main__":
    main()
