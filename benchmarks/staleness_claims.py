"""Async RL: what a staleness window and a ``where`` filter cost a claim at 1M samples.

The controller's work for one claim of 64 samples (its key space, in this process,
no Ray round trip: that is the same for every claim), on a partition of 1M samples
in GRPO groups of 4, of which all but the newest 30,000 were consumed by the
trainer: 100 policy versions of 10,000 samples, the current version 99.

- plain: a partition registered without versions (today's claim);
- window: the same samples in a versioned partition, ``max_staleness=2``;
- window + where: and ``where="reward_std > 0"`` (DAPO's dynamic sampling; a
  quarter of the groups have a reward spread of 0).

Target (issue 24): window + where p50 <= 1.2x the plain claim's p50, same run.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.common import Section, Table, Target, median, percentile
from dataplane_client.wire.messages import CommitRequest, StalenessSpec
from dataplane_server.core.keyspace import CommitPlan, KeySpace, declaration

GROUP = 4
BATCH = 64
TARGET_RATIO = 1.2
FIELD = ("dense", "float32", ())
UNIT = 0  # the one storage unit (alive, never called: the key space alone is timed)


def _commit(ks: KeySpace, write_id: str, ids: list[str], tags: list[dict[str, Any]]) -> None:
    """A first write of field x to partition p, every sample staged on UNIT, made visible."""
    plan = ks.check_commit(
        CommitRequest(
            partition_id="p",
            write_id=write_id,
            sample_ids=ids,
            units=[UNIT] * len(ids),
            schemas={"x": FIELD},
            sequence_lengths=None,
            tags=tags,
            overwrite=False,
            staged_units=[UNIT],
        )
    )
    assert isinstance(plan, CommitPlan)
    ks.apply_commit(plan)


def _space(total: int, versions: int, fresh: int, versioned: bool) -> tuple[KeySpace, Any]:
    ks = KeySpace()
    ks.unit_alive = [True]
    declared = declaration(
        "p",
        ["x"],
        consumer_tasks=["train"],
        grpo_group_size=GROUP,
        numeric_tags={"reward_std": "float64"},
        staleness=StalenessSpec(max_staleness=2) if versioned else None,
    )
    ks.register("p", declared)
    per_version = total // versions
    chunk = 8192
    for start in range(0, total, chunk):
        ids = [f"s{i}" for i in range(start, min(start + chunk, total))]
        tags = [
            {
                "group_id": i // GROUP,
                "weight_version": i // per_version,
                "reward_std": 0.0 if (i // GROUP) % 4 == 0 else 0.5,
            }
            for i in range(start, start + len(ids))
        ]
        _commit(ks, f"w{start}", ids, tags)
    part = ks.partition("p")
    # The trainer's history: everything but the newest samples consumed, version by version.
    ks.claim(part, "train", ["x"], total - fresh, partial_ok=True)
    if versioned:
        part.versions.set_version(versions - 1)
    return ks, part


def measure(quick: bool) -> dict[str, Any]:
    total, versions, fresh = (100_000, 100, 3_000) if quick else (1_000_000, 100, 30_000)
    # Every claim must find BATCH rows: the window keeps the newest 3 versions' fresh rows
    # and the where filter 3/4 of those (quick: 2,250 rows, so 35 claims at most).
    claims = 30 if quick else 150
    eligible = min(fresh, 3 * total // versions) * 3 // 4
    assert claims * BATCH <= eligible, (claims, eligible)
    from dataplane_client.wire.tag_filters import parse

    cases = {}
    for name, versioned, where in (
        ("plain", False, ()),
        ("window", True, ()),
        ("window + where", True, parse("reward_std > 0")),
    ):
        ks, part = _space(total, versions, fresh, versioned)
        cases[name] = (ks, part, ks.claim_policy(part, where=where))
    # Round robin, so that the machine's noise falls on every case alike.
    rounds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(claims):
        for name, (ks, part, policy) in cases.items():
            t0 = time.perf_counter()
            meta = ks.claim(part, "train", ["x"], BATCH, partial_ok=True, policy=policy)
            rounds[name].append((time.perf_counter() - t0) * 1e6)
            assert meta is not None, name
            assert meta.size == BATCH, name
    results: dict[str, Any] = {"samples": total, "versions": versions, "ready": fresh}
    for name, xs in rounds.items():
        results[name] = {"p50_us": median(xs), "p99_us": percentile(xs, 99)}
    return results


def run(opts: Any) -> Section:
    data = measure(opts.quick)
    plain = data["plain"]["p50_us"]
    rows = [
        [
            name,
            f"{data[name]['p50_us']:.0f}",
            f"{data[name]['p99_us']:.0f}",
            f"{data[name]['p50_us'] / plain:.2f}x",
        ]
        for name in ("plain", "window", "window + where")
    ]
    table = Table(
        f"claim of {BATCH} in the key space, {data['samples']:,} samples stored, "
        f"{data['ready']:,} ready",
        ["claim", "p50 us", "p99 us", "vs plain"],
        rows,
    )
    target = Target(
        "claim with window + where p50 <= 1.2x a plain claim (1M stored)",
        data["window + where"]["p50_us"] / plain,
        TARGET_RATIO,
        higher_is_better=False,
        unit="x",
    )
    return Section(name="staleness", tables=[table], targets=[target], data=data)


if __name__ == "__main__":
    from benchmarks.common import markdown_table

    section = run(type("Opts", (), {"quick": False})())
    for table in section.tables:
        print(table.title)
        print(markdown_table(table.headers, table.rows))
    for t in section.targets:
        print(f"{t.name}: {t.value:.2f} ({t.verdict})")
