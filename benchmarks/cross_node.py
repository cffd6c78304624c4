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
    the physical limit of a byte stream between two processes here;
  - **engine**: Mooncake's engine alone: one ``transfer_sync_read`` of the same bytes,
    registered by an actor on B, into a registered buffer of the reader's (no CRC, no
    unit call): what Mooncake's TCP transport itself reaches here, the ceiling of ours.

At 128 MiB and 1 GiB (each in a cluster of its own), then ``READERS`` reader actors on
A get the same 128 MiB at once, through Mooncake and through Ray's path, and the same
readers each read the bytes from its own socket to the sender (served a thread per
connection) and pull them with Mooncake's engine alone from one sending engine: their aggregate GiB/s against one reader's says whether many readers scale
or serialise on the unit (a unit answers ``read_remote`` and each reader pulls with its
own engine), judged against how far plain sockets scale on this machine (target: ours'
scaling >= 0.8x raw TCP's).

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
from dataplane_client.transport.payload.base import MOONCAKE

TARGET_X_RAY = 2.0
TARGET_X_RAW_TCP = 0.8  # Mooncake TCP against a plain socket copy
TARGET_X_RAY_PATH = 2.0  # Mooncake TCP against our own get through Ray's path
# Many readers at once: ours' aggregate over one reader's, against the same for plain
# sockets (what this machine allows streams at once; 2 cores cannot scale 8 of them).
TARGET_SCALING = 0.8
SIZE = 128 * MiB
SIZES = (SIZE, GiB)
QUICK_SIZE = 4 * MiB
READERS = 8  # concurrent readers on A, at the first size
SEQ_LEN = 8192
FIELDS = 4
SYSTEMS = ("ours", "ours_ray_path", "ray", "ray_transfer", "raw_tcp", "engine")
# Puts from A to the unit on B: pushed by the engine (transfer_puts), or through Ray's path.
PUT_SYSTEMS = ("put_ours", "put_ray_path")


def run(opts: Options) -> Section:
    """The harness's entry: one child (its own two-node cluster) per size, then judge."""
    sizes = [QUICK_SIZE] if opts.quick else list(SIZES)
    repeats = max(1, opts.repeats)
    results = []
    for i, size in enumerate(sizes):
        readers = 2 if opts.quick else READERS
        opts.log(f"crossnode: two-node cluster, {human_size(size)}, {repeats} repeats")
        results.append(_run_child(size, repeats, readers if i == 0 else 0))
    return _report(results, repeats, opts)


def _run_child(size: int, repeats: int, readers: int) -> dict[str, Any]:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)  # the child makes its own cluster
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cross_node", "--size", str(size)]
        + ["--repeats", str(repeats), "--readers", str(readers)],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"cross-node child failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _gibps(res: dict[str, Any], system: str) -> float:
    return res["bytes"] / GiB / res["median_s"][system]


def _report(results: list[dict[str, Any]], repeats: int, opts: Options) -> Section:
    section = Section("crossnode")
    path = results[0]["path"]
    get_rows, put_rows = [], []
    for res in results:
        g = {s: _gibps(res, s) for s in SYSTEMS}
        get_rows.append(
            [
                human_size(res["bytes"]),
                *(g[s] for s in SYSTEMS),
                ratio(g["ours"], g["raw_tcp"]),
                ratio(g["ours"], g["ours_ray_path"]),
                ratio(g["ours"], g["ray"]),
                ratio(g["ours"], g["engine"]),
            ]
        )
        put = {s: _gibps(res, s) for s in PUT_SYSTEMS}
        put_rows.append(
            [
                human_size(res["bytes"]),
                put["put_ours"],
                put["put_ray_path"],
                g["raw_tcp"],
                ratio(put["put_ours"], put["put_ray_path"]),
                ratio(put["put_ours"], g["raw_tcp"]),
            ]
        )
        _judge(section, res, g, path)
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
                "engine alone",
                "ours/raw tcp",
                "ours/ours (ray path)",
                "ours/ray",
                "ours/engine",
            ],
            get_rows,
        )
    )
    section.tables.append(
        Table(
            f"cross-node put, GiB/s (median of {repeats}; writer on A, unit on B; cleared "
            "after each, untimed)",
            [
                "size",
                "ours (pushed, transfer_puts)",
                "ours (ray path)",
                "raw tcp",
                "pushed/ray path",
                "pushed/raw tcp",
            ],
            put_rows,
        )
    )
    many = results[0].get("many")
    if many:
        section.tables.append(
            Table(
                f"{many['readers']} readers on A get the same {human_size(results[0]['bytes'])} "
                f"at once (median of {repeats}): aggregate GiB/s, and against one reader",
                ["path", "one reader", f"{many['readers']} readers", "scaling"],
                [
                    [
                        name,
                        _gibps(results[0], system),
                        many[system],
                        ratio(many[system], _gibps(results[0], system)),
                    ]
                    for name, system in (
                        ("ours", "ours"),
                        ("ours (ray path)", "ours_ray_path"),
                        ("raw tcp (a socket each)", "raw_tcp"),
                        ("engine alone (one sending engine)", "engine"),
                    )
                    if system in many
                ],
            )
        )
        if path in MOONCAKE and "raw_tcp" in many:
            # What this machine allows many streams at once (2 cores here cannot scale 8
            # readers): ours scales as well as plain sockets do, or serialises somewhere.
            ours = ratio(many["ours"], _gibps(results[0], "ours")) or float("nan")
            raw = ratio(many["raw_tcp"], _gibps(results[0], "raw_tcp")) or float("nan")
            section.targets.append(
                Target(
                    f"{many['readers']} readers at once: ours' scaling against raw TCP's "
                    "(a socket each)",
                    ratio(ours, raw),
                    TARGET_SCALING,
                    True,
                    "x",
                    detail=f"ours {ours:.2f}x one reader, raw tcp {raw:.2f}x one stream",
                )
            )
    if path not in MOONCAKE:
        section.notes.append(
            f"ours went through {path}: Mooncake did not load ({results[0]['why']})"
        )
    p = results[0]["profile"]
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
    section.data = {"sizes": results}
    return section


def _judge(section: Section, res: dict[str, Any], g: dict[str, float], path: str) -> None:
    """The issue's targets at one size."""
    size = human_size(res["bytes"])
    targets = [
        (f"cross-node get >= {TARGET_X_RAY:g}x the Ray object store ({size})", "ray", TARGET_X_RAY)
    ]
    if path in MOONCAKE:
        targets += [
            (
                f"Mooncake TCP get >= {TARGET_X_RAW_TCP:g}x raw loopback TCP ({size})",
                "raw_tcp",
                TARGET_X_RAW_TCP,
            ),
            (
                f"Mooncake TCP get >= {TARGET_X_RAY_PATH:g}x our get through Ray's path ({size})",
                "ours_ray_path",
                TARGET_X_RAY_PATH,
            ),
        ]
    for name, against, threshold in targets:
        section.targets.append(
            Target(
                name,
                ratio(g["ours"], g[against]),
                threshold,
                True,
                "x",
                detail=f"ours {g['ours']:.2f} vs {against} {g[against]:.2f} GiB/s",
            )
        )


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


def _child(size: int, repeats: int, readers: int) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from benchmarks.common import cprofile_top
    from benchmarks.store_throughput import make_workload, touch
    from dataplane_client import DataPlaneConfig
    from dataplane_server import start

    store = max(3, readers + 2) * size + GiB // 2  # every reader's copy at once, plus room
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
        """Serves ``nbytes`` on a plain TCP socket, one buffer per connection, each in a
        thread of its own (many readers at once: the machine's own limit, not one
        sender's)."""

        def __init__(self, nbytes: int):
            import socket
            import threading

            import numpy as np

            self.buf = np.ones(nbytes, dtype=np.uint8)
            self.sock = socket.create_server(("127.0.0.1", 0))
            threading.Thread(target=self._serve, daemon=True).start()

        def _serve(self) -> None:
            import threading

            while True:
                conn, _ = self.sock.accept()
                threading.Thread(target=self._send, args=(conn,), daemon=True).start()

        def _send(self, conn) -> None:
            with conn:
                conn.sendall(memoryview(self.buf))

        def port(self) -> int:
            return self.sock.getsockname()[1]

    @ray.remote(num_cpus=0)
    class EngineSender:
        """``nbytes`` registered with a Mooncake engine of its own (where it loads)."""

        def __init__(self, nbytes: int):
            import numpy as np

            from dataplane_client.transport.payload import mooncake

            self.buf = np.ones(nbytes, dtype=np.uint8)
            try:
                eng = mooncake.engine(ray.util.get_node_ip_address())
            except RuntimeError:
                self.where = None
                return
            mooncake.register(eng, self.buf.ctypes.data, nbytes, "the bench's bytes")
            self.where = (eng.get_rpc_port(), self.buf.ctypes.data)

        def where_(self) -> tuple | None:
            return self.where

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

        def get_engine(self, where: tuple, nbytes: int) -> int:
            """One pull of the sender's bytes by Mooncake's engine alone."""
            import numpy as np

            from dataplane_client.transport.payload import mooncake

            ip = ray.util.get_node_ip_address()
            eng = mooncake.engine(ip)
            if getattr(self, "pulled", None) is None:  # registered once, like the pool's
                self.pulled = np.ones(nbytes, dtype=np.uint8)
                mooncake.register(eng, self.pulled.ctypes.data, nbytes, "the bench's buffer")
            port, addr = where
            rc = eng.transfer_sync_read(f"{ip}:{port}", self.pulled.ctypes.data, addr, nbytes)
            assert rc == 0, rc
            return int(self.pulled[::4096].sum())

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
    engine_sender = EngineSender.options(scheduling_strategy=here).remote(nbytes)
    engine_at = ray.get(engine_sender.where_.remote())
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
        elif system == "engine":
            if engine_at is None:  # Mooncake did not load: no such row
                return float("nan")
            ray.get(reader.get_engine.remote(engine_at, nbytes))
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

    many: dict[str, Any] = {}
    if readers:  # many readers at once: aggregate GiB/s, through each path
        crowd = {
            "ours": [
                Reader.options(scheduling_strategy=on_a).remote("xn-bench") for _ in range(readers)
            ],
            "ours_ray_path": [
                Reader.options(scheduling_strategy=on_a).remote("xn-bench", "ray")
                for _ in range(readers)
            ],
        }
        for members in crowd.values():  # warm-up: connected, probed, buffers pooled
            ray.get([r.get_ours.remote(ids, names) for r in members])

        def at_once(system: str) -> list:
            """Every reader of the crowd starts its get (raw tcp: each its own socket to
            the sender, which serves each connection in a thread of its own)."""
            if system == "raw_tcp":
                return [r.get_raw_tcp.remote(port, nbytes) for r in crowd["ours"]]
            if system == "engine":  # Mooncake alone: every reader pulls from one engine
                return [r.get_engine.remote(engine_at, nbytes) for r in crowd["ours"]]
            return [r.get_ours.remote(ids, names) for r in crowd[system]]

        alone = ("engine",) if engine_at is not None else ()
        took: dict[str, list[float]] = {k: [] for k in (*crowd, "raw_tcp", *alone)}
        for _ in range(repeats):
            for system in took:
                t0 = time.perf_counter()
                ray.get(at_once(system))
                took[system].append(time.perf_counter() - t0)
        from benchmarks.common import median as _median

        many = {"readers": readers, "seconds": took}
        many.update({k: readers * nbytes / GiB / _median(v) for k, v in took.items()})
        for members in crowd.values():
            for r in members:
                ray.kill(r)

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
        "many": many,
    }


def main() -> None:
    p = argparse.ArgumentParser(description="the cross-node section's child process")
    p.add_argument("--size", type=int, default=SIZE)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--readers", type=int, default=0, help="also this many readers at once")
    a = p.parse_args()
    print("RESULT " + json.dumps(_child(a.size, a.repeats, a.readers)), flush=True)


if __name__ == "__main__":
    main()
