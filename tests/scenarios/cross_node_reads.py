"""Cross-node reads (part of tests/scenarios/one_cluster.py).

Node B (the head) holds the service and writes; reader actors on node A get the same
rows through each cross-node backend (``dataplane_client/transport/payload``): the
default reader through Mooncake's transfer engine where it is installed (every field,
``transfer_min_bytes: 0``), one through Ray's object transfer (``cross_node_transport=
"ray"``), and one whose process cannot import Mooncake (the probe's fallback). The
default reader also races a clear and rewrite, and pulls through the failpoints that
spoil a pull (``payload-corrupt``) and refuse a registration on the unit
(``payload-register``); its pushed puts meet a spoiled check and an engine that fails
after the remote write (``payload-write-failed``); last, the unit's process is killed
mid-pull. tests/e2e/test_cross_node.py asserts on what it observed.
"""

import os

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dataplane_client import DataPlaneConfig
from dataplane_client.wire import failpoints
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


def big_rows(n: int, base: float) -> torch.Tensor:
    """``n`` rows of 1 MiB each, a function of ``base``: a put the engine pushes."""
    return torch.arange(n * (1 << 18), dtype=torch.float32).reshape(n, -1) + base


def plain(value) -> list:
    """A field of a get as plain lists (rows of a jagged tensor as lists)."""
    if isinstance(value, torch.Tensor):
        rows = value.unbind() if value.is_nested else value
        return [r.float().tolist() for r in rows]
    return value.tolist()


@ray.remote(num_cpus=0, max_concurrency=2)
class Reader:
    def __init__(self, name: str, transport: str | None = None, hide_mooncake: bool = False):
        import sys
        import threading

        from dataplane_client import connect

        if hide_mooncake:  # as a process without the package: its import fails
            sys.modules["mooncake"] = None  # type: ignore[assignment]
        self.client = connect(name, "dataplane", cross_node_transport=transport)
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

    def paths(self) -> list:
        """(backend, detail) per unit, as this process's probe chose them."""
        return [(p.backend, p.detail) for p in self.client.service_info().payload_paths]

    def counters(self) -> dict:
        import gc

        from dataplane_client.transport.payload import mooncake

        # A get that failed typed after its pull left its arrays in a reference cycle (its
        # error's traceback and the flow's frames): collected here, so the pooled buffer
        # they held is back before the count.
        gc.collect()
        return mooncake.counters()

    def put_or_error(self, ids: list, base: float) -> dict:
        """A put of ``big_rows`` to partition "w" (through the engine: more than 1 MiB), or
        the name and message of the typed error it raised."""
        from dataplane_client.wire.errors import DataPlaneError

        try:
            self.client.put_samples(ids, "w", {"big": big_rows(len(ids), base)})
        except DataPlaneError as e:
            return {"error": type(e).__name__, "message": str(e)}
        return {"error": None}

    def get_or_error(self, ids: list, names: list) -> dict:
        """A get's plain values, or the name and message of the typed error it raised."""
        from dataplane_client.wire.errors import DataPlaneError

        try:
            return {"ok": self.get(ids, names)}
        except DataPlaneError as e:
            return {"error": type(e).__name__, "message": str(e)}

    def get(self, ids: list, names: list) -> dict:
        got = self.client.get_samples(ids, "p", names)
        return {k: plain(got[k]) for k in names}

    def get_killing_the_unit(self, ids: list, unit_pid: int) -> dict:
        """A get of partition "w" pulled in 1 MiB slices, whose unit process is killed
        (SIGKILL) once the first slice has landed: the error it raised, where the kill
        fell, and this process's transfer-engine counters after."""
        import gc
        import signal

        from dataplane_client.transport.payload import mooncake
        from dataplane_client.wire.errors import DataPlaneError

        seen: list[int] = []

        def kill_unit(pulled: int) -> None:
            if not seen:
                os.kill(unit_pid, signal.SIGKILL)
            seen.append(pulled)

        mooncake.PULL_SLICE_BYTES = 1 << 20
        error = None
        try:
            with failpoints.run_at(failpoints.PAYLOAD_PULLED, kill_unit):
                self.client.get_samples(ids, "w", ["big"])
        except DataPlaneError as e:
            error = type(e).__name__
        except Exception as e:  # noqa: BLE001 - reported, and the test fails on it
            error = f"untyped {type(e).__name__}: {e}"
        finally:
            mooncake.PULL_SLICE_BYTES = 64 << 20
        gc.collect()  # the failed flow's frames, which held the pooled buffer's views
        return {"error": error, "killed_after": seen[:1], "counters": mooncake.counters()}

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
    # transfer_min_bytes 0: every field, however small, goes through the transfer engine;
    # transfer_puts: so do node A's puts of more than 1 MiB.
    handle = start(
        DataPlaneConfig(
            name="xn",
            num_storage_units=1,
            admin_enabled=False,
            transfer_min_bytes=0,
            transfer_puts=True,
        )
    )
    node_a = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    out: dict = {}
    on_a = NodeAffinitySchedulingStrategy(node_a.node_id, soft=False)
    reader = Reader.options(scheduling_strategy=on_a).remote("xn")
    # The same rows through Ray's object transfer, and from a process without Mooncake.
    ray_reader = Reader.options(scheduling_strategy=on_a).remote("xn", "ray")
    bare_reader = Reader.options(scheduling_strategy=on_a).remote("xn", None, True)
    unit_node = ray.get(handle.units[0].ping.remote()).node_id
    out["reader_elsewhere"] = ray.get(reader.node_id.remote()) != unit_node
    out["paths"] = {
        "default": ray.get(reader.paths.remote()),
        "ray": ray.get(ray_reader.paths.remote()),
        "bare": ray.get(bare_reader.paths.remote()),
    }

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
    # The unit's engine refuses to register the chunk the first remote read names: that
    # read fails typed on the unit, and the reader reads the rows through Ray instead.
    if os.environ.get(failpoints.ENV):
        failpoints.arm(failpoints.PAYLOAD_REGISTER, "1")
        answer = ray.get(reader.get_or_error.remote(ids[:4], ["dense"]))
        failpoints.disarm(failpoints.PAYLOAD_REGISTER)
        snap = ray.get(handle.units[0].metrics_snapshot.remote())
        out["register_refused"] = {
            "right_bytes": answer.get("ok") == expect([0, 1, 2, 3], ["dense"]),
            "error": answer.get("error"),
            "fired": failpoints.fired(failpoints.PAYLOAD_REGISTER),
            "unit_failures": snap.stats["counters"].get("payload_register_failures_total", 0),
            "reader": ray.get(reader.counters.remote()),
        }
    out["cases"], out["cases_ray"], out["cases_bare"] = {}, {}, {}
    for case, (picked, sel) in cases.items():
        want_here = expect(picked, sel)
        for key, who in (("cases", reader), ("cases_ray", ray_reader), ("cases_bare", bare_reader)):
            got = ray.get(who.get.remote([ids[i] for i in picked], sel))
            out[key][case] = got == want_here
    out["counters_after_cases"] = ray.get(reader.counters.remote())

    # A spoiled pull (the failpoint flips a byte after the transfer): pulled again, once;
    # spoiled twice in a row, the get raises CorruptPayload. Ray's reader never pulls.
    out["corrupt"] = {}
    if os.environ.get(failpoints.ENV):
        for spoil in (1, 2):
            failpoints.arm(failpoints.PAYLOAD_CORRUPT, str(spoil))
            answer = ray.get(reader.get_or_error.remote(ids[:4], ["dense"]))
            out["corrupt"][spoil] = {
                "right_bytes": answer.get("ok") == expect([0, 1, 2, 3], ["dense"]),
                "error": answer.get("error"),
                "message": answer.get("message", ""),
                "fired": failpoints.fired(failpoints.PAYLOAD_CORRUPT),
            }
            failpoints.disarm(failpoints.PAYLOAD_CORRUPT)
        out["counters_after_corrupt"] = ray.get(reader.counters.remote())

    # Puts from node A pushed through the engine: the bytes land intact; a spoiled check
    # is pushed again; spoiled twice, the put raises CorruptPayload and nothing is visible.
    from dataplane_client.wire.errors import DataPlaneError

    c.register_partition("w", ["big"], None, [])
    out["puts"] = {}
    # write_failed: the engine reports a failure after the bytes were written (a timeout
    # after the remote write): the put fails typed, and none of it becomes visible.
    spoiling = failpoints.PAYLOAD_CORRUPT
    for case, spoil, point in (
        ("clean", 0, spoiling),
        ("spoiled_once", 1, spoiling),
        ("spoiled_twice", 2, spoiling),
        ("write_failed", 1, failpoints.PAYLOAD_WRITE_FAILED),
    ):
        if spoil and not os.environ.get(failpoints.ENV):
            continue
        wids, base = [f"{case}-{i}" for i in range(4)], float(10 * spoil)
        if spoil:
            failpoints.arm(point, str(spoil))
        answer = ray.get(reader.put_or_error.remote(wids, base))
        fired = failpoints.fired(point) if spoil else 0
        if spoil:
            failpoints.disarm(point)
        try:
            # Read on the unit's node (shared memory): the tensor holds a read lease while it
            # lives, so it is compared at once and dropped (the leak check below counts them).
            read_back: object = bool(
                torch.equal(c.get_samples(wids, "w", ["big"])["big"], big_rows(4, base))
            )
        except DataPlaneError as e:
            read_back = type(e).__name__
        out["puts"][case] = {"error": answer["error"], "read_back": read_back, "fired": fired}
    out["counters_after_puts"] = ray.get(reader.counters.remote())

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
    out["counters_after_race"] = ray.get(reader.counters.remote())

    # Nothing leaks: every destination buffer was unregistered (above), every remote read
    # lease came back, and the unit keeps registered only chunks it still holds.
    from polling import wait_until  # the driver's (tests/ is on its path, not the workers')

    def released() -> bool:
        h = ray.get(handle.units[0].holdings.remote())
        out["unit_holdings"] = {"read_leases": h.read_leases, "orphans": h.payload_orphans}
        return h.read_leases == 0 and h.payload_orphans == 0

    # The unit's sweeper prunes registrations of chunks closed since the last read.
    wait_until(released, timeout_s=30, what="the remote leases back and no orphan chunk")
    out["unit_registered_chunks"] = ray.get(handle.units[0].holdings.remote()).payload_registered

    # Last (it kills the unit): the unit's process dies mid-pull of a get from node A.
    if os.environ.get(failpoints.ENV) and out["paths"]["default"][0][0] == "mooncake-tcp":
        pid = ray.get(handle.units[0].ping.remote()).pid
        out["unit_killed"] = ray.get(
            reader.get_killing_the_unit.remote([f"clean-{i}" for i in range(4)], pid)
        )
    for r in (reader, ray_reader, bare_reader):
        ray.kill(r)
    handle.shutdown()
    return out
