"""The gRPC admin endpoint, spoken to by real gRPC clients over loopback.

The shared service's own endpoint answers every AdminService RPC, the standard
health check and reflection. Auth, TLS and drain get their own servers (an
in-process AdminServer or an AdminActor) pointed at the same controller, so the
shared endpoint's settings stay untouched.
"""

from __future__ import annotations

import time
import uuid

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tls_certs import self_signed

from dataplane_client.wire.config import DataPlaneConfig
from dataplane_server.admin_pb import admin_pb2, admin_pb2_grpc

ADMIN_SERVICE = "dataplane.admin.v1.AdminService"
TOKEN = "s3cret-token"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TIMEOUT = 10


def _pid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _filled(client, prefix: str, ids: list[str], **register) -> str:
    """A fresh partition (field "x") holding ``ids``, 4 ones each."""
    pid = _pid(prefix)
    client.register_partition(pid, fields=["x"], **register)
    client.put_samples(ids, pid, {"x": torch.ones(len(ids), 4)})
    return pid


def _listed(stub) -> set[str]:
    """The partitions ListPartitions names."""
    listed = stub.ListPartitions(admin_pb2.ListPartitionsRequest(), timeout=TIMEOUT).partitions
    return {p.partition_id for p in listed}


def _code(call, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=TIMEOUT, **kwargs)
    return info.value.code()


@pytest.fixture(scope="module")
def channel(service):
    ch = grpc.insecure_channel(service.admin_address)
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def stub(channel):
    return admin_pb2_grpc.AdminServiceStub(channel)


@pytest.fixture(scope="module")
def filled(client):
    """A partition with 7 samples: 2 consumed by "train", 4 ready, 1 missing its "score"."""
    pid = _pid("admin")
    client.register_partition(
        pid,
        fields=["input_ids", "score", "prompt"],
        consumer_tasks=["train"],
        object_fields=["prompt"],
    )
    ids = [f"s{i}" for i in range(6)]
    client.put_samples(
        ids,
        pid,
        {
            "input_ids": [torch.arange(10 + i, dtype=torch.int64) for i in range(6)],
            "score": torch.arange(6, dtype=torch.float32) / 4,
            "prompt": [f"prompt {i}" for i in range(6)],
        },
        tags=[{"step": 3, "group": i // 2} for i in range(6)],
    )
    client.put_samples(["s6"], pid, {"input_ids": [torch.arange(4)], "prompt": ["late"]})
    meta = client.claim_meta(pid, "train", ["input_ids", "score"], 2, timeout_s=10)
    assert meta is not None
    assert meta.size == 2
    return {"pid": pid, "ids": ids + ["s6"], "consumed": set(meta.sample_ids)}


@pytest.fixture
def no_env_token(monkeypatch):
    monkeypatch.delenv("DATAPLANE_ADMIN_TOKEN", raising=False)


def _local_server(service, **overrides):
    """An AdminServer in this process, on a free loopback port, over the shared controller."""
    from dataplane_server.admin.server import AdminServer
    from dataplane_server.admin.sources import ActorSources

    cfg = DataPlaneConfig(
        name=service.config.name,
        namespace=service.config.namespace,
        admin_host="127.0.0.1",
        admin_port=0,
        **overrides,
    )
    server = AdminServer(cfg, ActorSources(cfg.name, cfg.namespace))
    server.start()
    return server


# ------------------------------------------------------------------ health, reflection


def test_health_reports_serving_for_server_and_admin_service(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", ADMIN_SERVICE):
        got = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT)
        assert got.status == SERVING


def test_reflection_lists_admin_and_health_and_serves_the_schema(channel):
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=ADMIN_SERVICE),
    ]
    listed, schema = list(refl.ServerReflectionInfo(iter(requests), timeout=TIMEOUT))
    names = {s.name for s in listed.list_services_response.service}
    assert {ADMIN_SERVICE, "grpc.health.v1.Health"} <= names
    files = schema.file_descriptor_response.file_descriptor_proto
    assert any(b"dataplane/admin/v1/admin.proto" in f for f in files)


# ------------------------------------------------------------------------- every RPC


def test_get_service_info(stub, service):
    info = stub.GetServiceInfo(admin_pb2.GetServiceInfoRequest(), timeout=TIMEOUT)
    assert info.name == service.config.name
    assert info.namespace == service.config.namespace
    assert info.version
    assert info.uptime_s > 0
    assert info.started_at > 0
    assert not info.draining
    assert [u.index for u in info.units] == [0, 1]
    assert all(u.alive and u.node_id and u.node_ip for u in info.units)
    assert info.capacity_bytes == 2 * service.config.unit_capacity_bytes


def test_list_partitions(stub, filled):
    rows = stub.ListPartitions(admin_pb2.ListPartitionsRequest(), timeout=TIMEOUT).partitions
    (row,) = [p for p in rows if p.partition_id == filled["pid"]]
    assert row.num_samples == 7
    assert row.bytes > 0
    assert set(row.fields) == {"input_ids", "score", "prompt"}
    assert list(row.consumer_tasks) == ["train"]


def test_describe_partition(stub, filled):
    d = stub.DescribePartition(
        admin_pb2.DescribePartitionRequest(partition_id=filled["pid"]), timeout=TIMEOUT
    )
    assert d.num_samples == 7
    assert not d.HasField("expected_samples")
    assert not d.HasField("group_size")
    fields = {f.name: f for f in d.fields}
    assert (fields["input_ids"].dtype, fields["input_ids"].layout) == (
        "int64",
        admin_pb2.LAYOUT_JAGGED,
    )
    assert (fields["score"].dtype, fields["score"].layout) == ("float32", admin_pb2.LAYOUT_DENSE)
    assert fields["prompt"].layout == admin_pb2.LAYOUT_OBJECT
    assert {n: f.produced for n, f in fields.items()} == {"input_ids": 7, "score": 6, "prompt": 7}
    assert [(c.task, c.consumed) for c in d.consumption] == [("train", 2)]
    assert d.pending_claims == 0
    assert sorted(b.unit for b in d.bytes_per_unit) == [0, 1]
    assert sum(b.bytes for b in d.bytes_per_unit) > 0


def test_describe_a_versioned_partition_shows_its_async_rl_state(stub, client, filled):
    from dataplane_client import StalenessSpec

    pid = _pid("admin-async")
    spec = StalenessSpec(max_staleness=0, stale_samples="keep", admission_batch=2)
    client.register_partition(pid, fields=["x"], consumer_tasks=["train"], staleness=spec)
    client.put_samples(["a", "b"], pid, {"x": torch.zeros(2)}, tags=[{"weight_version": 0}] * 2)
    client.set_policy_version(pid, 1)
    d = stub.DescribePartition(
        admin_pb2.DescribePartitionRequest(partition_id=pid), timeout=TIMEOUT
    )
    assert d.HasField("staleness")
    st = d.staleness
    assert (st.version, st.version_tag, st.stale_samples) == (1, "weight_version", "keep")
    assert dict(st.max_staleness) == {"train": 0}
    assert dict(st.ready_by_version) == {0: 2}
    assert (st.untrained, st.admission_limit, st.evicted) == (0, 2, 0)  # kept, but stale
    plain = stub.DescribePartition(
        admin_pb2.DescribePartitionRequest(partition_id=filled["pid"]), timeout=TIMEOUT
    )
    assert not plain.HasField("staleness")


def test_unknown_partition_is_not_found_and_names_it(stub):
    with pytest.raises(grpc.RpcError) as info:
        stub.DescribePartition(
            admin_pb2.DescribePartitionRequest(partition_id="no-such-partition"), timeout=TIMEOUT
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "UnknownPartition" in info.value.details()
    assert "no-such-partition" in info.value.details()


def test_missing_partition_id_is_invalid_argument(stub):
    assert _code(stub.DescribePartition, admin_pb2.DescribePartitionRequest()) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


def test_list_samples_pages_through_everything_once(stub, filled):
    seen, token, pages = [], "", 0
    while True:
        page = stub.ListSamples(
            admin_pb2.ListSamplesRequest(partition_id=filled["pid"], page_size=3, page_token=token),
            timeout=TIMEOUT,
        )
        assert page.total == 7
        seen += [s.sample_id for s in page.samples]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert pages == 3
    assert sorted(seen) == sorted(filled["ids"])


def test_list_samples_filters_by_status(stub, filled):
    def ids(status):
        page = stub.ListSamples(
            admin_pb2.ListSamplesRequest(partition_id=filled["pid"], status=status), timeout=TIMEOUT
        )
        assert page.total == len(page.samples)
        assert not page.next_page_token
        return {s.sample_id for s in page.samples}

    assert ids(admin_pb2.SAMPLE_STATUS_CONSUMED) == filled["consumed"]
    assert ids(admin_pb2.SAMPLE_STATUS_PENDING) == {"s6"}
    assert ids(admin_pb2.SAMPLE_STATUS_READY) == set(filled["ids"][:6]) - filled["consumed"]
    assert ids(admin_pb2.SAMPLE_STATUS_LOST) == set()


def test_list_samples_rejects_a_forged_page_token(stub, filled):
    request = admin_pb2.ListSamplesRequest(partition_id=filled["pid"], page_token="../../etc")
    assert _code(stub.ListSamples, request) == grpc.StatusCode.INVALID_ARGUMENT


def test_get_sample_status_and_preview(stub, filled):
    got = stub.GetSample(
        admin_pb2.GetSampleRequest(partition_id=filled["pid"], sample_id="s2", max_elems=5),
        timeout=TIMEOUT,
    )
    s = got.sample
    assert s.sample_id == "s2"
    assert not s.lost
    assert set(s.fields) == {"input_ids", "score", "prompt"}
    assert s.sequence_length == 12
    assert dict(s.tags) == {"step": 3.0, "group": 1.0}
    previews = {p.name: p for p in got.previews}
    ids = previews["input_ids"]
    assert (ids.dtype, ids.layout, list(ids.shape)) == ("int64", admin_pb2.LAYOUT_JAGGED, [12])
    assert [v.number_value for v in ids.values.values] == [0, 1, 2, 3, 4]
    assert ids.truncated
    assert [v.number_value for v in previews["score"].values.values] == [0.5]
    assert not previews["score"].truncated
    assert [v.string_value for v in previews["prompt"].values.values] == ["prompt 2"]


def test_get_sample_selected_fields_and_unknown_sample(stub, filled):
    got = stub.GetSample(
        admin_pb2.GetSampleRequest(partition_id=filled["pid"], sample_id="s0", fields=["score"]),
        timeout=TIMEOUT,
    )
    assert [p.name for p in got.previews] == ["score"]
    with pytest.raises(grpc.RpcError) as info:
        stub.GetSample(
            admin_pb2.GetSampleRequest(
                partition_id=filled["pid"], sample_id="s6", fields=["input_ids", "score"]
            ),
            timeout=TIMEOUT,
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "FieldNotProduced" in info.value.details()
    assert "'score'" in info.value.details()
    request = admin_pb2.GetSampleRequest(partition_id=filled["pid"], sample_id="nope")
    assert _code(stub.GetSample, request) == grpc.StatusCode.NOT_FOUND


def test_watch_stats_streams_count_snapshots(stub, filled):
    snaps = list(
        stub.WatchStats(admin_pb2.WatchStatsRequest(interval_s=0.05, count=3), timeout=TIMEOUT)
    )
    assert len(snaps) == 3
    assert snaps[0].timestamp <= snaps[1].timestamp <= snaps[2].timestamp
    last = snaps[-1]
    (mine,) = [p for p in last.partitions if p.partition_id == filled["pid"]]
    assert mine.num_samples == 7
    assert mine.bytes > 0
    assert last.put_bytes_total > 0
    assert last.put_requests_total > 0
    assert [u.index for u in last.units] == [0, 1]
    assert all(u.alive for u in last.units)


def test_watch_stats_rejects_negative_interval(stub):
    request = admin_pb2.WatchStatsRequest(interval_s=-1)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.WatchStats(request, timeout=TIMEOUT))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("rpc", "request_type", "count"),
    [
        ("ClearPartition", admin_pb2.ClearPartitionRequest, "cleared_samples"),
        ("DeletePartition", admin_pb2.DeletePartitionRequest, "deleted_samples"),
    ],
)
def test_clearing_or_deleting_a_whole_partition_without_token_on_loopback_removes_it(
    rpc, request_type, count, stub, client, no_env_token
):
    pid = _filled(client, f"admin-{rpc}", ["a", "b", "c"], consumer_tasks=["train"])
    call = getattr(stub, rpc)
    got = call(request_type(partition_id=pid), timeout=TIMEOUT)
    assert (got.partition_id, getattr(got, count)) == (pid, 3)
    assert got.bytes_freed > 0
    # Clearing a whole partition deletes it (the NeMo-RL contract of clear_samples(None, p)).
    assert pid not in _listed(stub)
    request = admin_pb2.ListSamplesRequest(partition_id=pid)
    assert _code(stub.ListSamples, request) == grpc.StatusCode.NOT_FOUND
    assert _code(call, request_type(partition_id=pid)) == grpc.StatusCode.NOT_FOUND
    assert _code(call, request_type(partition_id="no-such-partition")) == (
        grpc.StatusCode.NOT_FOUND
    )
    assert _code(call, request_type()) == grpc.StatusCode.INVALID_ARGUMENT


def test_clear_partition_with_sample_ids_drops_only_those(stub, client, no_env_token):
    pid = _filled(client, "admin-clear-ids", ["a", "b", "c"])
    request = admin_pb2.ClearPartitionRequest(partition_id=pid, sample_ids=["a", "c"])
    got = stub.ClearPartition(request, timeout=TIMEOUT)
    assert got.cleared_samples == 2
    page = stub.ListSamples(admin_pb2.ListSamplesRequest(partition_id=pid), timeout=TIMEOUT)
    assert [s.sample_id for s in page.samples] == ["b"]
    duplicated = admin_pb2.ClearPartitionRequest(partition_id=pid, sample_ids=["b", "b"])
    assert _code(stub.ClearPartition, duplicated) == grpc.StatusCode.INVALID_ARGUMENT
    unknown = admin_pb2.ClearPartitionRequest(partition_id=pid, sample_ids=["zz"])
    assert _code(stub.ClearPartition, unknown) == grpc.StatusCode.NOT_FOUND
    assert client.describe_partition(pid).num_samples == 1


def test_redeliveries_are_shown_per_sample_and_per_task(stub, client):
    """A leased claim that runs out is handed out again; the admin API counts it."""
    pid = _filled(
        client, "admin-lease", ["a", "b"], consumer_tasks=["train"], task_leases={"train": 0.3}
    )
    first = client.claim_meta(pid, "train", ["x"], 1, timeout_s=10)
    assert first is not None
    # Not acknowledged: once the lease runs out the same sample is claimable again.
    deadline = time.monotonic() + 30
    again = None
    while again is None or first.sample_ids[0] not in again.sample_ids:
        assert time.monotonic() < deadline, "the expired lease was never redelivered"
        again = client.claim_meta(pid, "train", ["x"], 2, timeout_s=2)
    page = stub.ListSamples(admin_pb2.ListSamplesRequest(partition_id=pid), timeout=TIMEOUT)
    counts = {s.sample_id: s.redeliveries for s in page.samples}
    assert counts[first.sample_ids[0]] == 1
    got = stub.GetSample(
        admin_pb2.GetSampleRequest(partition_id=pid, sample_id=first.sample_ids[0]),
        timeout=TIMEOUT,
    )
    assert got.sample.redeliveries == 1
    d = stub.DescribePartition(
        admin_pb2.DescribePartitionRequest(partition_id=pid), timeout=TIMEOUT
    )
    (train,) = d.consumption
    assert train.task == "train"
    assert train.HasField("lease_s")
    assert train.lease_s == pytest.approx(0.3)
    assert train.redeliveries >= 1
    assert train.total == 2


@pytest.mark.parametrize(
    "request_",
    [
        admin_pb2.ListSamplesRequest(partition_id="p", page_token="\u00b2"),  # isdigit() is True
        admin_pb2.ListSamplesRequest(partition_id="p", page_token="9" * 5000),
        admin_pb2.ListSamplesRequest(partition_id="p", page_token="-1"),
        admin_pb2.ListSamplesRequest(partition_id="p", page_size=-1),
        admin_pb2.ListSamplesRequest(partition_id="p", status=99),
        admin_pb2.ListSamplesRequest(),
        admin_pb2.GetSampleRequest(partition_id="p", sample_id="s", max_elems=-1),
        admin_pb2.GetSampleRequest(partition_id="p"),
        admin_pb2.ClearPartitionRequest(sample_ids=["a"]),
        admin_pb2.DeletePartitionRequest(),
    ],
    ids=lambda r: f"{type(r).__name__}({str(r).strip()[:30]!r})",
)
def test_malformed_arguments_are_invalid_argument(stub, request_):
    name = type(request_).__name__.removesuffix("Request")
    # Checked before the partition is looked up: "p" need not exist.
    assert _code(getattr(stub, name), request_) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("interval", [float("nan"), float("inf"), -1.0, 1e9])
def test_watch_stats_rejects_bad_intervals(stub, interval):
    with pytest.raises(grpc.RpcError) as info:
        list(
            stub.WatchStats(
                admin_pb2.WatchStatsRequest(interval_s=interval, count=2), timeout=TIMEOUT
            )
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_watch_stream_ends_unavailable_when_the_server_stops(service):
    """A watcher must be able to tell "the server went away" from "all snapshots sent"."""
    server = _local_server(service)
    ch = grpc.insecure_channel(server.address)
    try:
        stream = admin_pb2_grpc.AdminServiceStub(ch).WatchStats(
            admin_pb2.WatchStatsRequest(interval_s=0.05), timeout=TIMEOUT
        )
        next(stream)  # streaming
        server.stop(grace_s=5)
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        ch.close()
        server.stop(grace_s=0)


def test_oversized_request_is_refused(stub, service):
    huge = "x" * (service.config.admin_max_request_bytes + 1024)
    request = admin_pb2.DescribePartitionRequest(partition_id=huge)
    assert _code(stub.DescribePartition, request) == grpc.StatusCode.RESOURCE_EXHAUSTED


# ------------------------------------------------------------------------------- auth


@pytest.fixture(scope="module")
def secured(service):
    server = _local_server(service, admin_token=TOKEN)
    ch = grpc.insecure_channel(server.address)
    yield admin_pb2_grpc.AdminServiceStub(ch)
    ch.close()
    server.stop(grace_s=0)


def test_token_guards_every_rpc_with_data_but_service_info(secured, client):
    pid = _pid("admin-auth")
    client.register_partition(pid, fields=["x"])
    client.put_samples(["a"], pid, {"x": torch.ones(1, 2)})
    # Service info holds no sample data: open by default.
    secured.GetServiceInfo(admin_pb2.GetServiceInfoRequest(), timeout=TIMEOUT)
    guarded = [
        (secured.ListPartitions, admin_pb2.ListPartitionsRequest()),
        (secured.DescribePartition, admin_pb2.DescribePartitionRequest(partition_id=pid)),
        (secured.ListSamples, admin_pb2.ListSamplesRequest(partition_id=pid)),
        (secured.GetSample, admin_pb2.GetSampleRequest(partition_id=pid, sample_id="a")),
        (secured.ClearPartition, admin_pb2.ClearPartitionRequest(partition_id=pid)),
        (secured.DeletePartition, admin_pb2.DeletePartitionRequest(partition_id=pid)),
    ]
    wrong = [("authorization", "Bearer not-the-token")]
    bare = [("authorization", TOKEN)]  # no scheme
    basic = [("authorization", f"Basic {TOKEN}")]  # another scheme
    for call, request in guarded:
        for metadata in (None, wrong, bare, basic):
            assert _code(call, request, metadata=metadata) == grpc.StatusCode.UNAUTHENTICATED, (
                call,
                metadata,
            )
    with pytest.raises(grpc.RpcError) as refused:
        list(secured.WatchStats(admin_pb2.WatchStatsRequest(count=1), timeout=TIMEOUT))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Refused calls changed nothing.
    assert client.describe_partition(pid).num_samples == 1
    # RFC 7235: the scheme name is case-insensitive, and one or more spaces follow it.
    for header in (f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER  {TOKEN}"):
        right = [("authorization", header)]
        got = secured.GetSample(guarded[3][1], metadata=right, timeout=TIMEOUT)
        assert got.sample.sample_id == "a"
    right = [("authorization", f"Bearer {TOKEN}")]
    got = secured.ClearPartition(guarded[4][1], metadata=right, timeout=TIMEOUT)
    assert got.cleared_samples == 1


def test_token_for_reads_guards_everything_but_health(service):
    server = _local_server(service, admin_token=TOKEN, admin_token_for_reads=True)
    ch = grpc.insecure_channel(server.address)
    try:
        stub = admin_pb2_grpc.AdminServiceStub(ch)
        info = admin_pb2.GetServiceInfoRequest()
        assert _code(stub.GetServiceInfo, info) == grpc.StatusCode.UNAUTHENTICATED
        watch = admin_pb2.WatchStatsRequest(count=1)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.WatchStats(watch, timeout=TIMEOUT))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        with pytest.raises(grpc.RpcError) as refused:
            list(
                refl.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                    timeout=TIMEOUT,
                )
            )
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        right = [("authorization", f"Bearer {TOKEN}")]
        assert (
            stub.GetServiceInfo(info, metadata=right, timeout=TIMEOUT).name == service.config.name
        )
        assert len(list(stub.WatchStats(watch, metadata=right, timeout=TIMEOUT))) == 1
        health = health_pb2_grpc.HealthStub(ch)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == SERVING
    finally:
        ch.close()
        server.stop(grace_s=0)


def test_token_for_reads_without_a_token_is_a_config_error(service, no_env_token):
    from dataplane_client.wire.errors import ConfigError

    with pytest.raises(ConfigError, match="admin_token_for_reads"):
        _local_server(service, admin_token_for_reads=True)


def test_mutations_without_token_off_loopback_are_refused():
    """Unit-level: the interceptor refuses mutations when no token guards a public address."""
    from dataplane_server.admin.server import BearerTokenAuth, is_loopback

    assert is_loopback("127.0.0.1")
    assert is_loopback("localhost")
    assert is_loopback("::1")
    assert not is_loopback("0.0.0.0")
    assert not is_loopback("10.1.2.3")

    class Context:
        def abort(self, code, details):
            raise RuntimeError(code, details)

    real = grpc.unary_unary_rpc_method_handler(lambda req, ctx: "cleared")
    closed = BearerTokenAuth(None, open_methods=frozenset(), mutations_open=False)
    opened = BearerTokenAuth(None, open_methods=frozenset(), mutations_open=True)
    for rpc in ("ClearPartition", "DeletePartition"):

        class Details:
            method = f"/{ADMIN_SERVICE}/{rpc}"
            invocation_metadata = ()

        handler = closed.intercept_service(lambda _details: real, Details())
        with pytest.raises(RuntimeError) as info:
            handler.unary_unary(b"", Context())
        assert info.value.args[0] == grpc.StatusCode.PERMISSION_DENIED
        assert "admin_token" in info.value.args[1]
        assert opened.intercept_service(lambda _details: real, Details()) is real


def test_bearer_credentials_are_parsed_per_rfc_7235():
    from dataplane_server.admin.server import presented_token

    def token(value):
        return presented_token([("x-other", "1"), ("authorization", value)])

    assert token("Bearer abc") == b"abc"
    assert token("bearer abc") == b"abc"
    assert token("BeArEr   abc") == b"abc"
    assert token("Basic abc") is None
    assert token("abc") is None
    assert token("Bearerabc") is None
    assert presented_token([]) is None
    assert presented_token(None) is None


# -------------------------------------------------------------------------------- TLS


def test_tls(service, tmp_path):
    cert, key = self_signed(tmp_path)
    server = _local_server(service, admin_tls_cert=str(cert), admin_tls_key=str(key))
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    secure = grpc.secure_channel(server.address, creds)
    plain = grpc.insecure_channel(server.address)
    try:
        stub = admin_pb2_grpc.AdminServiceStub(secure)
        info = stub.GetServiceInfo(admin_pb2.GetServiceInfoRequest(), timeout=TIMEOUT)
        assert info.name == service.config.name
        health = health_pb2_grpc.HealthStub(secure)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == SERVING
        # A plaintext client gets no answer from a TLS endpoint.
        plain_stub = admin_pb2_grpc.AdminServiceStub(plain)
        assert _code(plain_stub.GetServiceInfo, admin_pb2.GetServiceInfoRequest()) == (
            grpc.StatusCode.UNAVAILABLE
        )
    finally:
        secure.close()
        plain.close()
        server.stop(grace_s=0)


# ------------------------------------------------------------------------------ drain


def test_admin_actor_drain_then_stop(service, ray_session):
    """The AdminActor the launcher uses: SERVING, NOT_SERVING after drain (RPCs still
    answered), and gone after stop."""
    from dataplane_server.admin.actor import AdminActor

    cfg = DataPlaneConfig(
        name=service.config.name, namespace=service.config.namespace, metrics_enabled=False
    )
    actor = AdminActor.remote(cfg)
    try:
        addresses = ray_session.get(actor.start.remote(), timeout=60)
        assert addresses["metrics_address"] is None
        ch = grpc.insecure_channel(addresses["admin_address"])
        health = health_pb2_grpc.HealthStub(ch)
        stub = admin_pb2_grpc.AdminServiceStub(ch)
        check = health_pb2.HealthCheckRequest(service=ADMIN_SERVICE)
        assert health.Check(check, timeout=TIMEOUT).status == SERVING
        ray_session.get(actor.drain.remote(), timeout=30)
        assert health.Check(check, timeout=TIMEOUT).status == NOT_SERVING
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == NOT_SERVING
        stub.GetServiceInfo(admin_pb2.GetServiceInfoRequest(), timeout=TIMEOUT)
        ray_session.get(actor.stop.remote(), timeout=60)
        assert _code(stub.GetServiceInfo, admin_pb2.GetServiceInfoRequest()) == (
            grpc.StatusCode.UNAVAILABLE
        )
        ch.close()
    finally:
        ray_session.kill(actor)
