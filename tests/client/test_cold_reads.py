"""A fresh process's first get costs what later ones do: everything a read needs is
imported when the process connects (``connect(warm_reads=True)``, the default), not inside
its first get (issue 25: 838 ms against 22 ms, nearly all of it importing tensordict).

The reader is a fresh interpreter that joins the session's Ray cluster by address, so
nothing it imports was imported before; it reports which modules its first get imported.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # a fresh interpreter joins the cluster: seconds

READER = """
import json, sys
from dataplane_client import connect

client = connect(sys.argv[1], sys.argv[2], address=sys.argv[3], warm_reads=sys.argv[4] == "1")
before = set(sys.modules)
out = client.get_samples(["a", "b"], sys.argv[5], ["big", "small"])
after = set(sys.modules)
print(json.dumps({
    "new_modules": sorted(after - before),
    "shape": list(out["big"].shape),
    "sum": float(out["big"].sum() + out["small"].sum()),
}))
"""


def _first_get_in_a_fresh_process(service, partition: str, warm: bool) -> dict:
    import ray

    address = ray.get_runtime_context().gcs_address
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            READER,
            service.config.name,
            service.config.namespace,
            address,
            "1" if warm else "0",
            partition,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def partition(client):
    name = "cold-reads"
    client.register_partition(name, fields=["big", "small"])
    big = torch.arange(2 * 256 * 1024, dtype=torch.float32).reshape(2, -1)  # 1 MiB a row
    small = torch.ones(2, 4)  # small enough to come back inline in the unit's answer
    client.put_samples(["a", "b"], name, {"big": big, "small": small})
    yield name, float(big.sum() + small.sum())
    client.clear_samples(None, name)


def test_a_connected_process_imports_nothing_in_its_first_get(service, partition):
    name, total = partition
    got = _first_get_in_a_fresh_process(service, name, warm=True)
    assert got["shape"] == [2, 256 * 1024]
    assert got["sum"] == total  # the data is right, through shared memory
    assert got["new_modules"] == []


def test_without_warm_reads_the_first_get_pays_the_imports(service, partition):
    # The cost warm_reads moves out of the first get, shown: tensordict (and torch._dynamo).
    name, total = partition
    got = _first_get_in_a_fresh_process(service, name, warm=False)
    assert got["sum"] == total
    assert "tensordict" in got["new_modules"]
