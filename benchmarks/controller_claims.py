"""Controller: claim latency under 64 concurrent claimers, small-put throughput, wake-up latency.

- claims: 64 claimers (4 async actors x 16 tasks, started together) each make
  back-to-back blocking ``claim_meta_async`` calls of 4 samples from one
  partition that holds enough ready samples for all of them; every call is
  timed inside its claimer. Also one claimer alone, and a no-op actor call to
  the controller under the same concurrency (Ray's own round trip).
- commits: 4 concurrent writers (2 actors x 2 tasks) make small puts (1 and 64
  samples of one ``int64[8]`` field); samples/s and puts/s over the whole run.
- wake-up: a claimer blocks on an empty partition; the driver waits until the
  controller reports it waiting, then puts the samples that satisfy it. Wake-up
  latency = claim returned - put returned (both CLOCK_MONOTONIC, same machine).
- commit cost: inside the controller, the Python work of one commit of N new
  samples (check, the units' sample metadata, apply; no unit call) at N = 64 and
  8,192; the cost per extra sample is the slope between the two.

Targets: claim p99 with 64 in flight <= 2x the p99 of a no-op controller call
at the same concurrency (same run); commit cost per extra sample <= 0.3 us.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray
import torch

from benchmarks.common import Options, Section, Table, Target, median, percentile, start_service

SERVICE_NAME = "bench-ctl"
NAMESPACE = "bench"
CLAIMERS = 64  # concurrent claimers: CLAIMER_ACTORS async actors x (CLAIMERS / actors) tasks
CLAIMER_ACTORS = 4
QUICK_CLAIMER_ACTORS = 2  # --quick: fewer processes to start, same 64 claimers
CLAIM_BATCH = 4
CLAIM_P99_OVER_NOOP = 2.0  # target: claim p99 <= this x the no-op call's p99
COMMIT_SIZES = (64, 8192)
COMMIT_US_PER_SAMPLE = 0.3  # target: controller commit cost per extra sample


@ray.remote(num_cpus=0)
class LoadActor:
    """Runs many concurrent client calls on its own event loop and times each one."""

    def __init__(self, service: str, namespace: str):
        from dataplane_client.client import connect

        self.client = connect(service, namespace)
        self.controller = ray.get_actor(service, namespace=namespace)

    def ready(self) -> bool:
        return True

    async def claims(
        self, partition: str, task: str, tasks: int, per_task: int, batch: int, start_at: float
    ) -> list[float]:
        await asyncio.sleep(max(0.0, start_at - time.time()))

        async def one_claimer() -> list[float]:
            out = []
            for _ in range(per_task):
                t0 = time.perf_counter()
                await self.client.claim_meta_async(
                    partition, task, ["x"], batch, blocking=True, timeout_s=60
                )
                out.append(time.perf_counter() - t0)
            return out

        parts = await asyncio.gather(*[one_claimer() for _ in range(tasks)])
        return [x for p in parts for x in p]

    async def noop_calls(self, tasks: int, per_task: int, start_at: float) -> list[float]:
        """A trivial controller method under the same concurrency: Ray's round trip alone."""
        await asyncio.sleep(max(0.0, start_at - time.time()))

        async def one() -> list[float]:
            out = []
            for _ in range(per_task):
                t0 = time.perf_counter()
                await self.controller.set_draining.remote(False)
                out.append(time.perf_counter() - t0)
            return out

        parts = await asyncio.gather(*[one() for _ in range(tasks)])
        return [x for p in parts for x in p]

    async def puts(
        self, partition: str, tasks: int, per_task: int, batch: int, prefix: str, start_at: float
    ) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        value = torch.zeros(batch, 8, dtype=torch.int64)

        async def one_writer(w: int) -> list[float]:
            out = []
            for i in range(per_task):
                ids = [f"{prefix}-{w}-{i}-{j}" for j in range(batch)]
                t0 = time.perf_counter()
                await self.client.put_samples_async(ids, partition, {"x": value})
                out.append(time.perf_counter() - t0)
            return out

        t0 = time.perf_counter()
        parts = await asyncio.gather(*[one_writer(w) for w in range(tasks)])
        return {"latencies": [x for p in parts for x in p], "start": t0, "end": time.perf_counter()}

    async def blocking_claim(self, partition: str, task: str, batch: int) -> float:
        await self.client.claim_meta_async(
            partition, task, ["x"], batch, blocking=True, timeout_s=60
        )
        return time.perf_counter()


def _fill(client: Any, partition: str, n: int, chunk: int = 10_000) -> None:
    for start in range(0, n, chunk):
        k = min(chunk, n - start)
        client.put_samples(
            [f"s{start + j}" for j in range(k)],
            partition,
            {"x": torch.zeros(k, 8, dtype=torch.int64)},
        )


def _controller_claim_cost(controller: Any, partition: str, task: str, trials: int = 200) -> float:
    """Seconds the controller spends finding ready rows for one claim (measured inside it)."""

    def measure(self, pid, task, trials):
        import time as _t

        part = self.keys.partition(pid)
        t0 = _t.perf_counter()
        for _ in range(trials):
            self.keys.ready_count(part, task, ["x"], 4)
        return (_t.perf_counter() - t0) / trials

    return ray.get(controller.__ray_call__.remote(measure, partition, task, trials))


def _controller_commit_cost(controller: Any, sizes: tuple[int, ...], trials: int) -> dict:
    """Median seconds of the controller's own work for one commit of n new samples (check,
    the units' sample metadata, apply), timed inside the actor on a partition of its own."""

    def measure(self, sizes, trials):
        import time as _t

        from dataplane_client.wire.messages import CommitRequest
        from dataplane_server.controller import publish
        from dataplane_server.core.keyspace import declaration

        pid = "bench-commit-cost"
        self.keys.register(pid, declaration(pid, ["x"], None, []))
        live = self.keys.live_units()
        out = {}
        try:
            for n in sizes:
                times = []
                for t in range(trials):
                    units = [live[i * len(live) // n] for i in range(n)]
                    req = CommitRequest(
                        partition_id=pid,
                        write_id=f"cost-{n}-{t}",
                        sample_ids=[f"c{n}-{t}-{i}" for i in range(n)],
                        units=units,
                        schemas={"x": ("dense", "int64", (8,))},
                        sequence_lengths=None,
                        tags=None,
                        overwrite=False,
                        staged_units=sorted(set(units)),
                    )
                    t0 = _t.perf_counter()
                    plan = self.keys.check_commit(req)
                    publish.sample_metas(req, 0)
                    self.keys.apply_commit(plan)
                    times.append(_t.perf_counter() - t0)
                out[n] = sorted(times)[len(times) // 2]
        finally:
            self.keys.delete(pid)
        return out

    return ray.get(controller.__ray_call__.remote(measure, sizes, trials))


def run(opts: Options) -> Section:

    section = Section("controller")
    per_claimer = 5 if opts.quick else 40
    puts_per_writer = 10 if opts.quick else 100
    wake_trials = 3 if opts.quick else 20
    handle = start_service(SERVICE_NAME, NAMESPACE)
    n_actors = QUICK_CLAIMER_ACTORS if opts.quick else CLAIMER_ACTORS
    tasks_per_actor = CLAIMERS // n_actors
    actors = [LoadActor.remote(SERVICE_NAME, NAMESPACE) for _ in range(n_actors)]
    data: dict[str, Any] = {}
    try:
        ray.get([a.ready.remote() for a in actors])
        client = handle.client()
        n_claimers = n_actors * tasks_per_actor
        n_samples = n_claimers * per_claimer * CLAIM_BATCH + 64
        client.register_partition("claims", fields=["x"], consumer_tasks=["solo", "crowd"])
        _fill(client, "claims", n_samples)

        # one claimer alone, then 64 together
        solo = ray.get(
            actors[0].claims.remote("claims", "solo", 1, per_claimer * 4, CLAIM_BATCH, 0.0)
        )
        start_at = time.time() + 0.5
        crowd = ray.get(
            [
                a.claims.remote(
                    "claims", "crowd", tasks_per_actor, per_claimer, CLAIM_BATCH, start_at
                )
                for a in actors
            ]
        )
        crowd = [x for part in crowd for x in part]
        start_at = time.time() + 0.5
        noop = ray.get(
            [a.noop_calls.remote(tasks_per_actor, per_claimer, start_at) for a in actors]
        )
        noop = [x for part in noop for x in part]
        claim_cost = _controller_claim_cost(handle.controller, "claims", "solo")
        data["claims"] = {
            "claimers": n_claimers,
            "batch": CLAIM_BATCH,
            "samples_in_partition": n_samples,
            "solo_s": solo,
            "crowd_s": crowd,
            "noop_crowd_s": noop,
            "controller_find_rows_s": claim_cost,
        }
        opts.log(
            f"controller: claim p50/p99 with {n_claimers} claimers "
            f"{1e3 * percentile(crowd, 50):.2f}/{1e3 * percentile(crowd, 99):.2f} ms"
        )

        # small puts: throughput
        data["commits"] = []
        for batch in (1, 64):
            part = f"puts-{batch}"
            client.register_partition(part, fields=["x"])
            writers = actors[:2]
            start_at = time.time() + 0.5
            outs = ray.get(
                [
                    w.puts.remote(part, 2, puts_per_writer, batch, f"w{i}", start_at)
                    for i, w in enumerate(writers)
                ]
            )
            lat = [x for o in outs for x in o["latencies"]]
            wall = max(o["end"] for o in outs) - min(o["start"] for o in outs)
            data["commits"].append(
                {
                    "samples_per_put": batch,
                    "writers": 4,
                    "puts": len(lat),
                    "wall_s": wall,
                    "puts_per_s": len(lat) / wall,
                    "samples_per_s": len(lat) * batch / wall,
                    "latency_s": lat,
                }
            )
            client.clear_samples(None, part)

        # wake-up latency of a blocking claim
        client.register_partition("wake", fields=["x"], consumer_tasks=["w"])
        wake, put_s = [], []
        for trial in range(wake_trials):
            ref = actors[0].blocking_claim.remote("wake", "w", CLAIM_BATCH)
            deadline = time.time() + 30
            while ray.get(handle.controller.metrics_snapshot.remote()).claims_waiting < 1:
                if time.time() > deadline:
                    raise RuntimeError("the blocking claim never started waiting")
                time.sleep(0.002)
            t0 = time.perf_counter()
            client.put_samples(
                [f"wake-{trial}-{j}" for j in range(CLAIM_BATCH)],
                "wake",
                {"x": torch.zeros(CLAIM_BATCH, 8, dtype=torch.int64)},
            )
            t1 = time.perf_counter()
            returned = ray.get(ref)
            wake.append(returned - t1)
            put_s.append(t1 - t0)
        data["wake"] = {"after_put_return_s": wake, "put_s": put_s}
        data["commit_cost_s"] = _controller_commit_cost(
            handle.controller, COMMIT_SIZES, 5 if opts.quick else 21
        )
    finally:
        for a in actors:
            ray.kill(a)
        handle.shutdown()
    _report(section, data)
    return section


def _ms(x: float) -> float:
    return 1e3 * x


def _report(section: Section, data: dict[str, Any]) -> None:
    c, w = data["claims"], data["wake"]
    rows = []
    for label, xs in (
        ("claim_meta, 1 claimer", c["solo_s"]),
        (f"claim_meta, {c['claimers']} concurrent claimers", c["crowd_s"]),
        (f"no-op controller call, {c['claimers']} concurrent callers", c["noop_crowd_s"]),
        ("wake-up: claim return - put return", w["after_put_return_s"]),
        ("the put that wakes it (stage + commit)", w["put_s"]),
    ):
        rows.append(
            [
                label,
                len(xs),
                _ms(percentile(xs, 50)),
                _ms(percentile(xs, 90)),
                _ms(percentile(xs, 99)),
                _ms(max(xs)),
            ]
        )
    section.tables.append(
        Table(
            f"latency, ms (claims of {c['batch']} samples from a partition of {c['samples_in_partition']:,})",
            ["what", "n", "p50", "p90", "p99", "max"],
            rows,
        )
    )
    section.tables.append(
        Table(
            "small puts (stage on a unit + commit), 4 concurrent writers",
            ["samples/put", "puts", "puts/s", "samples/s", "p50 ms", "p99 ms"],
            [
                [
                    m["samples_per_put"],
                    m["puts"],
                    m["puts_per_s"],
                    m["samples_per_s"],
                    _ms(percentile(m["latency_s"], 50)),
                    _ms(percentile(m["latency_s"], 99)),
                ]
                for m in data["commits"]
            ],
        )
    )
    p99 = _ms(percentile(c["crowd_s"], 99))
    noop99 = _ms(percentile(c["noop_crowd_s"], 99))
    section.targets.append(
        Target(
            f"claim p99 / no-op call p99, {c['claimers']} in flight <= {CLAIM_P99_OVER_NOOP:g}x",
            p99 / noop99,
            CLAIM_P99_OVER_NOOP,
            False,
            "x",
            detail=f"claim p50/p99 {_ms(percentile(c['crowd_s'], 50)):.2f}/{p99:.2f} ms, "
            f"no-op p50/p99 {_ms(percentile(c['noop_crowd_s'], 50)):.2f}/{noop99:.2f} ms",
        )
    )
    cost = data["commit_cost_s"]
    small, large = min(cost), max(cost)
    per_sample_us = 1e6 * (cost[large] - cost[small]) / (large - small)
    section.tables.append(
        Table(
            "controller's own work per commit of n new samples (check + unit metadata + apply)",
            ["samples", "ms", "us/sample"],
            [[n, _ms(t), 1e6 * t / n] for n, t in sorted(cost.items())],
        )
    )
    section.targets.append(
        Target(
            f"commit cost per extra sample ({small} -> {large} samples) "
            f"<= {COMMIT_US_PER_SAMPLE:g} us",
            per_sample_us,
            COMMIT_US_PER_SAMPLE,
            False,
            "us",
            detail=f"{_ms(cost[small]):.3f} ms at {small}, {_ms(cost[large]):.3f} ms at {large}",
        )
    )
    noop50 = _ms(percentile(c["noop_crowd_s"], 50))
    section.profile_tables.append(
        Table(
            "where a contended claim's time goes",
            ["component", "ms"],
            [
                [
                    "controller: find ready rows + pick (in-actor, per claim)",
                    _ms(c["controller_find_rows_s"]),
                ],
                [
                    "claim alone, p50 (one Ray round trip + controller work)",
                    _ms(percentile(c["solo_s"], 50)),
                ],
                [
                    f"no-op controller call with {c['claimers']} callers, p50 (Ray + queueing)",
                    noop50,
                ],
                [f"claim with {c['claimers']} claimers, p50", _ms(percentile(c["crowd_s"], 50))],
                [f"claim with {c['claimers']} claimers, p99", p99],
            ],
        )
    )
    data["summary"] = {
        "claim_p50_ms": _ms(percentile(c["crowd_s"], 50)),
        "claim_p99_ms": p99,
        "solo_claim_p50_ms": _ms(percentile(c["solo_s"], 50)),
        "noop_p50_ms": noop50,
        "noop_p99_ms": noop99,
        "commit_us_per_sample": per_sample_us,
        "wake_p50_ms": _ms(median(w["after_put_return_s"])),
        "commit_samples_per_s": {m["samples_per_put"]: m["samples_per_s"] for m in data["commits"]},
    }
    section.data = data
