"""A same-node reader never maps the wrong chunk, however a clear races its read.

A reader learns where rows live (``read_shm``), then opens the unit's chunk by
``/proc/<unit pid>/fd/<n>``. Between the two a writer may clear those rows and
put new ones, and the kernel hands the freed descriptor number to the new
chunk. An injected delay between locate and open (the ``CHUNK_OPEN`` failpoint)
widens that window; every row read must still hold the bytes written for its own
sample id.
"""

import contextlib
import threading
import time
import zlib

import pytest
import ray
import torch

from dataplane_client import DataPlaneConfig, connect
from dataplane_client.wire import failpoints, shm
from dataplane_client.wire.errors import SamplesNotFound
from dataplane_client.wire.messages import read_request, unpack_read_answer
from dataplane_server import start

ROW_INTS = 4096  # 16 KiB per row
BATCH = 8
KEEP_BATCHES = 1  # the writer clears a batch as soon as it has put the next one
ROWS_TO_READ = 20_000
# A bound on a hang, not a speed target: about 60 s on an idle 2-core machine,
# several times that when CI runs other tests beside it.
DEADLINE_S = 280


def churner_class():
    """The writer actor, built here so Ray ships it by value (workers cannot import tests)."""

    def batch_rows(ids: list[str]) -> torch.Tensor:
        values = [zlib.crc32(s.encode()) & 0x7FFFFFFF for s in ids]
        return torch.tensor(values, dtype=torch.int32)[:, None].repeat(1, ROW_INTS)

    @ray.remote(max_concurrency=2)
    class Churner:
        """Puts batches of 8 rows and clears old ones until told to stop."""

        def __init__(self, name: str, namespace: str, partition: str):
            self.client = connect(name, namespace)
            self.partition = partition
            self.stopped = threading.Event()

        def run(self) -> int:
            batch = 0
            while not self.stopped.is_set():
                ids = [f"b{batch}-{i}" for i in range(BATCH)]
                self.client.put_samples(ids, self.partition, {"x": batch_rows(ids)})
                old = batch - KEEP_BATCHES
                if old >= 0:
                    self.client.clear_samples([f"b{old}-{i}" for i in range(BATCH)], self.partition)
                batch += 1
            return batch

        def stop(self) -> None:
            self.stopped.set()

    return Churner, batch_rows


@pytest.fixture
def at_chunk_open():
    """Runs an action at this process's ``CHUNK_OPEN`` failpoint until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda action: stack.enter_context(failpoints.run_at(failpoints.CHUNK_OPEN, action))


@pytest.fixture
def churn_service(ray_session):
    handle = start(DataPlaneConfig(name="dp-identity", num_storage_units=1, admin_enabled=False))
    yield handle
    handle.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_put_clear_churn_with_delayed_open_reads_zero_wrong_rows(churn_service, at_chunk_open):
    opened = []

    def delay_before_open(path: str) -> None:
        opened.append(path)
        time.sleep(0.002)  # injected delay between locate and open, not synchronisation

    at_chunk_open(delay_before_open)
    reader = churn_service.client()
    assert reader._transport.shared == [True]  # the same-node mapping path is under test
    pid = "churn"
    reader.register_partition(pid, fields=["x"], consumer_tasks=["reader"])
    churner, batch_rows = churner_class()
    writer = churner.remote(churn_service.config.name, churn_service.config.namespace, pid)
    batches = writer.run.remote()
    read = wrong = vanished = 0
    deadline = time.monotonic() + DEADLINE_S
    try:
        while read < ROWS_TO_READ and time.monotonic() < deadline:
            meta = reader.claim_meta(pid, "reader", ["x"], BATCH, timeout_s=30)
            try:
                got = reader.get_data(meta)["x"]
            except SamplesNotFound:
                vanished += meta.size  # cleared before we read: a typed error, never bytes
                continue
            want = batch_rows(meta.sample_ids)
            wrong += int((got != want).any(dim=1).sum())
            read += meta.size
    finally:
        ray.get(writer.stop.remote())
        written = ray.get(batches, timeout=60)
        ray.kill(writer)
    print(
        f"rows read {read}, wrong {wrong}, cleared before read {vanished}, "
        f"batches written {written}, chunk opens {len(opened)}"
    )
    assert opened, "reads went through the shared-memory path"
    assert read >= ROWS_TO_READ, f"only {read} rows read in {DEADLINE_S}s"
    assert wrong == 0


@pytest.fixture
def one_unit(ray_session):
    """One unit and no warm reserve: a freed descriptor number goes to the next block made."""
    handle = start(
        DataPlaneConfig(
            name="dp-reuse", num_storage_units=1, unit_warm_reserve_bytes=0, admin_enabled=False
        )
    )
    yield handle
    handle.shutdown()


def _batch(tag: str, value: int) -> tuple[list[str], torch.Tensor]:
    return [f"{tag}{i}" for i in range(BATCH)], torch.full((BATCH, ROW_INTS), value)


def _read_shm(service, ids: list[str]) -> dict:
    """Where unit 0 holds these rows of field x (its same-node read answer)."""
    return unpack_read_answer(
        ray.get(service.units[0].read_shm.remote(read_request("p", ids, ["x"])))
    )


def test_a_reader_never_maps_a_slab_whose_descriptor_went_to_another(one_unit):
    client = one_unit.client()
    client.register_partition("p", fields=["x"])
    old_ids, old_rows = _batch("old", 1)
    client.put_samples(old_ids, "p", {"x": old_rows})
    (located,) = _read_shm(one_unit, old_ids).values()
    client.clear_samples(old_ids, "p")  # the slab empties and is freed
    new_ids, new_rows = _batch("new", 2)
    client.put_samples(new_ids, "p", {"x": new_rows})
    (now,) = _read_shm(one_unit, new_ids).values()
    assert now.chunks[0].path == located.chunks[0].path  # the hazard: same descriptor number
    with pytest.raises(shm.ChunkChanged):
        shm.map_private(located.chunks[0], int(located.starts[0]), int(located.ends[-1]))
    with pytest.raises(SamplesNotFound):  # the client's fallback re-reads through Ray
        client.get_samples(old_ids, "p", ["x"])
    assert torch.equal(client.get_samples(new_ids, "p", ["x"])["x"], new_rows)


def test_a_writer_whose_stage_was_reclaimed_never_writes_into_another_chunk(
    one_unit, at_chunk_open
):
    """Between alloc and copy the unit drops the stage (as an expiry would) and another
    put takes the descriptor: the writer must not copy into that chunk."""
    client = one_unit.client()
    client.register_partition("p", fields=["x"])
    other_ids, other_rows = _batch("other", 7)
    mine_ids, mine_rows = _batch("mine", 9)
    raced = []

    def reclaim_then_reuse(path: str) -> None:
        if raced:
            return
        raced.append(path)
        (write_id,) = ray.get(one_unit.units[0].staged_write_ids.remote())
        ray.get(one_unit.units[0].discard.remote(write_id))
        client.put_samples(other_ids, "p", {"x": other_rows})

    at_chunk_open(reclaim_then_reuse)
    client.put_samples(mine_ids, "p", {"x": mine_rows})  # staged again after the race
    (now,) = _read_shm(one_unit, other_ids).values()
    assert raced
    assert now.chunks[0].path == raced[0]
    assert torch.equal(client.get_samples(other_ids, "p", ["x"])["x"], other_rows)
    assert torch.equal(client.get_samples(mine_ids, "p", ["x"])["x"], mine_rows)
