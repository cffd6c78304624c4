"""Direct reads: a get whose rows' (unit, generation) are known skips the controller.

A claim's meta carries each row's unit and generation (the commit that last wrote
it); a client remembers them from its own puts and gets. The unit serves a direct
read only while it holds every row at the generation named, else the client asks the
controller (``locate``), whose answer is the truth. Checked here: the unit's check
(no Ray), the round trips saved (the controller's ``locates_total``), and that a
direct read racing an overwrite, a clear, a re-registration or a unit's death never
returns wrong data nor a spurious error.
"""

import asyncio

import pytest
import ray
import torch

from dataplane_client.codec.fields import encode_fields
from dataplane_client.wire import failpoints
from dataplane_client.wire.errors import InvalidBatch, RouteChanged, SamplesLost, SamplesNotFound
from dataplane_client.wire.meta import KVBatchMeta
from dataplane_client.wire.routes import ROUTES_KEY, hinted
from dataplane_server.core.recovery_messages import SampleMeta
from dataplane_server.core.unit.store import UnitStore

WIDE = 40_000  # float32 values a row: 160 KB, above the inline-read size (mapped reads)


def _store() -> UnitStore:
    return UnitStore(
        0,
        64 << 20,
        put_wait_timeout_s=1.0,
        use_shm=True,
        warm_reserve_bytes=0,
        stage_ttl_s=30.0,
    )


def _publish(store: UnitStore, ids: list[str], value: float, seq: int) -> None:
    enc = encode_fields({"x": torch.full((len(ids), 4), value)})
    asyncio.run(store.stage("p", f"w{seq}", ids, enc))
    store.publish(f"w{seq}", SampleMeta(seq))


# ---- the unit's generation check (no Ray) ---------------------------------------------
def test_a_unit_serves_a_direct_read_only_at_the_generation_asked_for():
    store = _store()
    _publish(store, ["a", "b"], 1.0, seq=7)
    got = store.read("p", ["a", "b"], ["x"], expect=[7, 7])
    assert got["x"].num_rows == 2
    assert store.read_shm("p", ["b"], ["x"], None, [7])["x"].num_rows == 1
    with pytest.raises(RouteChanged):
        store.read("p", ["a"], ["x"], expect=[6])  # not the write the reader meant
    _publish(store, ["a"], 2.0, seq=9)  # an overwrite: a new generation
    with pytest.raises(RouteChanged):
        store.read_shm("p", ["a", "b"], ["x"], None, [7, 7])
    assert store.read("p", ["a", "b"], ["x"], expect=[9, 7])["x"].num_rows == 2
    store.clear("p", ["a"])
    with pytest.raises(RouteChanged):
        store.read("p", ["a"], ["x"], expect=[9])  # cleared
    with pytest.raises(RouteChanged):
        store.read("other", ["b"], ["x"], expect=[7])  # no such partition here
    # Without generations (the controller located the read) nothing is checked.
    assert store.read("p", ["b"], ["x"])["x"].num_rows == 1
    assert store.stats.snapshot()["counters"]["direct_read_misses_total"] == 4
    store.close()


def test_hints_name_every_row_or_none_and_refuse_what_is_not_hints():
    meta = KVBatchMeta(
        "p", None, ["a", "b"], extra_info={ROUTES_KEY: {"codecs_key": "k", "rows": {"a": (1, 5)}}}
    )
    assert hinted(meta.extra_info, ["a"])[0] == "k"
    assert hinted(meta.extra_info, ["a", "b"]) is None  # "b" has none: read through locate
    assert hinted({}, ["a"]) is None  # a meta built by hand
    with pytest.raises(InvalidBatch, match=ROUTES_KEY):
        hinted({ROUTES_KEY: [1, 2]}, ["a"])
    with pytest.raises(InvalidBatch, match="generation"):
        hinted({ROUTES_KEY: {"codecs_key": "k", "rows": {"a": "x"}}}, ["a"])


# ---- round trips, on the session's service (two units) ----------------------------------
def _locates(service) -> float:
    snap = ray.get(service.controller.metrics_snapshot.remote())
    return snap.stats["counters"].get("locates_total", 0)


def _rows(n: int, first: float, width: int = WIDE) -> dict:
    return {"x": torch.arange(first, first + n).repeat_interleave(width).reshape(n, width)}


def test_a_claimed_meta_is_read_straight_from_the_units(service, client):
    client.register_partition("direct-claim", fields=["x"], consumer_tasks=["t"])
    ids = [f"s{i}" for i in range(8)]
    client.put_samples(ids, "direct-claim", _rows(8, 0.0))
    meta = client.claim_meta("direct-claim", "t", ["x"], batch_size=8)
    assert set(meta.extra_info[ROUTES_KEY]["rows"]) == set(meta.sample_ids)
    reader = service.client()  # another process's client would know no routes either
    before = _locates(service)
    shard = meta.subset([5, 1, 6])  # a DP shard of the claim keeps its hints
    got = reader.get_data(shard)["x"]
    assert _locates(service) == before, "a claimed meta's get asked the controller"
    want = torch.tensor([5.0, 1.0, 6.0]).repeat_interleave(WIDE).reshape(3, WIDE)
    assert torch.equal(got, want)
    # A meta without hints (built by hand) still reads, through the controller.
    bare = KVBatchMeta("direct-claim", None, list(shard.sample_ids), fields=["x"])
    assert torch.equal(service.client().get_data(bare)["x"], want)
    assert _locates(service) == before + 1


def test_a_client_reads_ids_it_wrote_or_read_without_the_controller(service, client):
    client.register_partition("direct-ids", fields=["x"])
    ids = [f"s{i}" for i in range(4)]
    client.put_samples(ids, "direct-ids", _rows(4, 10.0, width=4))
    before = _locates(service)
    got = client.get_samples(["s3", "s0"], "direct-ids", ["x"])["x"]
    assert torch.equal(got[:, 0], torch.tensor([13.0, 10.0]))
    assert _locates(service) == before
    reader = service.client()
    reader.get_samples(ids, "direct-ids", ["x"])  # located once: now remembered
    reader.get_samples(ids[:2], "direct-ids", ["x"])
    assert _locates(service) == before + 1


def _direct_read_misses(service) -> float:
    snaps = ray.get([u.metrics_snapshot.remote() for u in service.units])
    return sum(s.stats["counters"].get("direct_read_misses_total", 0) for s in snaps)


def test_a_reader_of_ids_others_keep_rewriting_stops_trying_its_stale_routes(service, client):
    """Each refused direct read costs a round trip before ``locate``: after a refusal the
    partition's next gets go to the controller at once, for longer after each refusal in
    a row, so 20 reads of rewritten ids pay 5 refusals, not 20."""
    client.register_partition("direct-rewritten", fields=["x"])
    ids = ["a"]  # one unit: one refusal per get
    client.put_samples(ids, "direct-rewritten", _rows(1, 0.0, width=4))
    reader = service.client()
    reader.get_samples(ids, "direct-rewritten", ["x"])  # located: its routes now cached
    before = _direct_read_misses(service)
    for i in range(1, 21):
        client.put_samples(ids, "direct-rewritten", _rows(1, float(i), width=4), overwrite=True)
        got = reader.get_samples(ids, "direct-rewritten", ["x"])["x"]
        assert torch.equal(got, _rows(1, float(i), width=4)["x"]), f"read {i}"
    assert _direct_read_misses(service) - before == 5  # reads 1, 3, 6, 11 and 20 tried
    # Rows nobody rewrites any more are read straight from the units again once a try
    # succeeds (the locates in between remembered fresh routes).
    locates = _locates(service)
    for _ in range(40):
        reader.get_samples(ids, "direct-rewritten", ["x"])
    assert _locates(service) - locates == 16  # the 16 skips the last refusal left


# ---- hazards: never wrong data, never a spurious error -----------------------------------
def test_a_remembered_route_after_an_overwrite_reads_the_new_bytes(service, client):
    client.register_partition("direct-overwrite", fields=["x"])
    client.put_samples(["a"], "direct-overwrite", _rows(1, 1.0))
    other = service.client()
    other.put_samples(["a"], "direct-overwrite", _rows(1, 2.0), overwrite=True)
    before = _locates(service)
    got = client.get_samples(["a"], "direct-overwrite", ["x"])["x"]
    assert torch.equal(got, _rows(1, 2.0)["x"])
    assert _locates(service) == before + 1  # the unit refused the old generation


def test_a_remembered_route_after_a_re_registration_decodes_with_the_new_codecs(service, client):
    """The same id re-put on the same unit under another vocabulary: served at the old
    route, its codes would decode as the wrong strings with the reader's cached codecs."""
    client.register_partition("direct-enums", fields=["c"], enums={"c": ["red", "blue"]})
    client.put_samples(["a"], "direct-enums", {"c": ["red"]})
    assert client.get_samples(["a"], "direct-enums", ["c"])["c"] == ["red"]
    other = service.client()
    other.register_partition("direct-enums", fields=["c"], enums={"c": ["blue", "red"]})
    other.put_samples(["a"], "direct-enums", {"c": ["blue"]})  # code 0: "red" to the old codecs
    assert client.get_samples(["a"], "direct-enums", ["c"])["c"] == ["blue"]


def test_a_direct_read_racing_an_overwrite_returns_one_whole_version(service, client):
    client.register_partition("direct-race-write", fields=["x"])
    client.put_samples(["a", "b"], "direct-race-write", _rows(2, 1.0))
    other = service.client()
    raced = []

    def overwrite_now(path):  # the unit has answered; the reader is about to map
        if not raced:
            raced.append(path)
            other.put_samples(["a", "b"], "direct-race-write", _rows(2, 5.0), overwrite=True)

    with failpoints.run_at(failpoints.CHUNK_OPEN, overwrite_now):
        got = client.get_samples(["a", "b"], "direct-race-write", ["x"])["x"]
    assert raced, "the failpoint never fired: the read did not map a chunk"
    assert torch.equal(got, _rows(2, 1.0)["x"]) or torch.equal(got, _rows(2, 5.0)["x"])
    assert torch.equal(
        client.get_samples(["a", "b"], "direct-race-write", ["x"])["x"], _rows(2, 5.0)["x"]
    )


def test_a_direct_read_racing_a_clear_reads_before_it_and_after_it_says_not_found(service, client):
    client.register_partition("direct-race-clear", fields=["x"])
    client.put_samples(["a"], "direct-race-clear", _rows(1, 3.0))
    other = service.client()
    raced = []

    def clear_now(path):
        if not raced:
            raced.append(path)
            other.clear_samples(["a"], "direct-race-clear")

    with failpoints.run_at(failpoints.CHUNK_OPEN, clear_now):
        got = client.get_samples(["a"], "direct-race-clear", ["x"])["x"]
    assert raced
    assert torch.equal(got, _rows(1, 3.0)["x"])  # the lease kept the bytes it was told of
    with pytest.raises(SamplesNotFound):
        client.get_samples(["a"], "direct-race-clear", ["x"])


def test_a_direct_read_of_rows_with_no_copy_left_is_samples_lost(service_factory):
    handle = service_factory("dp-direct-lost", num_storage_units=2)
    client = handle.client()
    client.register_partition("p", fields=["x"])
    ids = [f"s{i}" for i in range(6)]
    client.put_samples(ids, "p", _rows(6, 0.0, width=8))
    units = ray.get(handle.controller.lookup_units.remote("p", ids))
    ray.kill(handle.units[units[0]], no_restart=True)
    # The client's remembered route names a dead unit: it falls back to the controller,
    # which says the rows are lost (typed), rather than a Ray error or a hang.
    with pytest.raises(SamplesLost):
        client.get_samples(ids, "p", ["x"])
