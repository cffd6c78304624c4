"""Soak: 16 rollout writers and 4 consumers over five steps, one controller kill mid-run.

Each step is a partition of known size with two consumer tasks: ``train`` (the NeMo-RL
cursor, at most once) and ``ref`` (leased, at least once; one consumer now and then
"forgets" to ack a claim so its samples come back after the lease). The writers and
consumers are Ray actors that attach with ``dataplane_client.connect``; the driver
registers, waits, checks and clears. In the middle step the controller is killed (Ray
restarts it; it rebuilds from the units and its journal) while puts and claims are in
flight.

What must hold at the end: every committed sample reached ``train`` exactly once and
``ref`` at least once, with no extra ``ref`` deliveries beyond the redeliveries the
controller reports; every byte read has the checksum of the bytes written; every error
any actor saw is a typed data-plane error; the units' memory and descriptors are back
to their baseline after the final clear. p50/p99 of each verb are printed and written
to ``soak_latency.json`` under pytest's tmp_path.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter

import pytest
import ray
from polling import wait_until
from unit_memory import data_fds, memfd_bytes, memfds, unit_memory, unit_pid

from dataplane_client.wire.config import DataPlaneConfig
from dataplane_server import start

# Five steps cross every boundary the soak has, each at least once on both sides of the
# kill: even steps (cleared by explicit ids, the partition kept) and odd ones (a "ref"
# consumer leaves a claim un-acked; the whole partition cleared), before the kill
# (0, 1), the kill itself (2), and after it (3, 4). Sixteen steps repeated those (113 s
# of CI; five take about half).
STEPS = 5
WRITERS = 16
CONSUMERS = 4  # two on "train", two on "ref"
PUTS_PER_STEP = 2  # per writer
ROWS_PER_PUT = 4
PER_STEP = WRITERS * PUTS_PER_STEP * ROWS_PER_PUT
KILL_AT_STEP = STEPS // 2
LEASE_S = 2.0
BATCH = 8
FIELDS = ["tokens", "score"]
WARM_RESERVE = 16 << 20
# After the final clear a unit may hold its warm reserve (reported by the unit, at most
# WARM_RESERVE) plus this much of its own heap (allocator pools, Ray's buffers).
MEMORY_TOLERANCE = 48 << 20
# Files and memfds only (Ray's sockets to the 20 killed actors close on Ray's schedule,
# which is not ours to measure); a couple of log files may be opened meanwhile.
FD_TOLERANCE = 2


def _actor_classes():
    """Defined inside a function so Ray ships them by value (the test module is not
    importable on the workers); everything they use is imported inside."""

    def sample(sample_id: str):
        """A sample's fields are a pure function of its id (so a mix-up is visible)."""
        import zlib

        import torch

        seed = zlib.crc32(sample_id.encode())
        g = torch.Generator().manual_seed(seed)
        n = 16 + seed % 240
        return torch.randint(0, 50_000, (n,), generator=g, dtype=torch.int64), torch.randn(
            2, generator=g
        )

    def checksum(tokens, score) -> int:
        import zlib

        return zlib.crc32(score.numpy().tobytes(), zlib.crc32(tokens.numpy().tobytes()))

    def record(errors: list, e: BaseException, verb: str) -> None:
        from dataplane_client.wire.errors import DataPlaneError

        errors.append((verb, type(e).__name__, isinstance(e, DataPlaneError), str(e)[:300]))

    @ray.remote(num_cpus=0)
    class Writer:
        def __init__(self, name: str, namespace: str, index: int):
            from dataplane_client.client import connect

            self.c = connect(name, namespace)
            self.index = index
            self.put_s: list[float] = []
            self.errors: list = []
            self.written = 0

        def progress(self) -> int:
            return self.written

        def write_step(self, pid: str, step: int) -> dict:
            import torch

            from dataplane_client.wire.errors import DataPlaneError, FieldAlreadyProduced

            sums: dict[str, int] = {}
            for p in range(PUTS_PER_STEP):
                ids = [f"{step}-w{self.index}-{p}-{i}" for i in range(ROWS_PER_PUT)]
                rows = [sample(s) for s in ids]
                fields = {
                    "tokens": [t for t, _ in rows],
                    "score": torch.stack([s for _, s in rows]),
                }
                for _attempt in range(5):
                    t0 = time.perf_counter()
                    try:
                        self.c.put_samples(ids, pid, fields)
                    except FieldAlreadyProduced as e:  # a retry of a put that did commit
                        record(self.errors, e, "put")
                        break
                    except DataPlaneError as e:
                        record(self.errors, e, "put")
                        continue
                    except Exception as e:  # noqa: BLE001 - exactly what the soak looks for
                        record(self.errors, e, "put")
                        break
                    self.put_s.append(time.perf_counter() - t0)
                    break
                else:
                    continue  # never committed: not counted as written
                sums.update({s: checksum(t, sc) for s, (t, sc) in zip(ids, rows)})
                self.written += len(ids)
            return sums

        def report(self) -> dict:
            return {"put": self.put_s, "errors": self.errors}

    @ray.remote(num_cpus=0)
    class Consumer:
        def __init__(self, name: str, namespace: str, task: str, drop_every_other_step: bool):
            from dataplane_client.client import connect

            self.c = connect(name, namespace)
            self.task = task
            self.drop = drop_every_other_step
            self.lat: dict[str, list[float]] = {"claim": [], "get": [], "ack": []}
            self.errors: list = []

        def consume_step(self, pid: str, step: int, budget_s: float) -> dict:
            from dataplane_client.wire.errors import ClaimTimeout, DataPlaneError

            seen: list[tuple[str, int]] = []
            dropped = 0
            deadline = time.monotonic() + budget_s
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                try:
                    meta = self.c.claim_meta(pid, self.task, FIELDS, BATCH, timeout_s=1.0)
                except ClaimTimeout:
                    try:
                        if self.c.check_consumption_status(pid, [self.task]):
                            break
                    except DataPlaneError as e:
                        record(self.errors, e, "status")
                    continue
                except Exception as e:  # noqa: BLE001 - typed or not, the soak counts it
                    record(self.errors, e, "claim")
                    continue
                self.lat["claim"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                try:
                    td = self.c.get_data(meta)
                except Exception as e:  # noqa: BLE001 - typed or not, the soak counts it
                    record(self.errors, e, "get")
                    continue  # a leased claim comes back after its lease; a cursor one is lost
                self.lat["get"].append(time.perf_counter() - t0)
                tokens = td["tokens"].unbind()
                for i, s in enumerate(meta.sample_ids):
                    seen.append((s, checksum(tokens[i], td["score"][i])))
                if "lease_id" not in meta.extra_info:
                    continue
                if self.drop and step % 2 == 1 and dropped == 0:
                    dropped = meta.size  # never acked: handed out again after LEASE_S
                    continue
                t0 = time.perf_counter()
                try:
                    self.c.ack(meta)
                except Exception as e:  # noqa: BLE001 - typed or not, the soak counts it
                    record(self.errors, e, "ack")
                    continue
                self.lat["ack"].append(time.perf_counter() - t0)
            return {"seen": seen, "dropped": dropped}

        def report(self) -> dict:
            return {**self.lat, "errors": self.errors}

    return Writer, Consumer


def _percentiles(samples: list[float]) -> dict:
    xs = sorted(samples)
    if not xs:
        return {"n": 0}

    def pick(q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3

    return {"n": len(xs), "p50_ms": round(pick(0.50), 3), "p99_ms": round(pick(0.99), 3)}


def _unit_figures(handle, pids: list[int]) -> list[dict]:
    out = []
    for i, pid in enumerate(pids):
        snap = ray.get(handle.units[i].metrics_snapshot.remote())
        out.append(
            {
                "memory": unit_memory(pid),
                "fds": data_fds(pid),
                "memfds": memfds(pid),
                "memfd_bytes": memfd_bytes(pid),
                "bytes": snap.bytes,
                "reserve": snap.warm_reserve_bytes,
            }
        )
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soak_16_writers_4_consumers_survives_a_controller_kill(ray_session, tmp_path):
    name = f"soak-{uuid.uuid4().hex[:6]}"
    handle = start(
        DataPlaneConfig(
            name=name,
            num_storage_units=2,
            admin_enabled=False,
            metrics_enabled=False,
            unit_warm_reserve_bytes=WARM_RESERVE,
            liveness_interval_s=0.5,
            controller_retry_budget_s=60.0,
        )
    )
    writers, consumers = [], []
    try:
        c = handle.client()
        pids = [unit_pid(handle, i) for i in range(len(handle.units))]
        baseline = _unit_figures(handle, pids)
        Writer, Consumer = _actor_classes()
        ns = handle.config.namespace
        writers = [Writer.remote(name, ns, i) for i in range(WRITERS)]
        consumers = [
            Consumer.remote(name, ns, "train", False),
            Consumer.remote(name, ns, "train", False),
            Consumer.remote(name, ns, "ref", True),
            Consumer.remote(name, ns, "ref", False),
        ]
        t_up = time.monotonic()
        ray.get([a.report.remote() for a in writers + consumers], timeout=300)  # all up
        print(f"\n{WRITERS + CONSUMERS} actors up in {time.monotonic() - t_up:.1f}s", flush=True)

        clear_s: list[float] = []
        driver_errors: list = []
        written_total = delivered = redeliveries_total = dropped_total = 0
        partitions = []
        started = time.monotonic()
        for step in range(STEPS):
            pid = f"step-{step}"
            partitions.append(pid)
            c.register_partition(
                pid, FIELDS, PER_STEP, ["train", "ref"], task_leases={"ref": LEASE_S}
            )
            runs = [consumer.consume_step.remote(pid, step, 240.0) for consumer in consumers]
            puts = [w.write_step.remote(pid, step) for w in writers]
            if step == KILL_AT_STEP:
                wait_until(
                    lambda pid=pid: c.describe_partition(pid).num_samples >= PER_STEP // 3,
                    120,
                    "the step's writes to be under way",
                )
                ray.kill(handle.controller, no_restart=False)
            written: dict[str, int] = {}
            for sums in ray.get(puts, timeout=300):
                assert not set(sums) & set(written)
                written.update(sums)
            results = ray.get(runs, timeout=300)
            assert len(written) == PER_STEP, f"step {step}: {len(written)} puts committed"
            written_total += len(written)

            # Every committed sample reached each task, bit for bit.
            by_task = {"train": results[0:2], "ref": results[2:4]}
            counts = {}
            for task, parts in by_task.items():
                seen = [x for r in parts for x in r["seen"]]
                delivered += len(seen)
                assert {s for s, _ in seen} == set(written), f"step {step}: {task} lost samples"
                bad = [s for s, crc in seen if crc != written[s]]
                assert bad == [], f"step {step}: {task} read bytes that differ from the written"
                counts[task] = Counter(s for s, _ in seen)
            detail = {t.task: t for t in c.consumption_detail(pid, ["train", "ref"])}
            assert all(t.done for t in detail.values()), detail
            # The cursor task: exactly once. The leased task: extra deliveries only as
            # redeliveries the controller counted (after a lease ran out).
            assert max(counts["train"].values()) == 1
            extra_ref = sum(n - 1 for n in counts["ref"].values())
            assert extra_ref <= detail["ref"].redeliveries, (step, extra_ref, detail["ref"])
            assert detail["train"].redeliveries == 0
            dropped = sum(r["dropped"] for r in by_task["ref"])
            assert detail["ref"].redeliveries >= dropped  # each dropped claim came back
            redeliveries_total += detail["ref"].redeliveries
            dropped_total += dropped

            t0 = time.perf_counter()
            if step % 2:
                c.clear_samples(None, pid)  # the whole partition
            else:
                c.clear_samples(sorted(written), pid)  # explicit ids; the partition stays
            clear_s.append(time.perf_counter() - t0)
            print(f"step {step} done at {time.monotonic() - started:.1f}s", flush=True)
        for pid in partitions[0::2]:  # the emptied ones
            t0 = time.perf_counter()
            c.clear_samples(None, pid)
            clear_s.append(time.perf_counter() - t0)
        elapsed = time.monotonic() - started

        snap = ray.get(handle.controller.metrics_snapshot.remote())
        assert snap.stats["counters"].get("controller_restarts_total", 0) >= 1

        reports = ray.get([a.report.remote() for a in writers + consumers], timeout=60)
        errors = [e for r in reports for e in r["errors"]] + driver_errors
        untyped = [e for e in errors if not e[2]]
        assert untyped == [], untyped
        lat = {"put": [], "claim": [], "get": [], "ack": [], "clear": clear_s}
        for r in reports:
            for verb in ("put", "claim", "get", "ack"):
                lat[verb].extend(r.get(verb, []))

        # The writers and consumers are done: their processes (and the connections each
        # held to every unit) go away before the units are compared with their baseline.
        for a in writers + consumers:
            ray.kill(a)
        writers, consumers = [], []

        # The units are back to baseline: no bytes held, memory and descriptors as before
        # (beyond the warm reserve the unit reports and a small heap tolerance).
        def settled(n: dict, b: dict) -> bool:
            return (
                n["bytes"] == 0
                and n["memfd_bytes"] <= n["reserve"]
                and n["memory"] - b["memory"] <= n["reserve"] + MEMORY_TOLERANCE
                and n["fds"] - b["fds"] <= n["memfds"] + FD_TOLERANCE
            )

        deadline = time.monotonic() + 30
        while True:  # polling the units' observable figures, with a deadline
            final = _unit_figures(handle, pids)
            if all(settled(n, b) for n, b in zip(final, baseline)):
                break
            assert time.monotonic() < deadline, f"units not back to baseline: {baseline} {final}"
            time.sleep(0.2)
        assert c.service_info().num_samples == 0

        figures = {
            "steps": STEPS,
            "writers": WRITERS,
            "consumers": CONSUMERS,
            "samples_committed": written_total,
            "deliveries": delivered,
            "lost": 0,
            "duplicated_beyond_redeliveries": 0,
            "redeliveries": redeliveries_total,
            "dropped_acks_samples": dropped_total,
            "controller_kills": 1,
            "typed_errors": Counter(e[1] for e in errors),
            "untyped_errors": 0,
            "elapsed_s": round(elapsed, 1),
            "latency": {verb: _percentiles(xs) for verb, xs in lat.items()},
            "units_baseline": baseline,
            "units_after_final_clear": final,
        }
        out = tmp_path / "soak_latency.json"
        out.write_text(json.dumps(figures, indent=2, default=str))
        print(f"\nsoak: {json.dumps({k: v for k, v in figures.items() if 'units' not in k})}")
        for verb, p in figures["latency"].items():
            print(f"  {verb:5s} n={p['n']:5d} p50={p.get('p50_ms')} ms p99={p.get('p99_ms')} ms")
        for i, (b, f) in enumerate(zip(baseline, final)):
            print(
                f"  unit {i}: memory {b['memory'] / 2**20:.1f} -> {f['memory'] / 2**20:.1f} MiB "
                f"(reserve {f['reserve'] / 2**20:.1f} MiB), fds {b['fds']} -> {f['fds']} "
                f"({f['memfds']} memfds)"
            )
        print(f"soak figures written to {out}")
        for verb in ("put", "claim", "get", "ack", "clear"):
            assert figures["latency"][verb]["n"] > 0, verb
    finally:
        for a in writers + consumers:
            ray.kill(a)
        handle.shutdown()
