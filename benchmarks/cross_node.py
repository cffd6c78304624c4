"""Cross-node get: a unit on node B, reader actors on node A, by each cross-node path,
against the Ray object store and the machine's raw loopback TCP.

Two Ray nodes on this machine (``ray.cluster_utils.Cluster``), in a child
process with its own cluster (the harness's Ray is single-node):

- **B** (the head) runs the service with one storage unit, the writer (the
  driver, which puts the data once), a *holder* actor with the same tensors and a
  *sender* actor serving the same number of bytes on a plain TCP socket;
- **A** runs the reader actors, which
  - **ours**: ``get_samples`` of every row and field through the path the probe
    chose (``dataplane_client/transport/payload``): Mooncake's transfer engine
    over TCP where it loads (the reader pulls the unit's registered memory, each
    field CRC-32 checked), else Ray's;
  - **ours (ray path)**: the same get from a client made with
    ``cross_node_transport="ray"``: the unit's ``read`` and Ray's object transfer;
  - **ray**: ``ray.get(holder.value.remote())``: the holder on B returns the
    same dict of tensors, so Ray serializes it into B's object store and moves
    it to A: the same bytes, carried by the object store alone;
  - **ray transfer**: ``ray.get`` of an object the holder ``ray.put`` beforehand
    (its put not timed): the object transfer alone;
  - **raw tcp**: ``recv_into`` one preallocated buffer of the same bytes from the
    sender's socket on 127.0.0.1 (one connection, ``sendall`` of one buffer):
    the physical limit of a byte stream between two processes here.

Every reader touches one element per 4 KiB page of what it got. Each call is
timed from the driver around ``ray.get(reader.method.remote())``; systems are
interleaved within every repeat after one unrecorded warm-up round; medians.
Targets: ours >= 2x ray (the same bytes from an actor on B to A); with Mooncake,
ours >= 0.8x raw TCP and >= 2x ours through Ray's path (issue 39).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import GiB, MiB, Options, Section, Table, Target, human_size, ratio

TARGET_X_RAY = 2.0
TARGET_X_RAW_TCP = 0.8  # Mooncake TCP against a plain socket copy
TARGET_X_RAY_PATH = 2.0  # Mooncake TCP against our own get through Ray's path
SIZE = 128 * MiB
QUICK_SIZE = 4 * MiB
SEQ_LEN = 8192
FIELDS = 4
SYSTEMS = ("ours", "ours_ray_path", "ray", "ray_transfer", "raw_tcp")
# Puts from A to the unit on B: pushed by the engine (transfer_puts), or through Ray's path.
PUT_SYSTEMS = ("put_ours", "put_ray_path")


def run(opts: Options) -> Section:
    """The harness's entry: run the child, judge what it measured."""
    size = QUICK_SIZE if opts.quick else SIZE
    repeats = max(1, opts.repeats)
    opts.log(f"crossnode: two-node cluster, {human_size(size)}, {repeats} repeats")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)  # the child makes its own cluster
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cross_node", "--size", str(size)]
        + ["--repeats", str(repeats)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"cross-node child failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return _report(json.loads(lines[-1][len("RESULT ") :]), repeats, opts)


def _report(res: dict[str, Any], repeats: int, opts: Options) -> Section:
    section = Section("crossnode")
    gibps = {s: res["bytes"] / GiB / res["median_s"][s] for s in SYSTEMS}
    x_ray = ratio(gibps["ours"], gibps["ray"])
    x_raw = ratio(gibps["ours"], gibps["raw_tcp"])
    x_path = ratio(gibps["ours"], gibps["ours_ray_path"])
    path = res["path"]
    section.tables.append(
        Table(
            f"cross-node get, GiB/s (median of {repeats}; unit on B, reader on A, timed from "
            f"the driver; ours through {path})",
            [
                "size",
                "ours",
                "ours (ray path)",
                "ray",
                "ray transfer",
                "raw tcp",
                "ours/raw tcp",
                "ours/ours (ray path)",
                "ours/ray",
            ],
            [
                [
                    human_size(res["bytes"]),
                    gibps["ours"],
                    gibps["ours_ray_path"],
                    gibps["ray"],
                    gibps["ray_transfer"],
                    gibps["raw_tcp"],
                    x_raw,
                    x_path,
                    x_ray,
                ]
            ],
        )
    )
    if "put_ours" in res["median_s"]:
        put = {s: res["bytes"] / GiB / res["median_s"][s] for s in PUT_SYSTEMS}
        section.tables.append(
            Table(
                f"cross-node put, GiB/s (median of {repeats}; writer on A, unit on B; cleared "
                "after each, untimed)",
                ["size", "ours (pushed, transfer_puts)", "ours (ray path)", "pushed/ray path"],
                [
                    [
                        human_size(res["bytes"]),
                        put["put_ours"],
                        put["put_ray_path"],
                        ratio(put["put_ours"], put["put_ray_path"]),
                    ]
                ],
            )
        )
    size = human_size(res["bytes"])
    section.targets.append(
        Target(
            f"cross-node get >= {TARGET_X_RAY:g}x the Ray object store ({size})",
            x_ray,
            TARGET_X_RAY,
            True,
            "x",
            detail=f"ours {gibps['ours']:.2f} vs ray {gibps['ray']:.2f} GiB/s",
        )
    )
    if path == "mooncake-tcp":
        section.targets.append(
            Target(
                f"Mooncake TCP get >= {TARGET_X_RAW_TCP:g}x raw loopback TCP ({size})",
                x_raw,
                TARGET_X_RAW_TCP,
                True,
                "x",
                detail=f"ours {gibps['ours']:.2f} vs raw tcp {gibps['raw_tcp']:.2f} GiB/s",
            )
        )
        section.targets.append(
            Target(
                f"Mooncake TCP get >= {TARGET_X_RAY_PATH:g}x our get through Ray's path ({size})",
                x_path,
                TARGET_X_RAY_PATH,
                True,
                "x",
                detail=f"ours {gibps['ours']:.2f} vs {gibps['ours_ray_path']:.2f} GiB/s",
            )
        )
    else:
        section.notes.append(f"ours went through {path}: Mooncake did not load ({res['why']})")
    p = res["profile"]
    section.profile_tables.append(
        Table(
            "ours, one get under cProfile in the reader, with the unit's own read time",
            ["reader total s", "unit read s", "top reader functions by own time"],
            [
                [
                    p["total_s"],
                    p["unit_read_s"],
                    "; ".join(f"{e['function']} {e['tottime_s']:.3f}s" for e in p["top"][:5]),
                ]
            ],
        )
    )
    if opts.quick:
        section.notes.append(
            "--quick: tiny size; the target is judged anyway, as a smoke test only"
        )
    section.data = res
    return section


# ---------------------------------------------------------------------------- the child


def _starting(start: Any, attempts: int = 3) -> Any:
    """``start()``, again when Ray's 30 s for a node to register ran out (a loaded machine)."""
    for attempt in range(attempts):
        try:
            return start()
        except Exception as e:  # Ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _child(size: int, repeats: int) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from benchmarks.common import cprofile_top
    from benchmarks.store_throughput import make_workload, touch
    from dataplane_client import DataPlaneConfig
    from dataplane_server import start

    store = 3 * size + GiB // 2
    args = {"num_cpus": 4, "object_store_memory": store}
    cluster = _starting(
        lambda: Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
    )
    ray.init(address=cluster.address, log_to_driver=False)
    # The service starts while B (the head) is the only node: its unit lives on B.
    # transfer_puts: node A's puts may be pushed by the engine (the "put" rows below).
    handle = start(
        DataPlaneConfig(
            name="xn-bench", num_storage_units=1, admin_enabled=False, transfer_puts=True
        )
    )
    node_a = _starting(lambda: cluster.add_node(**args))
    cluster.wait_for_nodes()
    on_a = NodeAffinitySchedulingStrategy(node_a.node_id, soft=False)
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)

    @ray.remote(num_cpus=0)
    class Holder:
        def __init__(self, batch: int):
            self.fields, _ = make_workload("simple", batch, SEQ_LEN, FIELDS)

        def value(self) -> dict:
            return self.fields

        def put(self) -> list:
            return [ray.put(self.fields)]  # in a list: the driver gets the ref, not the value

    @ray.remote(num_cpus=0)
    class Sender:
        """Serves ``nbytes`` on a plain TCP socket, one buffer per connection."""

        def __init__(self, nbytes: int):
            import socket
            import threading

            import numpy as np

            self.buf = np.ones(nbytes, dtype=np.uint8)
            self.sock = socket.create_server(("127.0.0.1", 0))
            threading.Thread(target=self._serve, daemon=True).start()

        def _serve(self) -> None:
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    conn.sendall(memoryview(self.buf))

        def port(self) -> int:
            return self.sock.getsockname()[1]

    @ray.remote(num_cpus=0)
    class Reader:
        def __init__(self, name: str, transport: str | None = None):
            from dataplane_client import connect

            self.client = connect(name, "dataplane", cross_node_transport=transport)
            self.raw: Any = None

        def path(self) -> list:
            return [(p.backend, p.detail) for p in self.client.service_info().payload_paths]

        def get_raw_tcp(self, port: int, nbytes: int) -> int:
            import socket

            import numpy as np

            if self.raw is None:  # one buffer, faulted in once (as the engine's reuse is not)
                self.raw = np.ones(nbytes, dtype=np.uint8)
            view, got = memoryview(self.raw), 0
            with socket.create_connection(("127.0.0.1", port)) as sock:
                while got < nbytes:
                    n = sock.recv_into(view[got:])
                    if n == 0:
                        raise ConnectionError(f"raw tcp: {got} of {nbytes} bytes")
                    got += n
            return int(self.raw[::4096].sum())

        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def put_ours(self, ids: list, batch: int) -> int:
            """A put of the whole workload to partition "pp" from node A (its tensors made
            once, not timed)."""
            if getattr(self, "fields", None) is None:
                self.fields, _ = make_workload("simple", batch, SEQ_LEN, FIELDS)
            self.client.put_samples(ids, "pp", self.fields)
            return len(ids)

        def get_ours(self, ids: list, names: list) -> int:
            return touch(self.client.get_samples(ids, "p", names))

        def get_ray(self, holder: Any) -> int:
            return touch(ray.get(holder.value.remote()))

        def get_ray_transfer(self, refs: list) -> int:
            return touch(ray.get(refs[0]))

        def profile_ours(self, ids: list, names: list) -> dict:
            t0 = time.perf_counter()
            out, top = cprofile_top(lambda: touch(self.client.get_samples(ids, "p", names)))
            return {"total_s": time.perf_counter() - t0, "top": top}

    batch = max(2, size // (SEQ_LEN * 4 * FIELDS))
    fields, nbytes = make_workload("simple", batch, SEQ_LEN, FIELDS)
    names = list(fields)
    ids = [f"k{i}" for i in range(batch)]
    c = handle.client()
    c.register_partition("p", names, None, [])
    c.put_samples(ids, "p", fields)
    del fields
    holder = Holder.options(scheduling_strategy=here).remote(batch)
    sender = Sender.options(scheduling_strategy=here).remote(nbytes)
    port = ray.get(sender.port.remote())
    reader = Reader.options(scheduling_strategy=on_a).remote("xn-bench")
    ray_path_reader = Reader.options(scheduling_strategy=on_a).remote("xn-bench", "ray")
    unit_node = ray.get(handle.units[0].ping.remote()).node_id
    assert ray.get(reader.node.remote()) != unit_node, "the reader must sit on another node"
    ((path, why),) = ray.get(reader.path.remote())

    def once(system: str) -> float:
        refs = ray.get(holder.put.remote()) if system == "ray_transfer" else None
        t0 = time.perf_counter()
        if system == "ours":
            ray.get(reader.get_ours.remote(ids, names))
        elif system == "ours_ray_path":
            ray.get(ray_path_reader.get_ours.remote(ids, names))
        elif system == "raw_tcp":
            ray.get(reader.get_raw_tcp.remote(port, nbytes))
        elif system == "ray":
            ray.get(reader.get_ray.remote(holder))
        else:
            ray.get(reader.get_ray_transfer.remote(refs))
        return time.perf_counter() - t0

    c.register_partition("pp", names, None, [])
    put_round = [0]

    def put_once(system: str) -> float:
        """One timed put of the workload from A (pushed by the engine, or through Ray's
        call arguments); cleared after, untimed, as a training step's data would be."""
        put_round[0] += 1
        pids = [f"{system}-{put_round[0]}-{i}" for i in range(batch)]
        who = reader if system == "put_ours" else ray_path_reader
        t0 = time.perf_counter()
        ray.get(who.put_ours.remote(pids, batch))
        took = time.perf_counter() - t0
        c.clear_samples(pids, "pp")
        return took

    for system in SYSTEMS:
        once(system)  # warm-up: actors, connections, object-store pages
    for system in PUT_SYSTEMS:
        put_once(system)
    seconds: dict[str, list[float]] = {s: [] for s in SYSTEMS + PUT_SYSTEMS}
    for _ in range(repeats):
        for system in SYSTEMS:
            seconds[system].append(once(system))
        for system in PUT_SYSTEMS:
            seconds[system].append(put_once(system))

    def unit_read_s() -> float:
        snap = ray.get(handle.units[0].metrics_snapshot.remote())
        return snap.stats.get("histograms", {}).get("get_latency_seconds", {}).get("sum", 0.0)

    before = unit_read_s()
    profile = ray.get(reader.profile_ours.remote(ids, names))
    profile["unit_read_s"] = unit_read_s() - before
    handle.shutdown()
    ray.shutdown()
    cluster.shutdown()
    from benchmarks.common import median

    return {
        "path": path,
        "why": why,
        "bytes": nbytes,
        "batch": batch,
        "fields": FIELDS,
        "seconds": seconds,
        "median_s": {s: median(v) for s, v in seconds.items()},
        "profile": profile,
    }


def main() -> None:
    p = argparse.ArgumentParser(description="the cross-node section's child process")
    p.add_argument("--size", type=int, default=SIZE)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    print("RESULT " + json.dumps(_child(a.size, a.repeats)), flush=True)


if __name__ == "__main__":
    main()
