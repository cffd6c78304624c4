"""Claims across controller crashes and journal failures: every batch delivered exactly once.

Found by a user on a real service:
- a cursor claim the controller had journaled when it died was retried by Ray on
  the restarted controller, whose replay had already marked the batch consumed:
  the consumer got the next batch and the first was never delivered;
- with the journal's disk full, a claim raised a raw ``RayTaskError(OSError)``
  and its batch was consumed all the same (the key space changed before the
  journal append);
- lease ids were a counter rebuilt from the leases that survived a restart, so
  after two restarts a late ack of an old holder matched a new holder's lease.

Faults are injected with failpoints (``dataplane_client/wire/failpoints.py``): the
controller dies right after a claim is journaled, before its answer leaves;
the journal's writes fail while armed.
"""

import os
from pathlib import Path

import pytest
import ray
import ray._private.state as ray_state
import torch
from polling import wait_until

from dataplane_client.wire import failpoints
from dataplane_client.wire.errors import JournalWriteFailed, LeaseExpired

pytestmark = pytest.mark.timeout(180)


def _arm(name: str) -> Path:
    path = Path(os.environ[failpoints.ENV]) / name
    path.touch()
    return path


def _restarts(h) -> int:
    """How often Ray restarted the controller, once the last restart finished (else -1)."""
    info = ray_state.actors(h.controller._actor_id.hex())
    return int(info.get("NumRestarts", 0)) if info.get("State") == "ALIVE" else -1


def _service(service_factory, leases=None):
    h = service_factory("claim-identity", num_storage_units=1, admin_enabled=False)
    c = h.client()
    c.register_partition("p", ["x"], 8, ["t"], task_leases=leases)
    ids = [f"s{i}" for i in range(8)]
    c.put_samples(ids, "p", {"x": torch.arange(8.0).reshape(8, 1)})
    return h, c


@pytest.mark.parametrize("leases", [None, {"t": 60.0}], ids=["cursor", "leased"])
def test_a_claim_whose_answer_died_with_the_controller_is_delivered_on_the_retry(
    service_factory, leases
):
    h, c = _service(service_factory, leases)
    armed = _arm(failpoints.CLAIM_ANSWER_LOST)
    try:
        first = c.claim_meta("p", "t", ["x"], 4, timeout_s=60)
    finally:
        armed.unlink(missing_ok=True)
    assert not armed.exists()  # the failpoint fired: the controller died mid-claim
    assert _restarts(h) == 1
    second = c.claim_meta("p", "t", ["x"], 4, timeout_s=10)
    got = first.sample_ids + second.sample_ids
    assert sorted(got) == [f"s{i}" for i in range(8)]  # each sample delivered exactly once
    if leases:
        assert c.ack(first) == 4
        assert c.ack(second) == 4
    assert c.check_consumption_status("p", ["t"])


def test_a_claim_retried_by_the_same_request_id_gets_the_same_batch(service_factory):
    """What Ray's retry does, made by hand: the request id names the answer."""
    h, c = _service(service_factory)
    from dataplane_client.wire.messages import ClaimRequest

    request = ClaimRequest("p", "t", ["x"], 4, None, True, request_id="fixed-id")
    (once,) = ray.get(h.controller.claim_many.remote([request]))
    (again,) = ray.get(h.controller.claim_many.remote([request]))
    assert once.meta.sample_ids == again.meta.sample_ids
    assert c.claim_meta("p", "t", ["x"], 4).sample_ids == ["s4", "s5", "s6", "s7"]


def test_a_failed_journal_write_is_typed_and_consumes_nothing(service_factory):
    h, c = _service(service_factory, leases={"t": 60.0})
    armed = _arm(failpoints.JOURNAL_WRITE)
    try:
        with pytest.raises(JournalWriteFailed):
            c.claim_meta("p", "t", ["x"], 4, timeout_s=5)
        with pytest.raises(JournalWriteFailed):
            c.register_partition("p", ["x"], 8, ["t", "u"])
        with pytest.raises(JournalWriteFailed):
            c.delete_partition("p")
    finally:
        armed.unlink()
    detail = c.consumption_detail("p", ["t"])[0]
    assert (detail.consumed, detail.leased) == (0, 0)  # nothing was handed out
    meta = c.claim_meta("p", "t", ["x"], 8)
    assert meta.sample_ids == [f"s{i}" for i in range(8)]  # the partition is intact
    armed.touch()
    try:
        with pytest.raises(JournalWriteFailed):
            c.ack(meta)
        with pytest.raises(JournalWriteFailed):
            c.reset_consumption("p", "t")
    finally:
        armed.unlink()
    assert c.consumption_detail("p", ["t"])[0].leased == 8  # the ack changed nothing
    assert c.ack(meta) == 8
    assert c.check_consumption_status("p", ["t"])


def test_a_late_ack_after_two_restarts_never_takes_a_new_holders_lease(service_factory):
    h, c = _service(service_factory, leases={"t": 1.0})
    old = c.claim_meta("p", "t", ["x"], 2)
    wait_until(lambda: c.consumption_detail("p", ["t"])[0].leased == 0, 10, "the lease to lapse")
    for n in (1, 2):  # restarts compact the lapsed lease away
        ray.kill(h.controller, no_restart=False)
        wait_until(lambda n=n: _restarts(h) >= n, 60, f"restart {n}")
    new = c.claim_meta("p", "t", ["x"], 2, timeout_s=10)
    assert new.sample_ids == old.sample_ids
    assert new.extra_info["lease_id"] != old.extra_info["lease_id"]
    with pytest.raises(LeaseExpired):
        c.ack(old)
    assert c.ack(new) == 2
