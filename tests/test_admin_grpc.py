"""The gRPC admin endpoint, spoken to by real gRPC clients over loopback.

The shared service's own endpoint answers every AdminService RPC, the standard
health check and reflection. Auth, TLS and drain get their own servers (an
in-process AdminServer or an AdminActor) pointed at the same controller, so the
shared endpoint's settings stay untouched.
"""

from __future__ import annotations

import datetime
import ipaddress
import uuid

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from dataplane_client.config import DataPlaneConfig
from dataplane_server.admin_pb import admin_pb2, admin_pb2_grpc

ADMIN_SERVICE = "dataplane.admin.v1.AdminService"
TOKEN = "s3cret-token"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TIMEOUT = 10


def _pid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


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
        pid, fields=["input_ids", "score", "prompt"], consumer_tasks=["train"]
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


def test_clear_partition_without_token_on_loopback(stub, client, no_env_token):
    pid = _pid("admin-clear")
    client.register_partition(pid, fields=["x"])
    client.put_samples(["a", "b", "c"], pid, {"x": torch.ones(3, 4)})
    got = stub.ClearPartition(admin_pb2.ClearPartitionRequest(partition_id=pid), timeout=TIMEOUT)
    assert (got.partition_id, got.cleared_samples) == (pid, 3)
    assert got.bytes_freed > 0
    # Clearing a whole partition deletes it (the NeMo-RL contract of clear_samples(None, p)).
    listed = stub.ListPartitions(admin_pb2.ListPartitionsRequest(), timeout=TIMEOUT).partitions
    assert pid not in {p.partition_id for p in listed}
    request = admin_pb2.ListSamplesRequest(partition_id=pid)
    assert _code(stub.ListSamples, request) == grpc.StatusCode.NOT_FOUND
    request = admin_pb2.ClearPartitionRequest(partition_id="no-such-partition")
    assert _code(stub.ClearPartition, request) == grpc.StatusCode.NOT_FOUND


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


def test_token_guards_mutations_only(secured, client):
    pid = _pid("admin-auth")
    client.register_partition(pid, fields=["x"])
    client.put_samples(["a"], pid, {"x": torch.ones(1, 2)})
    # Reads need no token.
    secured.GetServiceInfo(admin_pb2.GetServiceInfoRequest(), timeout=TIMEOUT)
    clear = admin_pb2.ClearPartitionRequest(partition_id=pid)
    assert _code(secured.ClearPartition, clear) == grpc.StatusCode.UNAUTHENTICATED
    wrong = [("authorization", "Bearer not-the-token")]
    assert _code(secured.ClearPartition, clear, metadata=wrong) == grpc.StatusCode.UNAUTHENTICATED
    bare = [("authorization", TOKEN)]  # no "Bearer " scheme
    assert _code(secured.ClearPartition, clear, metadata=bare) == grpc.StatusCode.UNAUTHENTICATED
    # Refused calls changed nothing.
    assert client.describe_partition(pid).num_samples == 1
    right = [("authorization", f"Bearer {TOKEN}")]
    got = secured.ClearPartition(clear, metadata=right, timeout=TIMEOUT)
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
    from dataplane_client.errors import InvalidBatch

    with pytest.raises(InvalidBatch, match="admin_token_for_reads"):
        _local_server(service, admin_token_for_reads=True)


def test_mutations_without_token_off_loopback_are_refused():
    """Unit-level: the interceptor refuses ClearPartition when no token guards a public address."""
    from dataplane_server.admin.server import BearerTokenAuth, is_loopback

    assert is_loopback("127.0.0.1")
    assert is_loopback("localhost")
    assert is_loopback("::1")
    assert not is_loopback("0.0.0.0")
    assert not is_loopback("10.1.2.3")

    class Details:
        method = f"/{ADMIN_SERVICE}/ClearPartition"
        invocation_metadata = ()

    class Context:
        def abort(self, code, details):
            raise RuntimeError(code, details)

    real = grpc.unary_unary_rpc_method_handler(lambda req, ctx: "cleared")
    auth = BearerTokenAuth(None, token_for_reads=False, mutations_open=False)
    handler = auth.intercept_service(lambda _details: real, Details())
    with pytest.raises(RuntimeError) as info:
        handler.unary_unary(b"", Context())
    assert info.value.args[0] == grpc.StatusCode.PERMISSION_DENIED
    assert "admin_token" in info.value.args[1]
    opened = BearerTokenAuth(None, token_for_reads=False, mutations_open=True)
    assert opened.intercept_service(lambda _details: real, Details()) is real


# -------------------------------------------------------------------------------- TLS


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "admin.crt", tmp_path / "admin.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls(service, tmp_path):
    cert, key = _self_signed(tmp_path)
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
    actor = AdminActor.remote(cfg.to_dict())
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
