"""The service's own processes run without torch: a controller or unit (re)starts sooner.

Importing torch costs a process 2-3 s of CPU here. The controller and the units only
handle headers and bytes, so they never import it; a restarted controller or unit is
serving again that much sooner. Ray imports an actor's module wherever a handle to it
is looked up (the controller looks its units up by name), so the units' module must be
torch-free for the controller to be.
"""

from __future__ import annotations

import os

import numpy as np
import ray
import torch
from polling import wait_until
from ray._private import state as ray_state

from dataplane_client.codec import fields as codec
from dataplane_client.wire import encoded
from dataplane_client.wire.errors import SamplesNotFound, ServiceUnavailable
from dataplane_server.launch.service import unit_name


def _has_torch(pid: int) -> bool:
    # Seen from outside, as an operator would: torch's shared libraries are mapped once
    # it has been imported, and never before.
    with open(f"/proc/{pid}/maps") as maps:
        return "libtorch" in maps.read()


def _service_pids(handle) -> dict[str, int]:
    """The live process of each of the service's actors, from Ray's actor table (the
    GCS's, which the client's restart checks read too; the state API needs a dashboard)."""
    name = handle.config.name
    units = [unit_name(handle.config, i) for i in range(len(handle.units))]
    alive = {a["Name"]: a["Pid"] for a in ray_state.actors().values() if a["State"] == "ALIVE"}
    return {actor: alive[actor] for actor in [name, *units]}


def test_the_controller_and_units_serve_every_verb_without_importing_torch(
    service_factory, tmp_path
):
    handle = service_factory("no-torch", num_storage_units=2)
    client = handle.client()
    pid = "p"
    client.register_partition(
        pid,
        fields=["tokens", "score", "kind", "note"],
        consumer_tasks=["train"],
        task_leases={"train": 60.0},
        enums={"kind": ["a", "b"]},
        object_fields=["note"],
    )
    ids = [f"s{i}" for i in range(8)]
    client.put_samples(
        ids,
        pid,
        {
            "tokens": [torch.arange(i + 1) for i in range(8)],  # jagged
            "score": torch.randn(8, dtype=torch.bfloat16),
            "kind": ["a", "b"] * 4,
            "note": [{"i": i} for i in range(8)],
        },
    )
    meta = client.claim_meta(pid, "train", ["tokens", "score", "kind", "note"], 8)
    got = client.get_data(meta)
    assert got["kind"] == ["a", "b"] * 4
    client.ack(meta)
    shown = 0  # an operator's preview of each sample, on whichever unit holds it
    for unit in handle.units:
        for sample_id in ids:
            try:
                fields = ray.get(unit.preview.remote(pid, sample_id, None, 4), timeout=60)
            except SamplesNotFound:
                continue
            assert fields["score"]["dtype"] == "bfloat16"
            shown += 1
    assert shown == len(ids)
    client.describe_partition(pid)
    saved = client.checkpoint(str(tmp_path / "ckpt"))
    client.clear_samples(ids[:4], pid)
    # A restarted controller rebuilds from its journal and the units.
    ray.kill(handle.controller, no_restart=False)

    def serving() -> bool:
        try:
            client.describe_partition(pid)
        except ServiceUnavailable:
            return False
        return True

    wait_until(serving, 60, "the restarted controller to answer")
    client.delete_partition(pid)
    client.restore(saved)
    assert np.array_equal(
        client.get_samples(ids[4:], pid, ["score"])["score"].float().numpy(),
        got["score"][4:].float().numpy(),
    )
    pids = _service_pids(handle)
    assert os.getpid() not in pids.values()
    assert _has_torch(os.getpid())  # the check sees torch where it is (this process)
    for name, pid in pids.items():
        assert not _has_torch(pid), f"the {name} process imported torch"


def test_the_wire_dtype_names_are_the_codecs_torch_dtypes():
    assert list(encoded.DTYPE_SIZES) == list(codec.DTYPES)
    for name, dtype in codec.DTYPES.items():
        assert encoded.DTYPE_SIZES[name] == dtype.itemsize, name
