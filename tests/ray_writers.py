"""Writers for fault tests: a Ray actor that puts batches of samples while a test kills
something, and the values it writes (each row derived from its sample id, so a read
back can be checked bit for bit)."""

from __future__ import annotations

import sys
import zlib

import ray
import torch

# tests/ is not importable on Ray's workers: this module travels with what uses it.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def values(ids: list[str], width: int) -> torch.Tensor:
    """The rows the writer puts for ``ids``: ``width`` floats each, offset by the id."""
    return torch.stack(
        [torch.arange(width, dtype=torch.float32) + zlib.crc32(s.encode()) % 100_000 for s in ids]
    )


def writer_class():
    """The writer actor's class (made on demand: a test module may never start Ray)."""

    @ray.remote
    class Writer:
        def __init__(self, name, namespace):
            from dataplane_client.client import connect

            self.c = connect(name, namespace)
            self.done: list[str] = []

        def write(
            self, pid: str, batches: int, size: int, width: int = 4, attempts: int = 1
        ) -> tuple[list[str], list[str]]:
            """Put ``batches`` batches of ``size`` samples; a batch refused with a typed error
            is tried up to ``attempts`` times (what a trainer's rollout loop does). Returns
            the ids that went in and the untyped errors met."""
            from dataplane_client.wire.errors import DataPlaneError

            untyped = []
            for b in range(batches):
                ids = [f"w{b}-{i}" for i in range(size)]
                rows = values(ids, width)
                for _ in range(attempts):
                    try:
                        self.c.put_samples(ids, pid, {"x": rows})
                        self.done.extend(ids)
                        break
                    except DataPlaneError:
                        continue
                    except Exception as e:  # noqa: BLE001 - exactly what the tests look for
                        untyped.append(repr(e))
                        break
            return self.done, untyped

        def progress(self) -> int:
            return len(self.done)

    return Writer
