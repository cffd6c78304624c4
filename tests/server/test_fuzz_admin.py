"""Bad input to the gRPC admin endpoint of a service started with a token.

Hypothesis builds every AdminService request with random field values (any text for
ids, any int32 for sizes and enums, any double for intervals), random and mutated raw
bytes in place of a serialized request, requests past ``admin_max_request_bytes``,
and ``authorization`` metadata of every shape (missing, wrong, case-varied token or
scheme, extra spaces, other schemes). What must hold: every refusal is a proper gRPC
status (INVALID_ARGUMENT, NOT_FOUND, UNAUTHENTICATED, RESOURCE_EXHAUSTED, ...), never
UNKNOWN or INTERNAL; the token is accepted exactly when the header is
``<bearer, any case> <one or more spaces><the token>``; the store is unchanged; and the
server keeps serving (health SERVING, a well-formed read answers). Inputs tried per
surface are printed.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import Counter

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataplane_client.wire.config import DataPlaneConfig
from dataplane_server import start
from dataplane_server.admin_pb import admin_pb2, admin_pb2_grpc

TOKEN = "Fuzz-Token-42"
RIGHT = [("authorization", f"Bearer {TOKEN}")]
MAX_REQUEST = 64 << 10
TIMEOUT = 10
IDS = [f"s{i}" for i in range(5)]
SERVICE = "/dataplane.admin.v1.AdminService/"
# Refusals a client can act on; UNKNOWN / INTERNAL would mean the server broke.
PROPER = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.PERMISSION_DENIED,
}
TRIED: Counter = Counter()
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def admin(ray_session):
    handle = start(
        DataPlaneConfig(
            name=f"fuzz-admin-{uuid.uuid4().hex[:6]}",
            num_storage_units=1,
            metrics_enabled=False,
            admin_token=TOKEN,
            admin_max_request_bytes=MAX_REQUEST,
        )
    )
    client = handle.client()
    pid = "fuzzed"
    client.register_partition(pid, ["x", "note"], None, ["train"], object_fields=["note"])
    client.put_samples(
        IDS,
        pid,
        {"x": torch.arange(10, dtype=torch.float32).reshape(5, 2), "note": list("abcde")},
        tags=[{"step": i} for i in range(5)],
    )
    channel = grpc.insecure_channel(handle.admin_address)
    state = {
        "handle": handle,
        "client": client,
        "pid": pid,
        "channel": channel,
        "stub": admin_pb2_grpc.AdminServiceStub(channel),
    }
    state["before"] = _store(state)
    yield state
    print(f"\nadmin fuzz inputs tried per surface: {dict(sorted(TRIED.items()))}")
    channel.close()
    handle.shutdown()


def _store(admin) -> tuple:
    c, pid = admin["client"], admin["pid"]
    got = c.get_samples(IDS, pid, ["x", "note"])
    d = c.describe_partition(pid)
    return got["x"].tolist(), list(got["note"]), d.num_samples, d.consumption


def _code(call, request, metadata) -> grpc.StatusCode:
    try:
        response = call(request, metadata=metadata, timeout=TIMEOUT)
        if hasattr(response, "__iter__") and not hasattr(response, "ListFields"):
            list(response)  # a stream: its status arrives at the end
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _still_serving(admin) -> None:
    # Health follows a probe of the controller with a 2 s timeout, so on a loaded machine
    # it may read NOT_SERVING for a moment: polled until SERVING, with a deadline.
    health = health_pb2_grpc.HealthStub(admin["channel"])
    deadline = time.monotonic() + 60
    while True:
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT).status
        if status == health_pb2.HealthCheckResponse.SERVING:
            break
        if time.monotonic() > deadline:
            import ray

            t0 = time.monotonic()
            snap = ray.get(admin["handle"].controller.metrics_snapshot.remote(), timeout=60)
            took = time.monotonic() - t0
            restarts = snap.stats["counters"].get("controller_restarts_total", 0)
            raise AssertionError(f"health still {status}; probe took {took:.1f}s, {restarts=}")
        time.sleep(0.2)
    d = admin["stub"].DescribePartition(
        admin_pb2.DescribePartitionRequest(partition_id=admin["pid"]),
        metadata=RIGHT,
        timeout=TIMEOUT,
    )
    assert d.num_samples == len(IDS)
    assert _store(admin) == admin["before"]


# ---- random request fields ------------------------------------------------------------

text = st.text(max_size=40)
int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
# Intervals: any double up to 0.2 s (a valid one streams quickly), and huge or non-finite ones.
intervals = st.one_of(
    st.floats(max_value=0.2, allow_nan=False, allow_infinity=True),
    st.sampled_from([1e9, 1e300, float("inf"), float("nan")]),
)


def _requests(pid: str):
    """(rpc name, request) with random fields; the real partition id is used only where a
    random companion field guarantees the call changes nothing."""
    partition = st.one_of(text, st.just(pid))
    unknown_ids = st.lists(text.filter(lambda s: s not in IDS), min_size=1, max_size=4)
    return st.one_of(
        st.builds(lambda: ("GetServiceInfo", admin_pb2.GetServiceInfoRequest())),
        st.builds(lambda: ("ListPartitions", admin_pb2.ListPartitionsRequest())),
        partition.map(
            lambda p: ("DescribePartition", admin_pb2.DescribePartitionRequest(partition_id=p))
        ),
        st.builds(
            lambda p, s, n, t: (
                "ListSamples",
                admin_pb2.ListSamplesRequest(partition_id=p, status=s, page_size=n, page_token=t),
            ),
            partition,
            int32,
            int32,
            text,
        ),
        st.builds(
            lambda p, s, f, m: (
                "GetSample",
                admin_pb2.GetSampleRequest(partition_id=p, sample_id=s, fields=f, max_elems=m),
            ),
            partition,
            st.one_of(text, st.sampled_from(IDS)),
            st.lists(st.one_of(text, st.sampled_from(["x", "note"])), max_size=3),
            int32,
        ),
        # Mutations: an unknown partition, or the real one with ids it does not hold
        # (mixed with real ones: refused whole, nothing cleared).
        st.builds(
            lambda p, ids: (
                "ClearPartition",
                admin_pb2.ClearPartitionRequest(partition_id=p, sample_ids=ids),
            ),
            text.filter(lambda s: s != pid),
            st.lists(text, max_size=3),
        ),
        st.builds(
            lambda ids, real: (
                "ClearPartition",
                admin_pb2.ClearPartitionRequest(partition_id=pid, sample_ids=ids + real),
            ),
            unknown_ids,
            st.lists(st.sampled_from(IDS), max_size=2, unique=True),
        ),
        text.filter(lambda s: s != pid).map(
            lambda p: ("DeletePartition", admin_pb2.DeletePartitionRequest(partition_id=p))
        ),
        st.builds(
            lambda i, n: ("WatchStats", admin_pb2.WatchStatsRequest(interval_s=i, count=n)),
            intervals,
            # 0 streams until cancelled; positive counts kept short.
            st.integers(min_value=-(2**31), max_value=-1) | st.integers(min_value=1, max_value=3),
        ),
    )


@SETTINGS
@given(data=st.data())
def test_random_request_fields_get_proper_status_codes(admin, data):
    name, request = data.draw(_requests(admin["pid"]), label="request")
    TRIED[f"fields.{name}"] += 1
    code = _code(getattr(admin["stub"], name), request, RIGHT)
    assert code == grpc.StatusCode.OK or code in PROPER, (name, request, code)
    assert _store(admin) == admin["before"], (name, request)


# ---- raw bytes in place of a serialized request ----------------------------------------

RPCS = [
    ("GetServiceInfo", admin_pb2.GetServiceInfoRequest()),
    ("ListPartitions", admin_pb2.ListPartitionsRequest()),
    ("DescribePartition", admin_pb2.DescribePartitionRequest(partition_id="fuzzed")),
    ("ListSamples", admin_pb2.ListSamplesRequest(partition_id="fuzzed", page_size=2)),
    ("GetSample", admin_pb2.GetSampleRequest(partition_id="fuzzed", sample_id="s1")),
    ("ClearPartition", admin_pb2.ClearPartitionRequest(partition_id="nope", sample_ids=["a"])),
    ("DeletePartition", admin_pb2.DeletePartitionRequest(partition_id="nope")),
]


def _parses(name: str, payload: bytes) -> bool:
    try:
        getattr(admin_pb2, f"{name}Request").FromString(payload)
    except DecodeError:
        return False
    return True


def _raw(channel, name: str):
    return channel.unary_unary(SERVICE + name)  # bytes in, bytes out: no (de)serializer


@SETTINGS
@given(
    st.sampled_from(RPCS),
    st.one_of(
        st.binary(max_size=64),
        st.tuples(st.integers(min_value=0, max_value=63), st.integers(0, 255)),
    ),
)
def test_random_and_mutated_bytes_get_proper_status_codes(admin, rpc, mutation):
    name, request = rpc
    if isinstance(mutation, bytes):
        payload = mutation
    else:
        raw = bytearray(request.SerializeToString())
        if not raw:
            raw = bytearray(b"\x00")
        pos, value = mutation
        raw[pos % len(raw)] = value
        payload = bytes(raw)
    TRIED[f"bytes.{name}"] += 1
    code = _code(_raw(admin["channel"], name), payload, RIGHT)
    if not _parses(name, payload):
        assert code in PROPER, (name, payload, code)
    else:
        assert code == grpc.StatusCode.OK or code in PROPER, (name, payload, code)
    assert _store(admin) == admin["before"], (name, payload)


@pytest.mark.parametrize("name", [name for name, _ in RPCS])
def test_bytes_that_are_not_the_request_are_invalid_argument(admin, name):
    payload = b"\xff\xff\xff"
    assert not _parses(name, payload)
    assert _code(_raw(admin["channel"], name), payload, RIGHT) == grpc.StatusCode.INVALID_ARGUMENT


# ---- oversized requests -----------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(
    st.sampled_from(["DescribePartition", "ListSamples", "ClearPartition", "DeletePartition"]),
    st.integers(min_value=1, max_value=4 * MAX_REQUEST),
    st.booleans(),
)
def test_requests_past_the_size_limit_are_resource_exhausted(admin, name, extra, with_token):
    big = "p" * (MAX_REQUEST + extra)
    request = getattr(admin_pb2, f"{name}Request")(partition_id=big)
    TRIED[f"oversized.{name}"] += 1
    code = _code(getattr(admin["stub"], name), request, RIGHT if with_token else None)
    # The size limit is enforced before anything reads the token.
    assert code in {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED}, code
    if with_token:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _store(admin) == admin["before"]


# ---- the token ----------------------------------------------------------------------------

printable = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20)


def _case_varied(s: str):
    return st.lists(st.booleans(), min_size=len(s), max_size=len(s)).map(
        lambda flips: "".join(c.swapcase() if f else c for c, f in zip(s, flips))
    )


headers = st.one_of(
    st.none(),  # no authorization header at all
    st.builds(
        lambda scheme, spaces, token: f"{scheme}{' ' * spaces}{token}",
        st.one_of(_case_varied("Bearer"), st.sampled_from(["Basic", "Token", "Bearer:", ""])),
        st.integers(min_value=0, max_value=3),
        st.one_of(
            st.just(TOKEN),
            _case_varied(TOKEN),
            printable,
            st.sampled_from([TOKEN[:-1], TOKEN + "x", "x" + TOKEN, TOKEN.lower(), ""]),
        ),
    ),
    printable,
)


def _accepted(header: str | None) -> bool:
    """The documented rule, written independently of the server's parser."""
    if header is None:
        return False
    m = re.fullmatch(r"([Bb][Ee][Aa][Rr][Ee][Rr]) +(.*)", header, re.S)
    return m is not None and m.group(2) == TOKEN


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    headers,
    st.sampled_from(["ListPartitions", "DescribePartition", "ClearPartition", "DeletePartition"]),
)
def test_the_token_is_accepted_exactly_when_it_is_presented_right(admin, header, name):
    header = header.strip() if header is not None else None  # gRPC trims header values
    requests = {
        "ListPartitions": admin_pb2.ListPartitionsRequest(),
        "DescribePartition": admin_pb2.DescribePartitionRequest(partition_id=admin["pid"]),
        "ClearPartition": admin_pb2.ClearPartitionRequest(partition_id="nope", sample_ids=["a"]),
        "DeletePartition": admin_pb2.DeletePartitionRequest(partition_id="nope"),
    }
    metadata = None if header is None else [("authorization", header)]
    TRIED["token"] += 1
    code = _code(getattr(admin["stub"], name), requests[name], metadata)
    if _accepted(header):
        assert code != grpc.StatusCode.UNAUTHENTICATED, (header, code)
        assert code == grpc.StatusCode.OK or code in PROPER
    else:
        assert code == grpc.StatusCode.UNAUTHENTICATED, (header, code)
    assert _store(admin) == admin["before"]


def test_service_info_stays_open_and_health_never_needs_the_token(admin):
    info = admin["stub"].GetServiceInfo(admin_pb2.GetServiceInfoRequest(), timeout=TIMEOUT)
    assert info.num_samples >= len(IDS)
    _still_serving(admin)
