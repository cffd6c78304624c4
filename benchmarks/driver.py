"""The driver section of ``benchmarks.run``: the classic path against the data plane with a
real model (``driver_path``), then the same pass with GPU-speed compute at GRPO sizes
(``driver_fast_compute``, its own service and policies), in one section."""

from __future__ import annotations

from benchmarks import driver_fast_compute, driver_path
from benchmarks.common import Options, Section


def run(opts: Options) -> Section:
    section = driver_path.run(opts)
    driver_fast_compute.run(opts, section)
    return section
