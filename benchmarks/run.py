"""One command for every benchmark: ``python -m benchmarks.run`` (or ``dataplane bench``).

Starts one local Ray on loopback, runs the sections in order (store, driver,
controller, scale, staleness; opt-in: writers, replication, crossnode, asyncrl, groups,
rankpull, pacing, durability, checkpoint, chaos),
prints a markdown table per section with the targets judged met or missed, and
writes every number to JSON. A section that raises does not hide the others; it is
listed as FAILED in the closing summary table and the JSON (``failed``), and the
run exits 1.

    python -m benchmarks.run                     # everything, default sizes
    python -m benchmarks.run --quick             # small sizes: a smoke run (< 2 minutes)
    python -m benchmarks.run --only store --sizes 128M,1G --repeats 7
    .venv-bench/bin/python -m benchmarks.run     # with the transferqueue column filled in
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

from benchmarks.common import (
    GiB,
    Options,
    Section,
    markdown_table,
    memcpy_gibps,
    parse_size,
    targets_table,
)

# name -> module; run in this order.
SECTIONS = {
    "store": "benchmarks.store_throughput",
    "driver": "benchmarks.driver",
    "controller": "benchmarks.controller_claims",
    "scale": "benchmarks.scale",
    "staleness": "benchmarks.staleness_claims",
}
# Run only when named in --only: each starts its own cluster or service in a subprocess,
# or (writers) runs thousands of writers for minutes.
OPT_IN_SECTIONS = {
    "writers": "benchmarks.many_writers",
    "replication": "benchmarks.replication",
    "crossnode": "benchmarks.cross_node",
    # three demo runs (sync, --async N=1, N=2), each its own local Ray: minutes
    "asyncrl": "benchmarks.async_rl",
    # group fields stored once vs per sample (a service of its own)
    "groups": "benchmarks.group_fields",
    # per-rank streaming pull vs the driver-planned path (four policy workers of its own)
    "rankpull": "benchmarks.rank_pull",
    # paced vs unpaced admission on a long-tail workload (sleeping stand-ins): stale drops, KS
    "pacing": "benchmarks.async_pacing",
    # durability levels side by side, and serving again with 1M samples stored
    "durability": "benchmarks.durability",
    # put / claim rates during a checkpoint, incremental checkpoint time (a service of its own)
    "checkpoint": "benchmarks.checkpoint_cut",
    # the async demo SIGKILLed 5 times and resumed, beside an uninterrupted run: minutes
    "chaos": "benchmarks.chaos_resume",
}
RAY_NUM_CPUS = 16  # logical slots: 4 policy workers + TransferQueue's 3 + helpers; 2 real cores


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dataplane bench", description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="small sizes: a smoke run, not a measurement"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="repeats per measurement (median reported); default 5, --quick 2",
    )
    p.add_argument(
        "--sizes",
        default=None,
        help="store section: comma-separated total sizes of the simple case, e.g. 32M,128M,1G",
    )
    p.add_argument(
        "--only",
        action="append",
        default=None,
        metavar="SECTION",
        help="run only these sections (repeatable or comma-separated): "
        f"{', '.join(SECTIONS)}; opt-in: {', '.join(OPT_IN_SECTIONS)}",
    )
    p.add_argument("--out", default="bench_results/results.json", help="where the JSON goes")
    p.add_argument("--verbose", action="store_true")
    return p


def _options(args: argparse.Namespace, known: Sequence[str]) -> Options:
    only = None
    if args.only:
        only = [s.strip() for item in args.only for s in item.split(",") if s.strip()]
        unknown = sorted(set(only) - set(known))
        if unknown:
            raise SystemExit(f"unknown section(s) {unknown}; choose from {list(known)}")
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else None
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    return Options(quick=args.quick, repeats=repeats, sizes=sizes, only=only, verbose=args.verbose)


def _object_store_bytes(opts: Options) -> int:
    from benchmarks.store_throughput import FULL_SIZES, QUICK_SIZES

    largest = max(opts.sizes or (QUICK_SIZES if opts.quick else FULL_SIZES))
    # one object for a put in flight, one for a get, one for the Ray baseline, plus slack
    return max(1 * GiB, 3 * largest + GiB // 2)


def render(section: Section) -> str:
    out = [f"## {section.name}", ""]
    for t in section.tables:
        out += [f"**{t.title}**", "", markdown_table(t.headers, t.rows), ""]
    if section.targets:
        tt = targets_table(section.targets)
        out += ["**targets**", "", markdown_table(tt.headers, tt.rows), ""]
    if section.missed and section.profile_tables:
        out += ["**where the time goes (a target was missed)**", ""]
        for t in section.profile_tables:
            out += [f"*{t.title}*", "", markdown_table(t.headers, t.rows), ""]
    for n in section.notes:
        out.append(f"- {n}")
    return "\n".join(out).rstrip() + "\n"


def render_summary(report: dict[str, Any]) -> str:
    """One row per section that ran: ok or FAILED (with the error), and its seconds."""
    rows = []
    for name, seconds in report["section_seconds"].items():
        error = report["errors"].get(name)
        rows.append([name, "FAILED" if error else "ok", round(seconds, 1), error or ""])
    table = markdown_table(["section", "status", "seconds", "error"], rows)
    failed = report["failed"]
    verdict = f"{len(failed)} section(s) FAILED: {', '.join(failed)}" if failed else "all ran"
    return f"## summary\n\n{machine_line(report['machine'])}\n\n{table}\n\n{verdict}\n"


def _machine() -> dict[str, Any]:
    import psutil
    import ray
    import torch

    try:
        from importlib.metadata import version

        import transfer_queue  # noqa: F401

        tq = version("transferqueue")
    except Exception:  # noqa: BLE001
        tq = None
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "torch": torch.__version__,
        "ray": ray.__version__,
        "transferqueue": tq,
        "load_avg": os.getloadavg(),
        # the yardstick every figure of this run is read against; again at the end
        "memcpy_1thread_gibps_start": memcpy_gibps(),
    }


def machine_line(machine: dict[str, Any]) -> str:
    """Which machine the figures came from, in one line (printed first and in the summary)."""
    mc = f"{machine['memcpy_1thread_gibps_start']:.1f} GiB/s"
    if "memcpy_1thread_gibps_end" in machine:
        mc += f" at the start, {machine['memcpy_1thread_gibps_end']:.1f} at the end"
    load = ", ".join(f"{x:.1f}" for x in machine["load_avg"])
    return (
        f"machine: single-thread memcpy {mc} (128 MiB, measured by this run); "
        f"{machine['cpus']} CPUs; load average {load}"
    )


def main(argv: Sequence[str] | None = None, sections: dict[str, str] | None = None) -> int:
    """Run the sections; 0 when every one ran, 1 when any raised.

    ``sections`` (name -> module with ``run(opts) -> Section``) replaces the registry,
    every entry opt-in; the harness's own tests pass one with a section that fails.
    """
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    registry = {**SECTIONS, **OPT_IN_SECTIONS} if sections is None else sections
    default_names = list(SECTIONS) if sections is None else []
    opts = _options(args, list(registry))
    from benchmarks.common import start_ray

    started = time.time()
    start_ray(RAY_NUM_CPUS, _object_store_bytes(opts))
    report: dict[str, Any] = {
        "started_at": started,
        "argv": list(sys.argv[1:] if argv is None else argv),
        "options": {
            "quick": opts.quick,
            "repeats": opts.repeats,
            "sizes": opts.sizes,
            "only": opts.only,
        },
        "machine": _machine(),
        "sections": {},
        "section_seconds": {},
        "errors": {},
        "failed": [],
    }
    print(machine_line(report["machine"]) + "\n", flush=True)
    try:
        for name, module_name in registry.items():
            if name not in (opts.only or default_names):
                continue
            opts.log(f"section {name} ...")
            t0 = time.perf_counter()
            try:
                section: Section = importlib.import_module(module_name).run(opts)
            except Exception as e:  # noqa: BLE001 - one broken section must not hide the others
                traceback.print_exc()
                report["errors"][name] = f"{type(e).__name__}: {e}"
                report["failed"].append(name)
                print(f"## {name}\n\nFAILED: {report['errors'][name]}\n", flush=True)
                continue
            finally:
                report["section_seconds"][name] = time.perf_counter() - t0
            section.data["elapsed_s"] = report["section_seconds"][name]
            report["sections"][name] = section.to_dict()
            print(render(section), flush=True)
        report["machine"]["memcpy_1thread_gibps_end"] = memcpy_gibps()
        print(render_summary(report), flush=True)
    finally:
        import ray

        report["elapsed_s"] = time.time() - started
        out = args.out
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=1, default=_json_default)
        opts.log(f"wrote {out} ({report['elapsed_s']:.0f} s)")
        ray.shutdown()
    return 1 if report["failed"] else 0


def _json_default(x: Any) -> Any:
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
