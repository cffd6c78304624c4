"""Driver on vs. off the data path: one logprob pass at DP=4 (TP=1) on CPU, two ways.

- ``classic``: the driver holds the padded batch (every GRPO field, as NeMo-RL's
  ``policy.get_logprobs(train_data)`` does), shards it, ``ray.put``s each shard
  and gathers ``{"logprobs": [B, S]}`` back.
- ``dataplane``: rollouts were written to the store by a rollout task; the
  driver claims a :class:`KVBatchMeta` (keys only), ``TQPolicy`` splits it and
  ships per-rank metas; each worker fetches ``input_ids``, computes and writes
  ``prev_logprobs`` back. The driver gets ``None`` per rank.

Per batch size: one instrumented pass per path counts the bytes the driver
serializes (``ray.put`` values and ``.remote()`` arguments, ObjectRefs counted
as refs) and deserializes (``ray.get`` results); then timed passes, interleaved
(classic, dataplane, classic, ...), record wall time and the driver's peak RSS
above its level at the start of the pass. Getting the rollouts into the
driver's memory (classic) is not counted, which favours the classic path.

The section then runs the same pass at GRPO sizes with compute replaced by a
GPU-speed stand-in (``driver_fast_compute``), where data movement decides.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
import torch

from benchmarks.common import (
    MiB,
    Options,
    PeakRSS,
    Section,
    Table,
    Target,
    median,
    ratio,
    start_service,
)

SERVICE_NAME = "bench-driver"
NAMESPACE = "bench"
DP = 4
FULL_BATCHES = [64, 256, 1024]
QUICK_BATCHES = [8, 16]
FULL_MAX_LEN = 512  # the tiny model's max_position_embeddings
QUICK_MAX_LEN = 64
VOCAB = 128


# ---------------------------------------------------------------------------- data


def make_rollouts(
    batch: int, max_len: int, seed: int, min_len: int | None = None
) -> dict[str, Any]:
    """GRPO-shaped rollouts: jagged per-token fields plus per-sample scalars; lengths
    uniform in ``min_len..max_len`` (default ``max_len // 8``)."""
    gen = torch.Generator().manual_seed(seed)
    low = max(2, max_len // 8 if min_len is None else min_len)
    lengths = torch.randint(low, max_len + 1, (batch,), generator=gen)
    rows = [int(n) for n in lengths]
    return {
        "input_ids": [torch.randint(1, VOCAB, (n,), generator=gen) for n in rows],
        "token_mask": [torch.ones(n, dtype=torch.int64) for n in rows],
        "generation_logprobs": [-torch.rand(n, generator=gen) for n in rows],
        "advantages": [torch.randn(n, generator=gen) for n in rows],
        "input_lengths": lengths.to(torch.int64),
        "sample_mask": torch.ones(batch, dtype=torch.float32),
    }


def padded(rollouts: dict[str, Any]) -> Any:
    """The classic driver's BatchedDataDict: every jagged field padded to [B, S]."""
    from dataplane_client.batching.batched_data_dict import BatchedDataDict

    out = {}
    for name, value in rollouts.items():
        if isinstance(value, list):
            out[name] = torch.nn.utils.rnn.pad_sequence(value, batch_first=True, padding_value=0)
        else:
            out[name] = value
    return BatchedDataDict(out)


@ray.remote(num_cpus=0)
def write_rollouts(
    service: str,
    namespace: str,
    partition: str,
    batch: int,
    max_len: int,
    seed: int,
    min_len: int | None = None,
    consumer_tasks: tuple[str, ...] = ("logprob",),
) -> int:
    """A rollout task: writes the batch straight into the store (not through the driver)."""
    from dataplane_client.client import connect

    client = connect(service, namespace)
    data = make_rollouts(batch, max_len, seed, min_len)
    client.register_partition(partition, fields=list(data), consumer_tasks=list(consumer_tasks))
    client.put_samples([f"{partition}-{i}" for i in range(batch)], partition, data)
    return sum(int(n) for n in data["input_lengths"])


# ---------------------------------------------------------------------------- instrumentation


def payload_nbytes(obj: Any) -> int:
    """Pickle-5 size of ``obj`` with out-of-band buffers; an ObjectRef counts as a small id."""
    from ray import cloudpickle

    class _Pickler(cloudpickle.CloudPickler):
        def persistent_id(self, o: Any) -> Any:
            return id(o) if isinstance(o, ray.ObjectRef) else None

    buffers: list = []
    sink = _ByteCounter()  # counts what is written, keeps nothing: a batch can be GiBs
    _Pickler(sink, protocol=5, buffer_callback=buffers.append).dump(obj)
    return sink.nbytes + sum(memoryview(b.raw()).nbytes for b in buffers)


class _ByteCounter:
    """A write-only file that counts bytes."""

    def __init__(self) -> None:
        self.nbytes = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.nbytes += n
        return n


class DriverBytes:
    """Counts what this process hands to Ray and takes back from it."""

    def __init__(self) -> None:
        self.put_bytes = 0  # ray.put values
        self.arg_bytes = 0  # .remote() arguments
        self.get_bytes = 0  # ray.get results
        self.puts = 0
        self.gets = 0
        self.calls = 0

    @property
    def sent(self) -> int:
        return self.put_bytes + self.arg_bytes

    @property
    def received(self) -> int:
        return self.get_bytes

    def to_dict(self) -> dict[str, int]:
        return {
            "sent": self.sent,
            "received": self.received,
            "put_bytes": self.put_bytes,
            "arg_bytes": self.arg_bytes,
            "get_bytes": self.get_bytes,
            "puts": self.puts,
            "gets": self.gets,
            "calls": self.calls,
        }


@contextmanager
def count_driver_bytes():
    from ray.actor import ActorMethod

    counter = DriverBytes()
    orig_put, orig_get, orig_remote = ray.put, ray.get, ActorMethod._remote

    def put(value, *args, **kwargs):
        counter.put_bytes += payload_nbytes(value)
        counter.puts += 1
        return orig_put(value, *args, **kwargs)

    def get(refs, *args, **kwargs):
        out = orig_get(refs, *args, **kwargs)
        counter.get_bytes += payload_nbytes(out)
        counter.gets += 1
        return out

    def remote(self, args=None, kwargs=None, *rest, **options):
        counter.arg_bytes += payload_nbytes((args or (), kwargs or {}))
        counter.calls += 1
        return orig_remote(self, args, kwargs, *rest, **options)

    ray.put, ray.get, ActorMethod._remote = put, get, remote
    try:
        yield counter
    finally:
        ray.put, ray.get, ActorMethod._remote = orig_put, orig_get, orig_remote


# ---------------------------------------------------------------------------- workers


def timed_worker_cls(base: type | None = None) -> type:
    """``base`` (default PolicyWorker) adding up the seconds it spends fetching, computing
    and writing back."""
    from policy_workers.worker import PolicyWorker

    class TimedPolicyWorker(base or PolicyWorker):  # type: ignore[misc]
        def _timed(self, phase: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases = self.__dict__.setdefault("_phases", {})
                phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - t0

        def _fetch(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("fetch", super()._fetch, *args, **kwargs)

        def get_logprobs(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("compute", super().get_logprobs, *args, **kwargs)

        def _write_back(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("write_back", super()._write_back, *args, **kwargs)

        def take_phases(self) -> dict[str, float]:
            return self.__dict__.pop("_phases", {})

    return TimedPolicyWorker


def slowest_rank_phases(policy: Any) -> dict[str, float]:
    """Per phase, the slowest rank's seconds (ranks run in parallel)."""
    per_rank = policy.run_on_all_workers("take_phases")
    keys = {k for r in per_rank for k in r}
    return {k: max(r.get(k, 0.0) for r in per_rank) for k in sorted(keys)}


# ---------------------------------------------------------------------------- run


@contextmanager
def service_with_policy(max_len: int, service: str = SERVICE_NAME) -> Iterator[tuple[Any, Any]]:
    """A benchmark service and a policy on it (``make_policy``): (a client, the policy),
    both shut down after, the policy first."""
    handle = start_service(service, NAMESPACE)
    policy = None
    try:
        policy = make_policy(max_len, service=service)
        yield handle.client(), policy
    finally:
        if policy is not None:
            policy.shutdown()
        handle.shutdown()


def make_policy(
    max_len: int, *, service: str = SERVICE_NAME, dp: int = DP, worker_cls: type | None = None
) -> Any:
    """A TQPolicy of ``dp`` timed workers (TP=1) on the benchmark's service."""
    from dataplane_client.wire.config import DataPlaneConfig
    from policy_workers.config import ModelConfig, PolicyConfig
    from policy_workers.tq_policy import TQPolicy

    cfg = PolicyConfig(
        dp=dp,
        tp=1,
        model=ModelConfig(vocab_size=VOCAB, max_position_embeddings=max(512, max_len)),
        logprob_batch_size=16,
        num_cpus_per_worker=1.0,
        num_gpus_per_worker=0,
        torch_threads=1,
        data_plane=DataPlaneConfig(
            name=service, namespace=NAMESPACE, admin_enabled=False, metrics_enabled=False
        ),
    )
    return TQPolicy(cfg, worker_cls=timed_worker_cls(worker_cls))


def _check_same(
    policy: Any, meta: Any, classic_logprobs: torch.Tensor, lengths: list[int]
) -> float:
    """Max |difference| between the store's prev_logprobs and the classic result."""
    stored = policy._client_or_connect().get_data(meta, ["prev_logprobs"])["prev_logprobs"]
    rows = stored.unbind() if isinstance(stored, torch.Tensor) else stored
    worst = 0.0
    for i, row in enumerate(rows):
        n = lengths[i]
        worst = max(worst, float((row[:n] - classic_logprobs[i, :n]).abs().max()))
    return worst


def compare_paths(
    policy: Any,
    client: Any,
    partition: str,
    task: str,
    data: Any,
    repeats: int,
    *,
    lengths: list[int],
) -> dict[str, Any]:
    """The classic and the data-plane logprob pass over the same batch, side by side.

    One instrumented pass per path counts the driver's bytes (the data-plane one
    includes its ``claim_meta`` for ``task``); the two results are compared; then
    ``repeats`` timed passes, interleaved, record wall time, the driver's peak RSS
    above its level when the pass began, and the slowest rank's worker phases.
    """
    b = len(lengths)
    with count_driver_bytes() as dp_bytes:
        meta = client.claim_meta(partition, task, ["input_ids"], batch_size=b)
        policy.get_logprobs_from_meta(meta, overwrite=True)
    with count_driver_bytes() as cl_bytes:
        classic = policy.get_logprobs(data)
    max_diff = _check_same(policy, meta, classic["logprobs"], lengths)
    del classic

    slowest_rank_phases(policy)  # drop what the instrumented passes recorded
    times: dict[str, list[float]] = {"classic": [], "dataplane": []}
    rss: dict[str, list[int]] = {"classic": [], "dataplane": []}
    phases: dict[str, list[dict[str, float]]] = {"classic": [], "dataplane": []}
    for _ in range(repeats):
        for path in ("classic", "dataplane"):
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                if path == "classic":
                    out = policy.get_logprobs(data)
                    del out
                else:
                    policy.get_logprobs_from_meta(meta, overwrite=True)
                times[path].append(time.perf_counter() - t0)
            rss[path].append(mem.delta)
            phases[path].append(slowest_rank_phases(policy))
    return {
        "driver_bytes_dataplane": dp_bytes.to_dict(),
        "driver_bytes_classic": cl_bytes.to_dict(),
        "seconds": times,
        "peak_rss_delta_bytes": rss,
        "worker_phases_s": phases,
        "max_abs_diff_logprobs": max_diff,
    }


def summary_line(row: dict[str, Any]) -> str:
    """One log line per measured row: both paths' median seconds and driver bytes."""
    t, dp, cl = row["seconds"], row["driver_bytes_dataplane"], row["driver_bytes_classic"]
    return (
        f"classic {median(t['classic']):.3f}s, dataplane {median(t['dataplane']):.3f}s; "
        f"driver bytes classic {cl['sent'] + cl['received']:,} "
        f"dataplane {dp['sent'] + dp['received']:,}"
    )


def _require_demo_extra() -> None:
    """Fail here, clearly, rather than in four policy workers that die importing it."""
    if importlib.util.find_spec("transformers") is None:
        raise RuntimeError(
            "the driver section runs the demo's transformers model: install the `demo` "
            "extra (pip install -e '.[demo]'; make setup and make bench-setup do)"
        )


def run(opts: Options) -> Section:
    _require_demo_extra()
    section = Section("driver")
    batches = QUICK_BATCHES if opts.quick else FULL_BATCHES
    max_len = QUICK_MAX_LEN if opts.quick else FULL_MAX_LEN
    repeats = max(1, min(opts.repeats, 3))  # each pass is seconds of compute on 2 cores
    results = []
    with service_with_policy(max_len) as (client, policy):
        for b in batches:
            partition = f"rollouts-{b}"
            tokens = ray.get(
                write_rollouts.remote(SERVICE_NAME, NAMESPACE, partition, b, max_len, seed=b)
            )
            data = padded(make_rollouts(b, max_len, seed=b))
            lengths = data["input_lengths"].tolist()
            tensor_bytes_classic = sum(v.numel() * v.element_size() for v in data.values())
            # bytes the data-plane pass moves: input_ids (+lengths) in, prev_logprobs out
            moved = tokens * 8 + b * 8 + tokens * 4

            measured = compare_paths(
                policy, client, partition, "logprob", data, repeats, lengths=lengths
            )
            row = {
                "batch": b,
                "max_len": max_len,
                "tokens": tokens,
                "tensor_bytes_moved_dataplane": moved,
                "tensor_bytes_classic_batch": tensor_bytes_classic,
                **measured,
            }
            results.append(row)
            opts.log(f"driver B={b}: {summary_line(row)}")
            client.clear_samples(None, partition)
    _report(section, results, repeats)
    return section


def _report(section: Section, results: list[dict], repeats: int) -> None:
    rows = []
    for r in results:
        dp, cl = r["driver_bytes_dataplane"], r["driver_bytes_classic"]
        dp_total, cl_total = dp["sent"] + dp["received"], cl["sent"] + cl["received"]
        t_cl, t_dp = median(r["seconds"]["classic"]), median(r["seconds"]["dataplane"])
        rows.append(
            [
                r["batch"],
                r["tokens"],
                r["tensor_bytes_moved_dataplane"] / MiB,
                cl_total / MiB,
                dp_total / 1024,
                100 * dp_total / r["tensor_bytes_moved_dataplane"],
                median(r["peak_rss_delta_bytes"]["classic"]) / MiB,
                median(r["peak_rss_delta_bytes"]["dataplane"]) / MiB,
                t_cl,
                t_dp,
                ratio(t_cl, t_dp),
                r["max_abs_diff_logprobs"],
            ]
        )
    section.tables.append(
        Table(
            f"logprob pass, DP={DP} TP=1 on CPU (median of {repeats}; classic and dataplane interleaved)",
            [
                "batch",
                "tokens",
                "tensor MiB moved",
                "classic driver MiB",
                "dataplane driver KiB",
                "dataplane driver % of moved",
                "classic peak RSS +MiB",
                "dataplane peak RSS +MiB",
                "classic s",
                "dataplane s",
                "speed-up",
                "max |diff|",
            ],
            rows,
        )
    )
    if results:
        last = results[-1]  # the largest batch: per-call overhead is amortised as in real runs
        dp = last["driver_bytes_dataplane"]
        pct = 100 * (dp["sent"] + dp["received"]) / last["tensor_bytes_moved_dataplane"]
        section.targets.append(
            Target(
                f"dataplane driver bytes <= 1% of tensor bytes moved (batch {last['batch']})",
                pct,
                1.0,
                False,
                "%",
                detail=f"{dp['sent'] + dp['received']:,} B of {last['tensor_bytes_moved_dataplane']:,} B",
            )
        )
        t_cl, t_dp = median(last["seconds"]["classic"]), median(last["seconds"]["dataplane"])
        section.targets.append(
            Target(
                f"logprob pass >= 2x faster than classic (batch {last['batch']}, the largest run)",
                ratio(t_cl, t_dp),
                2.0,
                True,
                "x",
                detail=f"classic {t_cl:.3f}s vs dataplane {t_dp:.3f}s",
            )
        )
    prof = []
    for r in results:
        for path in ("classic", "dataplane"):
            wall = median(r["seconds"][path])
            ph = r["worker_phases_s"][path]
            med = {
                k: median([p.get(k, 0.0) for p in ph]) for k in ("fetch", "compute", "write_back")
            }
            rest = wall - sum(med.values())
            prof.append(
                [r["batch"], path, wall, med["fetch"], med["compute"], med["write_back"], rest]
            )
    kinds = []
    for r in results:
        for path in ("classic", "dataplane"):
            d = r[f"driver_bytes_{path}"]
            kinds.append(
                [
                    r["batch"],
                    path,
                    d["put_bytes"],
                    d["arg_bytes"],
                    d["get_bytes"],
                    (d["sent"] + d["received"]) / r["batch"],
                ]
            )
    section.profile_tables.append(
        Table(
            "driver bytes in one pass, by kind (what the <= 1% target counts)",
            [
                "batch",
                "path",
                "ray.put values",
                ".remote() args",
                "ray.get results",
                "bytes/sample",
            ],
            kinds,
        )
    )
    section.profile_tables.append(
        Table(
            "one logprob pass, seconds (worker phases: slowest rank; rest = driver, dispatch, Ray transfer)",
            [
                "batch",
                "path",
                "wall",
                "worker fetch",
                "worker compute",
                "worker write-back",
                "rest",
            ],
            prof,
        )
    )
    section.notes.append(
        "driver bytes = pickle-5 size of ray.put values, .remote() arguments and ray.get results "
        "in the driver during one pass (the dataplane pass includes its claim_meta)"
    )
    section.data = {"dp": DP, "repeats": repeats, "results": results}
