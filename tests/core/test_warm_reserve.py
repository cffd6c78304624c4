"""The warm reserve hands out pre-faulted chunks of the sizes it was asked for, within its limit."""

import os

import numpy as np

from dataplane_server.core.unit.warm_reserve import IN_USE_TAKES, RECENT_TAKES, WarmReserve


def test_a_miss_asks_for_chunks_of_that_size_and_the_next_write_gets_one():
    r = WarmReserve(limit_bytes=8 << 20)
    try:
        assert r.take(1 << 20) is None  # nothing ready yet: the write makes its own
        assert r.wait_until_holding(
            2 << 20, timeout_s=30
        )  # ... and two of that size are being made ahead
        chunk = r.take(1 << 20)
        assert chunk.size >= 1 << 20
        assert os.fstat(chunk.fd).st_size >= 1 << 20
        chunk.write(0, np.full(1 << 20, 7, dtype=np.uint8))  # writable shared memory
        back = np.empty(1 << 20, dtype=np.uint8)
        chunk.read_into(0, back)
        assert (back == 7).all()
        chunk.close()
        assert r.take(100) is None  # sizes far from what is held are never handed out
    finally:
        r.close()


def test_the_limit_bounds_what_it_holds_and_zero_disables_it():
    r = WarmReserve(limit_bytes=3 << 20)
    try:
        for _ in range(4):
            r.take(1 << 20)
        assert r.wait_until_holding(3 << 20, timeout_s=30)
        assert r.held_bytes <= 3 << 20
        assert r.take(4 << 20) is None  # larger than the whole reserve
    finally:
        r.close()
    assert WarmReserve(0).take(1 << 20) is None


def test_a_recycled_chunk_is_handed_out_first_and_the_oldest_of_its_size_makes_room():
    r = WarmReserve(limit_bytes=8 << 20)
    try:
        assert r.take(1 << 20) is None
        assert r.wait_until_holding(2 << 20, timeout_s=30)  # two fresh ones made ahead
        from dataplane_client.wire import shm

        used = shm.create(1 << 20)
        closed = r.recycle(used)  # kept; the oldest fresh one closed to keep two of a size
        assert len(closed) == 1
        assert closed != [used.name]
        assert r.take(1 << 20).name == used.name  # the writer that filled it has it mapped
    finally:
        r.close()


def test_the_limit_grows_to_the_largest_write_seen_and_zero_still_disables_it():
    from dataplane_client.wire import shm

    r = WarmReserve(limit_bytes=1 << 20)
    try:
        assert r.take(4 << 20) is None  # a miss, but the reserve now holds writes of 4 MiB
        assert r.wait_until_holding(4 << 20, timeout_s=30)
        assert r.take(4 << 20) is not None
    finally:
        r.close()
    off = WarmReserve(0)
    chunk = shm.create(1 << 20)
    assert off.recycle(chunk) == [chunk.name]  # closed, not kept
    assert off.take(1 << 20) is None


def _limit_of_one_chunk_taken(size: int) -> tuple[WarmReserve, object]:
    """A reserve whose limit is one chunk of ``size``, and that chunk, made and taken."""
    r = WarmReserve(limit_bytes=size)
    assert r.take(size) is None
    assert r.wait_until_holding(size, timeout_s=30)
    return r, r.take(size)


def test_put_clear_of_the_largest_size_makes_no_chunk_only_to_evict_it():
    """Writes as large as the limit, each freed before the next: the freed chunk comes
    back every time, so nothing more is made (a chunk made beside it would be evicted
    by the next recycle, after a core spent zeroing it). Accumulating writes, which
    free nothing, still get one made ahead after each hit."""
    size = 4 << 20
    r, chunk = _limit_of_one_chunk_taken(size)
    try:
        asked = r.requested
        for _ in range(5):
            assert r.recycle(chunk) == []  # kept for the next write
            chunk = r.take(size)
            assert chunk is not None
            assert r.requested == asked, "a hit asked for a chunk the limit cannot keep"
        chunk.close()
    finally:
        r.close()
    r = WarmReserve(limit_bytes=size)
    try:
        assert r.take(size) is None
        for _ in range(3):  # nothing is ever freed: each hit asks for the next one
            assert r.wait_until_holding(size, timeout_s=30)
            before = r.requested
            r.take(size).close()
            assert r.requested == before + 1
    finally:
        r.close()


def test_put_clear_of_the_largest_size_with_a_lease_asked_each_put_makes_nothing_either():
    """What a unit does at each put of a writer: the write takes a chunk, then the lease
    for the writer's next put asks for another, which misses (the limit holds one); the
    clear brings the first back. The miss used to ask for two chunks, so the background
    thread zeroed a chunk (0.4-0.5 s of a core per GiB, beside the writer's copy) that
    the next recycle evicted: every other put of 1 GiB, measured 2026-11-27."""
    size = 4 << 20
    r, chunk = _limit_of_one_chunk_taken(size)
    try:
        asked = None
        for _ in range(6):
            # The lease: nothing ready beside the write's chunk (the first round's miss
            # asks, as nothing has come back yet; what it makes may be evicted once).
            lease = r.take(size)
            if lease is not None:
                lease.close()
            r.recycle(chunk)  # the clear
            chunk = r.take(size)
            assert chunk is not None
            asked = r.requested if asked is None else asked
        assert r.requested == asked, "a chunk was asked that the limit could not keep"
        chunk.close()
    finally:
        r.close()


def test_writes_that_stop_coming_back_get_chunks_made_ahead_again():
    """After put/clear rounds, writes that free nothing (a growing buffer): once a few
    takes pass with no chunk of their size back, a take asks for the next one again."""
    size = 4 << 20
    r = WarmReserve(limit_bytes=size)
    try:
        assert r.take(size) is None
        assert r.wait_until_holding(size, timeout_s=30)
        for _ in range(3):  # put/clear
            r.recycle(r.take(size))
        before = r.requested
        held = [r.take(size)]
        for _ in range(RECENT_TAKES + 1):  # puts only: nothing comes back
            got = r.take(size)
            if got is not None:
                held.append(got)
        assert r.requested > before, "writes that free nothing never got a chunk made ahead"
        for chunk in held:
            chunk.close()
    finally:
        r.close()


def test_chunks_recycled_while_one_is_being_made_keep_the_reserve_within_its_limit(monkeypatch):
    """The background thread checks for room, then makes a chunk (slow: zeroing); freed
    chunks recycled meanwhile can fill the reserve. The made chunk must then go, not
    push the reserve past its limit (a CI run held 384 MiB against a 256 MiB limit)."""
    import threading

    from dataplane_client.wire import shm
    from dataplane_server.core.unit import warm_reserve

    real_create = shm.create
    entered, release, closed = threading.Event(), threading.Event(), threading.Event()

    def slow_create(nbytes):
        entered.set()
        assert release.wait(30)
        chunk = real_create(nbytes)
        real_close = chunk.close
        chunk.close = lambda: (real_close(), closed.set())
        return chunk

    size = 1 << 20
    r = WarmReserve(limit_bytes=2 * size)
    try:
        monkeypatch.setattr(warm_reserve.shm, "create", slow_create)
        assert r.take(size) is None  # a miss: the thread starts making one
        assert entered.wait(30)
        for _ in range(2):  # two freed chunks fill the reserve meanwhile
            assert r.recycle(real_create(size)) == []
        release.set()
        assert closed.wait(30), "the chunk made without room was closed"
        assert r.held_bytes == 2 * size
    finally:
        r.close()


def test_jagged_writes_keep_what_the_reserve_follows_bounded():
    """Every put of jagged rows has its own size: the recycled sizes whose takes the
    reserve counts stay a bounded few, or each take would look through all of them."""
    from dataplane_client.wire import shm
    from dataplane_server.core.unit import warm_reserve

    r = WarmReserve(limit_bytes=1 << 20)
    try:
        for k in range(3 * warm_reserve._SIZES_FOLLOWED):
            size = (64 << 10) + k * 4096  # a new size each time
            for name in r.recycle(shm.create(size)):
                assert isinstance(name, str)
        assert len(r._takes_since_back) <= warm_reserve._SIZES_FOLLOWED
    finally:
        r.close()


def _put_clear_rounds(r: WarmReserve, sizes: list[int], rounds: int) -> dict[int, int]:
    """Put/clear of each size in turn, ``rounds`` times (a miss makes its chunk in the
    write path, as a unit does); the misses per size."""
    from dataplane_client.wire import shm

    misses = dict.fromkeys(sizes, 0)
    for _ in range(rounds):
        for size in sizes:
            chunk = r.take(size)
            if chunk is None:
                misses[size] += 1
                chunk = shm.create(size)
            r.recycle(chunk)
    return misses


def test_two_sizes_the_limit_cannot_hold_together_keep_the_larger_ready():
    """A step writing 1 GiB of one field and 128 MiB of another through one unit (the
    limit grows to 1 GiB): each recycle of one evicted the other, so both were made in
    the write path every time (400 + 48 ms, measured 2026-11-27). The larger size, still
    being written, is kept; the smaller is made each time; and nothing is made that the
    next recycle evicts."""
    big, small = 4 << 20, 512 << 10
    r = WarmReserve(limit_bytes=1 << 20)
    try:
        misses = _put_clear_rounds(r, [big, small], 20)
        assert misses[big] == 1, misses  # the first put of the size only
        assert r.requested <= 2, "chunks were made that the limit could not keep"
    finally:
        r.close()


def test_a_size_no_longer_written_makes_room_for_the_one_that_is():
    """Once a larger size stops being written, the smaller one's freed chunks are kept
    again (within a few takes), as before."""
    big, small = 4 << 20, 512 << 10
    r = WarmReserve(limit_bytes=1 << 20)
    try:
        _put_clear_rounds(r, [big, small], 3)
        _put_clear_rounds(r, [small], IN_USE_TAKES)  # the large writes have stopped
        assert _put_clear_rounds(r, [small], 5) == {small: 0}
    finally:
        r.close()
