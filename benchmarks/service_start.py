"""Service start and controller restart: how long until the service answers again.

    python -m benchmarks.service_start [--rounds 3] [--base DIR] [--out service_start.json]

Each round is a fresh process with its own Ray, so every service process it times is a
cold one. It times ``start()`` of a default service (controller, 2 units, the admin
endpoint), then kills the controller twice (Ray restarts it) and times each kill until
``describe_partition`` answers again. With ``--base``, rounds alternate between this
checkout and DIR's packages (``BENCH_WRITERS_BASE``'s way: a directory of links), so
both run on the same machine in the same minutes; the table gives their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import fmt, linked_checkout, markdown_table, median, ratio

ROOT = Path(__file__).resolve().parents[1]
RESTARTS = 2  # controller kills per round
ANSWER_TIMEOUT_S = 120.0


def one_round() -> dict[str, Any]:
    """Start Ray and a service in this process and time them (one round's figures)."""
    import ray

    import dataplane_client
    from benchmarks.common import start_ray
    from dataplane_client.wire.config import DataPlaneConfig
    from dataplane_client.wire.errors import ServiceUnavailable
    from dataplane_server.launch.service import start

    start_ray(num_cpus=4, object_store_bytes=256 << 20)
    t0 = time.perf_counter()
    handle = start(DataPlaneConfig(name="start-bench", namespace="start-bench"))
    start_s = time.perf_counter() - t0
    client = handle.client()
    client.register_partition("p", fields=["x"])
    restarts = []
    for _ in range(RESTARTS):
        t0 = time.perf_counter()
        ray.kill(handle.controller, no_restart=False)
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while True:  # the answer is what is timed: poll it
            try:
                client.describe_partition("p")
                break
            except ServiceUnavailable:
                if time.monotonic() > deadline:
                    raise
        restarts.append(time.perf_counter() - t0)
    handle.shutdown()
    ray.shutdown()
    code = str(Path(dataplane_client.__file__).resolve())  # a linked checkout: its own path
    return {"code": code, "start_s": start_s, "restart_s": restarts}


def _run_round(code_dir: Path | None) -> dict[str, Any]:
    """One round in a child process: this checkout's code, or the linked ``code_dir``."""
    cwd = code_dir or ROOT
    env = dict(os.environ, PYTHONPATH=str(cwd))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.service_start", "--one"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"a round failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--base", help="another checkout whose packages run alternate rounds")
    p.add_argument("--out", default="service_start.json")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one_round()), flush=True)
        return 0
    codes: dict[str, list[dict[str, Any]]] = {"this": []}
    with linked_checkout(args.base) as base_dir:
        if base_dir is not None:
            codes["base"] = []
        for i in range(args.rounds):
            for label in codes:
                result = _run_round(base_dir if label == "base" else None)
                codes[label].append(result)
                print(
                    f"round {i + 1} {label}: start {result['start_s']:.2f} s, controller "
                    f"restarts {', '.join(f'{s:.2f}' for s in result['restart_s'])} s",
                    flush=True,
                )
    if args.base:
        expected = str(Path(args.base, "dataplane_client").resolve())
        if not all(r["code"].startswith(expected) for r in codes["base"]):
            raise RuntimeError(f"the base rounds did not import {expected}")
    summary = {
        label: {
            "start_s": median([r["start_s"] for r in rounds]),
            "restart_s": median([s for r in rounds for s in r["restart_s"]]),
        }
        for label, rounds in codes.items()
    }
    rows = [[label, fmt(s["start_s"]), fmt(s["restart_s"])] for label, s in summary.items()]
    if "base" in summary:
        rows.append(
            [
                "base / this",
                fmt(ratio(summary["base"]["start_s"], summary["this"]["start_s"])),
                fmt(ratio(summary["base"]["restart_s"], summary["this"]["restart_s"])),
            ]
        )
    print(
        markdown_table(
            ["code", "start() s (median)", "controller kill -> answering s (median)"], rows
        )
    )
    Path(args.out).write_text(json.dumps({"rounds": codes, "summary": summary}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
