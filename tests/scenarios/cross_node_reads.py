"""Cross-node reads (part of tests/scenarios/one_cluster.py).

Node B (the head) holds the service and writes; a reader actor on node A gets
through the units' ``read`` and the Ray object store. tests/e2e/test_cross_node.py
asserts on what it observed.
"""

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dataplane_client import DataPlaneConfig
from dataplane_server import start

N = 24
ROUNDS = 40


def fields(version: int) -> dict:
    """Every kind of field; each row's values say which version and row they are."""
    v = float(version)
    return {
        "dense": torch.arange(N * 6, dtype=torch.float32).reshape(N, 6) + 1000 * v,
        "half": (torch.arange(N * 2).reshape(N, 2) + version).to(torch.bfloat16),
        "jag": [torch.full((i % 5 + 1,), version * 100 + i, dtype=torch.int64) for i in range(N)],
        "text": [None if i % 7 == 3 else f"v{version} row {i} ü" + "x" * i for i in range(N)],
    }


def plain(value) -> list:
    """A field of a get as plain lists (rows of a jagged tensor as lists)."""
    if isinstance(value, torch.Tensor):
        rows = value.unbind() if value.is_nested else value
        return [r.float().tolist() for r in rows]
    return value.tolist()


@ray.remote(num_cpus=0, max_concurrency=2)
class Reader:
    def __init__(self, name: str):
        import threading

        from dataplane_client import connect

        self.client = connect(name, "dataplane")
        self.node = ray.get_runtime_context().get_node_id()
        self.attempts = 0  # gets the race has finished, for the writer to pace itself on
        self.progress = threading.Condition()

    def wait_attempts(self, n: int) -> int:
        """Block until the race has finished ``n`` gets (or ended); returns how many."""
        with self.progress:
            self.progress.wait_for(lambda: self.attempts >= n, timeout=120)
            return self.attempts

    def node_id(self) -> str:
        return self.node

    def get(self, ids: list, names: list) -> dict:
        got = self.client.get_samples(ids, "p", names)
        return {k: plain(got[k]) for k in names}

    def race(self, ids: list) -> dict:
        """Gets while the driver clears and rewrites: each row must be one whole version."""
        from dataplane_client.wire.errors import DataPlaneError

        outcomes = {"ok": 0, "typed_error": 0, "torn": 0, "other_error": [], "errors": {}}
        for _ in range(ROUNDS):
            with self.progress:
                self.attempts += 1
                self.progress.notify_all()
            try:
                got = self.client.get_samples(ids, "p", ["dense", "jag", "text"])
                text = got["text"].tolist()
            except DataPlaneError as e:
                outcomes["typed_error"] += 1
                kind = type(e).__name__
                outcomes["errors"][kind] = outcomes["errors"].get(kind, 0) + 1
                continue
            except Exception as e:  # noqa: BLE001 - reported, and the test fails on it
                outcomes["other_error"].append(f"{type(e).__name__}: {e}")
                continue
            whole = True
            for j, sid in enumerate(ids):
                i = int(sid[1:])
                version = round((float(got["dense"][j][0]) - 6 * i) / 1000)
                want = fields(version)
                whole &= torch.equal(got["dense"][j], want["dense"][i])
                whole &= torch.equal(got["jag"][j], want["jag"][i])
                whole &= text[j] == want["text"][i]
            outcomes["ok" if whole else "torn"] += 1
        return outcomes


def run(cluster) -> dict:
    """On a cluster of the head alone; adds node A (which stays) and returns what it saw."""
    # The service starts while B (the head) is the only node: its units live there.
    handle = start(DataPlaneConfig(name="xn", num_storage_units=1, admin_enabled=False))
    node_a = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    out: dict = {}
    reader = Reader.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_a.node_id, soft=False)
    ).remote("xn")
    unit_node = ray.get(handle.units[0].ping.remote()).node_id
    out["reader_elsewhere"] = ray.get(reader.node_id.remote()) != unit_node

    c = handle.client()
    names = ["dense", "half", "jag", "text"]
    c.register_partition("p", names, None, [], object_fields=["text"])
    ids = [f"s{i}" for i in range(N)]
    c.put_samples(ids, "p", fields(0))
    want = {k: plain(v) if not isinstance(v, list) else v for k, v in fields(0).items()}
    want["jag"] = [r.float().tolist() for r in fields(0)["jag"]]
    want["dense"], want["half"] = plain(fields(0)["dense"]), plain(fields(0)["half"])

    def expect(picked: list[int], sel: list[str]) -> dict:
        return {k: [want[k][i] for i in picked] for k in sel}

    cases = {
        "all_in_order": (list(range(N)), names),  # one run per field: views, no gather
        "contiguous_slice": (list(range(5, 17)), ["jag", "text"]),
        "shuffled_subset": ([17, 2, 9, 0, 23, 11], ["dense", "text", "half"]),
        "reversed": (list(range(N))[::-1], ["jag", "dense"]),
    }
    out["cases"] = {}
    for case, (picked, sel) in cases.items():
        got = ray.get(reader.get.remote([ids[i] for i in picked], sel))
        out["cases"][case] = got == expect(picked, sel)

    # A get racing a clear and a rewrite on the remote unit.
    racing = [ids[i] for i in np.random.default_rng(0).permutation(N)[:16].tolist()]
    pending = reader.race.remote(racing)
    version, attempts = 0, 0
    while attempts < ROUNDS:
        version += 1
        c.clear_samples(None, "p")
        c.register_partition("p", names, None, [], object_fields=["text"])
        c.put_samples(ids, "p", fields(version))
        # Paced on the reader (no sleeps): each version is read at least once before the
        # next clear, which races the reader's following get.
        attempts = ray.get(reader.wait_attempts.remote(attempts + 1))
    out["race"] = ray.get(pending)
    out["race_rewrites"] = version
    ray.kill(reader)
    handle.shutdown()
    return out
