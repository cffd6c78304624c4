"""Group fields: a GRPO group's prompt stored once vs once per member (issue 25 item 5).

One partition declares ``group_fields=["prompt_ids"]``, the other does not; the same
groups (16 members, a 4,096-token int64 prompt, a 1,024-token int64 response per
member) are put one group per put, as a rollout actor puts them, then each group is
read back whole. Reported per group: bytes the store holds for the partition
(``describe_partition``), put and get time (median over groups), shared vs per-sample,
same run. Opt-in section ``groups``: ``python -m benchmarks.run --only groups``.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import torch

from benchmarks.common import BENCH_NAMESPACE, Options, Section, Table, start_ray, start_service

GROUP_SIZE = 16
PROMPT_TOKENS = 4096
RESPONSE_TOKENS = 1024


def _group(g: int) -> tuple[list[str], dict[str, Any], list[dict]]:
    ids = [f"g{g}-{m}" for m in range(GROUP_SIZE)]
    prompt = torch.arange(PROMPT_TOKENS, dtype=torch.int64) + g
    fields = {
        "prompt_ids": [prompt.clone() for _ in ids],  # each member's own copy, as generated
        "responses": [torch.full((RESPONSE_TOKENS,), g * 100 + m) for m in range(GROUP_SIZE)],
    }
    return ids, fields, [{"group_id": g}] * GROUP_SIZE


def measure(client: Any, groups: int, shared: bool) -> dict[str, float]:
    pid = f"bench-groups-{uuid.uuid4().hex[:6]}"
    client.register_partition(
        pid,
        fields=["prompt_ids", "responses"],
        grpo_group_size=GROUP_SIZE,
        group_fields=["prompt_ids"] if shared else [],
    )
    made = [_group(g) for g in range(groups)]
    puts, gets = [], []
    for ids, fields, tags in made:
        t0 = time.perf_counter()
        client.put_samples(ids, pid, fields, tags=tags)
        puts.append(time.perf_counter() - t0)
    for ids, _, _ in made:
        t0 = time.perf_counter()
        out = client.get_samples(ids, pid, ["prompt_ids", "responses"])
        gets.append(time.perf_counter() - t0)
        assert out["prompt_ids"][GROUP_SIZE - 1].shape == (PROMPT_TOKENS,)
    held = sum(client.describe_partition(pid).bytes_per_unit)
    client.delete_partition(pid)
    return {
        "bytes_per_group": held / groups,
        "put_ms_p50": 1e3 * statistics.median(puts),
        "get_ms_p50": 1e3 * statistics.median(gets),
    }


def run(opts: Options) -> Section:
    groups = 4 if opts.quick else 64
    handle = start_service("bench-groups", BENCH_NAMESPACE)
    client = handle.client()
    try:
        measure(client, 2, True)  # warm both paths (mappings, leases) before timing
        measure(client, 2, False)
        data = {
            "shared": measure(client, groups, True),
            "per_sample": measure(client, groups, False),
        }
    finally:
        client.close()
        handle.shutdown()
    s, p = data["shared"], data["per_sample"]
    rows = [
        [
            name,
            f"{d['bytes_per_group'] / 1024:,.0f}",
            f"{d['put_ms_p50']:.2f}",
            f"{d['get_ms_p50']:.2f}",
        ]
        for name, d in (("shared (group_fields)", s), ("per sample", p))
    ]
    rows.append(
        [
            "shared / per sample",
            f"{s['bytes_per_group'] / p['bytes_per_group']:.3f}",
            f"{s['put_ms_p50'] / p['put_ms_p50']:.2f}",
            f"{s['get_ms_p50'] / p['get_ms_p50']:.2f}",
        ]
    )
    data.update(
        groups=groups,
        group_size=GROUP_SIZE,
        prompt_tokens=PROMPT_TOKENS,
        response_tokens=RESPONSE_TOKENS,
    )
    return Section(
        name="groups",
        tables=[
            Table(
                f"a group of {GROUP_SIZE}, {PROMPT_TOKENS}-token prompt + {RESPONSE_TOKENS}-token "
                f"responses (int64), one put per group, {groups} groups",
                ["storage", "KiB held / group", "put ms p50", "get ms p50"],
                rows,
            )
        ],
        data=data,
    )


if __name__ == "__main__":
    import argparse
    import json

    from benchmarks.common import markdown_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    start_ray(4, 1 << 30)  # the harness starts its own for every section
    section = run(Options(quick=args.quick))
    for table in section.tables:
        print(f"### {table.title}\n")
        print(markdown_table(table.headers, table.rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(section.to_dict(), f, indent=2)
