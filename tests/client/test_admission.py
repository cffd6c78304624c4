"""Put admission without Ray: a process's credits, its FIFO queue, deadlines, a full queue.

The service-level story (a put that cannot be admitted in time fails fast with
``Overloaded``, nothing staged) is in tests/e2e/test_many_writers.py.
"""

import pickle
import threading
import time

import pytest

from dataplane_client.transport.admission import QUEUE, Admission
from dataplane_client.wire.errors import Overloaded, RetryableError, StageReclaimed


def test_credits_bound_the_puts_in_flight_and_waiters_are_admitted_in_arrival_order():
    gate = Admission(credits=2, timeout_s=60, max_waiting=100)
    first, second = gate.enter(), gate.enter()
    assert first.done()
    assert second.done()
    waiting = [gate.enter() for _ in range(5)]
    assert not any(f.done() for f in waiting)
    assert gate.depth() == (5, 2)
    order = []
    for i, f in enumerate(waiting):
        f.add_done_callback(lambda _f, i=i: order.append(i))
    gate.leave(first)
    assert order == [0]
    gate.leave(second)
    gate.leave(waiting[0])
    assert order == [0, 1, 2]
    assert gate.depth() == (2, 2)
    assert gate.waited_total == 3
    assert gate.admitted_total == 5


def test_a_put_not_admitted_within_its_deadline_fails_fast_with_overloaded_naming_the_queue():
    gate = Admission(credits=1, timeout_s=0.2, max_waiting=100)
    held = gate.enter()
    t0 = time.monotonic()
    late = gate.enter()
    with pytest.raises(Overloaded) as e:
        late.result(timeout=30)  # generous: proves "fails", not "hangs"
    assert time.monotonic() - t0 < 10
    err = e.value
    assert isinstance(err, TimeoutError)
    assert isinstance(err, RetryableError)
    assert not isinstance(err, KeyError)
    assert err.queue == QUEUE
    assert QUEUE in str(err)
    assert gate.rejected_total == 1
    assert gate.depth() == (0, 1)
    gate.leave(late)  # a failed put gives back nothing it never held
    gate.leave(held)
    assert gate.depth() == (0, 0)
    assert gate.enter().done()


def test_a_full_queue_refuses_at_once_and_a_put_that_gave_up_never_takes_a_credit():
    gate = Admission(credits=1, timeout_s=60, max_waiting=1)
    held = gate.enter()
    waiter = gate.enter()
    refused = gate.enter()
    assert isinstance(refused.exception(timeout=0), Overloaded)
    gate.leave(waiter)  # its caller gave up while it waited
    gate.leave(held)
    assert gate.depth() == (0, 0)  # the credit went back, not to the withdrawn waiter
    assert gate.enter().done()


def test_threads_share_the_credits_and_all_finish():
    gate = Admission(credits=3, timeout_s=60, max_waiting=1000)
    peak, inside, lock = [0], [0], threading.Lock()

    def put():
        ticket = gate.enter()
        ticket.result(timeout=60)
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        with lock:
            inside[0] -= 1
        gate.leave(ticket)

    threads = [threading.Thread(target=put) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert peak[0] <= 3
    assert gate.admitted_total == 64
    assert gate.depth() == (0, 0)


def test_overloaded_and_stage_reclaimed_keep_their_queue_through_pickling():
    for cls, queue in ((Overloaded, QUEUE), (StageReclaimed, "commit")):
        err = pickle.loads(pickle.dumps(cls("full", queue=queue, partition_id="p")))
        assert type(err) is cls
        assert err.queue == queue
        assert err.partition_id == "p"


def test_the_queue_reports_its_figures_while_puts_wait_and_after_a_refusal():
    reports = []
    gate = Admission(credits=1, timeout_s=0.3, max_waiting=100, report=lambda: reports.append(1))
    held = gate.enter()
    late = gate.enter()
    deadline = time.monotonic() + 30
    while not (late.done() and reports):
        assert time.monotonic() < deadline, "no report after a refusal"
        time.sleep(0.01)  # polling an observable state, not synchronisation
    load = gate.load("w1")
    assert (load.writer, load.waiting, load.in_flight, load.rejected_total) == ("w1", 0, 1, 1)
    gate.leave(held)
    gate.leave(late)
