"""Replication (``replicas: 2``) on three nodes (part of tests/scenarios/one_cluster.py).

tests/e2e/test_replication.py asserts on what it observed. Three parts, each on its own
service:

1. a node holding primaries is removed while a writer streams puts;
2. one storage unit is killed (after a clear, a checkpoint and a controller restart);
3. a writer is killed between staging a put's two copies.
"""

import os
import tempfile
import threading

import numpy as np
import ray
import torch
from polling import wait_until
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dataplane_client import DataPlaneConfig, connect
from dataplane_client.codec.fields import encode_fields
from dataplane_client.wire.errors import ConfigError, DataPlaneError, SamplesLost
from dataplane_client.wire.messages import CommitRequest
from dataplane_server import start

BATCH = 8
BATCHES = 15


def rows_of(sample_id: str) -> tuple[torch.Tensor, int]:
    """The bytes a sample holds, a function of its id (checked bit for bit on read)."""
    k = int(sample_id.split("-")[-1])
    return torch.arange(k % 37 + 1, dtype=torch.float32) * (k + 1) / 7, k * 1_000_003


def put(client, partition: str, ids: list[str]) -> None:
    rows = [rows_of(s) for s in ids]
    client.put_samples(
        ids,
        partition,
        {"x": [r for r, _ in rows], "y": torch.tensor([v for _, v in rows], dtype=torch.int64)},
    )


def same_bytes(client, partition: str, ids: list[str]) -> bool:
    got = client.get_samples(ids, partition, ["x", "y"])
    xs, ys = got["x"].unbind(), got["y"].tolist()
    return all(torch.equal(x, rows_of(s)[0]) and y == rows_of(s)[1] for s, x, y in zip(ids, xs, ys))


def held_by(unit, partition: str) -> set[str]:
    rows = ray.get(unit.recovery_view.remote()).partitions.get(partition)
    return set(rows.sample_ids) if rows else set()


def claim_all(client, partition: str) -> list[str]:
    """Every sample a task can claim now (all were committed before)."""
    claimed: list[str] = []
    while meta := client.claim_meta(partition, "t", ["x", "y"], 16, blocking=False):
        claimed += meta.sample_ids
    return claimed


def service(name: str, units: int, **extra):
    return start(
        DataPlaneConfig(
            name=name,
            num_storage_units=units,
            replicas=2,
            admin_enabled=False,
            unit_warm_reserve_bytes=0,
            liveness_interval_s=0.2,
            **extra,
        )
    )


def node_loss_during_writes(cluster, doomed_node) -> dict:
    out: dict = {}
    handle = service("rep-node", 3)
    client = handle.client()
    infos = [ray.get(u.ping.remote()) for u in handle.units]
    out["unit_nodes"] = len({i.node_id for i in infos})
    doomed = next(i.index for i in infos if i.node_id == doomed_node.node_id)
    total = BATCH * BATCHES
    client.register_partition("p", ["x", "y"], total, ["t"])
    committed: list[str] = []
    errors: list[str] = []

    def writer() -> None:
        own = handle.client()
        for b in range(BATCHES):
            ids = [f"s-{b * BATCH + i}" for i in range(BATCH)]
            try:
                put(own, "p", ids)
                committed.extend(ids)
            except Exception as e:  # noqa: BLE001 - recorded: the test expects none
                errors.append(repr(e))

    thread = threading.Thread(target=writer)
    thread.start()
    wait_until(lambda: len(committed) >= 4 * BATCH, 180, "the first puts")
    where = ray.get(handle.controller.lookup_units.remote("p", list(committed)))
    out["primaries_on_doomed_before"] = sum(u == doomed for u in where)
    out["copies_on_doomed_before"] = len(held_by(handle.units[doomed], "p"))
    cluster.remove_node(doomed_node)
    thread.join(timeout=300)
    out["writer_done"] = not thread.is_alive()
    out["put_errors"] = errors
    out["committed"] = len(committed)
    out["removed_after"] = out["primaries_on_doomed_before"]
    lost_seen = []
    try:
        out["readable_bit_for_bit"] = same_bytes(client, "p", committed)
    except SamplesLost as e:
        lost_seen = e.ids
        out["readable_bit_for_bit"] = False
    out["samples_lost_raised"] = lost_seen
    wait_until(
        lambda: not client.service_info().units[doomed].alive, 60, "the dead unit in service_info"
    )
    out["service_info_shows_dead"] = True
    where = ray.get(handle.controller.lookup_units.remote("p", committed))
    out["primaries_on_doomed_after"] = sum(u == doomed for u in where)
    claimed = claim_all(client, "p")
    out["claimed_all"] = sorted(claimed) == sorted(committed)
    detail = client.consumption_detail("p", ["t"])[0]
    out["lost_counted"] = detail.lost
    out["consumption_done"] = client.check_consumption_status("p", ["t"])
    out["paths"] = sorted({p.backend for p in client.service_info().payload_paths})
    handle.shutdown()
    return out


def unit_kill_after_restart(ckpt_dir: str) -> dict:
    out: dict = {}
    handle = service("rep-unit", 2)
    client = handle.client()
    client.register_partition("q", ["x", "y"], None, ["t"])
    ids = [f"q-{i}" for i in range(40)]
    put(client, "q", ids)
    copies = [held_by(u, "q") for u in handle.units]
    out["both_copies_held"] = all(set(ids) <= c for c in copies)
    # Clear removes both copies.
    cleared, kept = ids[:10], ids[10:]
    client.clear_samples(cleared, "q")
    copies = [held_by(u, "q") for u in handle.units]
    out["clear_removed_both"] = all(not (set(cleared) & c) for c in copies)
    # A checkpoint holds each sample once: restored into a one-copy service, it loads 30.
    client.checkpoint(ckpt_dir)
    plain = start(
        DataPlaneConfig(
            name="rep-plain", num_storage_units=2, admin_enabled=False, unit_warm_reserve_bytes=0
        )
    )
    out["checkpoint_samples"] = plain.client().restore(ckpt_dir)
    out["checkpoint_readable"] = same_bytes(plain.client(), "q", kept)
    plain.shutdown()
    # A controller restart rebuilds the second copies' units from what the units hold.
    ray.kill(handle.controller, no_restart=False)
    wait_until(lambda: _answers(client), 120, "the restarted controller")
    where = ray.get(handle.controller.lookup_units.remote("q", kept))
    victim = int(np.bincount(where).argmax())  # the unit holding most primaries now
    out["victim_primaries"] = int(np.bincount(where)[victim])
    ray.kill(handle.units[victim], no_restart=True)
    try:
        out["readable_after_kill"] = same_bytes(client, "q", kept)
        out["samples_lost_raised"] = []
    except SamplesLost as e:
        out["readable_after_kill"] = False
        out["samples_lost_raised"] = e.ids
    wait_until(
        lambda: not client.service_info().units[victim].alive, 60, "the dead unit in service_info"
    )
    out["claimed_all"] = sorted(claim_all(client, "q")) == sorted(kept)
    out["lost_counted"] = client.consumption_detail("q", ["t"])[0].lost
    # Writes go on: write-back of a new field to samples whose first copy died.
    client.put_samples(kept, "q", {"z": torch.ones(len(kept), 3)})
    out["write_back_after_kill"] = bool(
        client.get_samples(kept, "q", ["z"])["z"].sum().item() == 3 * len(kept)
    )
    handle.shutdown()
    return out


def _answers(client) -> bool:
    try:
        client.service_info()
        return True
    except DataPlaneError:
        return False


@ray.remote(num_cpus=0)
class Stager:
    """A writer that stages a replicated put's copies one call at a time, then is killed."""

    def __init__(self, name: str):
        self.client = connect(name, "dataplane")

    def stage(self, unit: int, ids: list[str], write_id: str) -> list[str]:
        from dataplane_client.client import _run_sync

        encoded = encode_fields({"x": torch.ones(len(ids), ROW)}, num_rows=len(ids))
        plan = {unit: np.arange(len(ids))}
        flow = self.client._transport.stage_flow("w", write_id, ids, encoded, plan)
        return [repr(r) for r in _run_sync(flow) if isinstance(r, BaseException)]


ROW = 1 << 18  # floats per row: 1 MiB, so staged bytes show in a unit's byte count


def writer_killed_between_stages(head_node_id: str) -> dict:
    out: dict = {}
    handle = service("rep-stage", 2, stage_ttl_s=600)  # only the writer's death reclaims in time
    client = handle.client()
    client.register_partition("w", ["x"])
    primary, replica = 0, 1
    units = handle.units
    baseline = [ray.get(u.metrics_snapshot.remote()).bytes for u in units]
    here = NodeAffinitySchedulingStrategy(head_node_id, soft=False)
    # Writer A staged its first copy and dies before the second; writer B staged both
    # copies and dies before its commit.
    first_only, both = (Stager.options(scheduling_strategy=here).remote("rep-stage") for _ in "ab")
    ids_a, ids_b = [f"a-{i}" for i in range(4)], [f"b-{i}" for i in range(4)]
    errors = ray.get(first_only.stage.remote(primary, ids_a, "write-a"))
    for more in ray.get([both.stage.remote(u, ids_b, "write-b") for u in (primary, replica)]):
        errors += more
    out["stage_errors"] = errors
    out["staged"] = [sorted(ray.get(u.staged_write_ids.remote())) for u in units]
    # A commit naming both copies of A while one is missing publishes neither.
    request = CommitRequest(
        partition_id="w",
        write_id="write-a",
        sample_ids=ids_a,
        units=[primary] * len(ids_a),
        schemas={"x": ("dense", "float32", (ROW,))},
        sequence_lengths=None,
        tags=None,
        overwrite=False,
        staged_units=[primary, replica],
        replicas=[replica] * len(ids_a),
    )
    try:
        ray.get(handle.controller.commit.remote(request))
        out["half_commit_refused"] = None
    except Exception as e:  # noqa: BLE001 - the class name is the observation
        out["half_commit_refused"] = type(getattr(e, "cause", e)).__name__
    out["visible_after_half_commit"] = [len(held_by(u, "w")) for u in units]
    ray.kill(first_only)
    ray.kill(both)
    wait_until(
        lambda: (
            [ray.get(u.metrics_snapshot.remote()).bytes for u in units] == baseline
            and not any(ray.get(u.staged_write_ids.remote()) for u in units)
        ),
        60,
        "the dead writers' stages to be reclaimed",
    )
    out["reclaimed_on_both"] = True
    out["read_of_unwritten"] = []
    for ids in (ids_a, ids_b):
        try:
            client.get_samples(ids[:1], "w", ["x"])
            out["read_of_unwritten"].append("readable")
        except DataPlaneError as e:
            out["read_of_unwritten"].append(type(e).__name__)
    handle.shutdown()
    return out


def run(cluster, doomed) -> dict:
    """On the head and two worker nodes; removes ``doomed`` (one of the workers)."""
    head = ray.get_runtime_context().get_node_id()
    out: dict = {}
    try:  # one unit sits on one node: two copies there would survive nothing
        start(DataPlaneConfig(name="rep-one", num_storage_units=1, replicas=2))
        out["one_node_refused"] = None
    except ConfigError as e:
        out["one_node_refused"] = str(e)
    out["node_loss"] = node_loss_during_writes(cluster, doomed)
    with tempfile.TemporaryDirectory() as tmp:
        out["unit_kill"] = unit_kill_after_restart(os.path.join(tmp, "ckpt"))
    out["stages"] = writer_killed_between_stages(head)
    return out
