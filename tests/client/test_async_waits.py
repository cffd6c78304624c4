"""An awaited verb whose call fails with a TimeoutError-family error raises it.

``CapacityExceeded`` and ``ClaimTimeout`` are also ``TimeoutError`` (NeMo-RL
callers catch the built-in), and so is the timeout of the client's own poll of
a pending Ray call. The async wait once took the call's error for its poll
timing out and polled again without end: an ``await put_samples_async(...)``
into a full store hung, spinning a core, and so did an async blocking claim
that timed out.
"""

import asyncio
import time

import pytest
import torch

from dataplane_client.wire.errors import CapacityExceeded, ClaimTimeout

HANG_BOUND_S = 60  # a bound on a hang, not a speed target


def _full_service(service_factory, put_wait_timeout_s: float):
    handle = service_factory(
        "async-waits",
        num_storage_units=1,
        unit_capacity_bytes=4 << 20,
        put_wait_timeout_s=put_wait_timeout_s,
        admin_enabled=False,
    )
    client = handle.client()
    client.register_partition("p", ["x"], None, ["t"])
    client.put_samples(["a"], "p", {"x": torch.ones(1, 3 << 18)})  # 3 MiB of the 4
    return client


@pytest.mark.timeout(HANG_BOUND_S)
@pytest.mark.parametrize("put_wait_timeout_s", [0.0, 1.5])  # at once; after a poll or two
def test_an_awaited_put_into_a_full_store_raises_capacity_exceeded(
    service_factory, put_wait_timeout_s
):
    client = _full_service(service_factory, put_wait_timeout_s)
    started = time.monotonic()
    with pytest.raises(CapacityExceeded):
        asyncio.run(client.put_samples_async(["b"], "p", {"x": torch.ones(1, 3 << 18)}))
    assert time.monotonic() - started >= put_wait_timeout_s  # it did wait for room first
    # The store still serves the coroutine's caller.
    assert asyncio.run(client.check_consumption_status_async("p", ["t"])) is False


@pytest.mark.timeout(HANG_BOUND_S)
def test_an_awaited_blocking_claim_that_times_out_raises_claim_timeout(service_factory):
    client = _full_service(service_factory, 0.0)
    client.claim_meta("p", "t", ["x"], 1)  # the one sample is taken: nothing is left due
    started = time.monotonic()
    with pytest.raises(ClaimTimeout):
        asyncio.run(client.claim_meta_async("p", "t", ["x"], 1, timeout_s=2.0))
    assert time.monotonic() - started >= 2.0
