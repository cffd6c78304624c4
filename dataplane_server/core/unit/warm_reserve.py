"""Pre-faulted shared-memory chunks, made ahead of time off the write path.

Fresh memory costs the kernel a page fault and a page of zeroing per 4 KiB on
first touch: for a 128 MiB write that is several times the copy itself. A unit
therefore keeps a reserve of chunks whose pages are already there, and hands
one out when a write fits:

- chunks a background thread created and faulted in, of the sizes writes asked for;
- chunks that held data and were freed while no reader had them mapped
  (``recycle``): their pages need no zeroing, and a writer that mapped them
  before still has them mapped, so the next write of that size is one plain copy.
  The unit decides that no reader holds one (see the read leases in
  unit/actor.py); a chunk a reader may still map is closed instead, never reused.

The reserve holds at most ``max(limit, largest write seen)`` bytes, so a unit
taking 1 GiB writes keeps one 1 GiB chunk ready instead of zeroing it inside
the write; it keeps at most ``_PER_SIZE`` recycled chunks of any one size (each
is a descriptor). What does not fit goes, oldest first, except a larger chunk of
a size still being written (taken within ``IN_USE_TAKES`` takes): a smaller freed
chunk is closed instead, so a step writing 1 GiB and 128 MiB puts through one unit
makes only the smaller in its writes, not both. And it asks for no chunk that it
could not keep (one made beside a chunk coming back, or with no room now).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from dataplane_client.wire import shm

_PER_SIZE = 2  # chunks of one size kept ready: a write and the one after it
_FIT = 1.25  # a chunk serves a write of at least 1/_FIT of its size
RECENT_TAKES = 4  # takes of a size since one of its chunks was recycled: still coming back
_SIZES_FOLLOWED = 64  # recycled sizes whose takes are counted (the most recently recycled)
IN_USE_TAKES = 8  # a size taken within this many takes (of any size) is still being written


def _set_latest(sizes: dict[int, int], size: int, value: int) -> None:
    """``sizes[size] = value`` as the most recent entry, keeping the ``_SIZES_FOLLOWED``
    most recent: jagged writes bring a new size each time, and takes look through them."""
    sizes.pop(size, None)
    sizes[size] = value
    if len(sizes) > _SIZES_FOLLOWED:
        del sizes[next(iter(sizes))]


def _close(chunk: shm.MemFd) -> None:
    chunk.close()


class WarmReserve:
    def __init__(
        self,
        limit_bytes: int,
        make: Callable[[int], shm.MemFd] | None = None,
        discard: Callable[[shm.MemFd], None] | None = None,
    ):
        self.configured = int(limit_bytes)
        # A durable unit's chunks are files in its directory (made there, removed when
        # dropped); else memfds, closed when dropped.
        self._make = make
        self._discard = discard or _close
        self.limit = self.configured  # grows to the largest write seen (never when 0 = off)
        self._ready: list[shm.MemFd] = []  # faulted in
        self._wanted: list[int] = []  # sizes to make next
        self.requested = 0  # chunks asked of the background thread so far (tests observe it)
        self._making = 0  # bytes of the chunk the background thread is making now
        # Per size of freed chunks kept for reuse: takes of that size since one came back.
        self._takes_since_back: dict[int, int] = {}
        self._takes = 0  # takes of any size so far
        self._last_taken: dict[int, int] = {}  # size asked -> ``_takes`` then, latest last
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._fill, name="warm-reserve", daemon=True)
        if self.limit > 0:
            self._thread.start()

    def ready_chunks(self) -> list[shm.MemFd]:
        """The chunks kept ready now (a copy of the list)."""
        with self._lock:
            return list(self._ready)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held()

    def _held(self) -> int:
        return sum(chunk.size for chunk in self._ready)

    @property
    def settled(self) -> bool:
        """Nothing asked for and nothing being made: what the unit holds stays put (tests
        measure its memory then; a chunk in the making counts there, not in the reserve)."""
        with self._lock:
            return not self._wanted and not self._making

    def wait_until_holding(self, nbytes: int, timeout_s: float) -> bool:
        """Block until at least ``nbytes`` are ready (tests and warm-up); False on timeout."""
        with self._lock:
            return self._wake.wait_for(lambda: self._held() >= nbytes, timeout_s)

    def _fits(self, nbytes: int) -> list[int]:
        return [i for i, c in enumerate(self._ready) if nbytes <= c.size <= nbytes * _FIT]

    def take(self, nbytes: int) -> shm.MemFd | None:
        """A ready chunk for ``nbytes`` (at most 25% larger), or None; asks for replacements."""
        if self.configured <= 0 or nbytes <= 0:
            return None
        with self._lock:
            self.limit = max(self.limit, nbytes)  # sized from the writes actually seen
            fit = self._fits(nbytes)
            # The smallest that fits; of equal ones the latest back (a recycled chunk,
            # which the writer that filled it before still has mapped).
            best = min(fit, key=lambda i: (self._ready[i].size, -i)) if fit else None
            got = self._ready.pop(best) if best is not None else None
            comes_back = self._counts_take(nbytes)
            self._takes += 1
            _set_latest(self._last_taken, nbytes, self._takes)
            # Writes of this size keep coming: after a miss have two made ahead; after a
            # hit one more only when none is left. Neither when freed chunks of this size
            # come back (put/clear) and the limit has no room for one made beside the one
            # coming back: the next recycle would evict it, its zeroing (a core busy for
            # 0.2-0.5 s per GiB) wasted beside the writer's copy. (A put's lease for the
            # writer's next put misses so whenever its write took the only chunk.)
            size = nbytes if got is None else got.size
            no_room = comes_back and self._held() + size + nbytes > self.limit
            # A miss beside ready chunks that leave no room for it (another size's, kept
            # while in use): a chunk made now would not be kept.
            full = got is None and self._held() + nbytes > self.limit
            if no_room or full:
                want = 0
            else:
                want = 2 if got is None else (0 if len(fit) > 1 else 1)
            self._wanted.extend([nbytes] * want)
            self.requested += want
            self._wake.notify()
        return got

    def _counts_take(self, nbytes: int) -> bool:
        """Count a take of ``nbytes`` against the sizes that serve it; True when one of
        them came back (was recycled) within the last ``RECENT_TAKES`` takes: put/clear.
        Writes that free nothing stop counting as coming back after that many."""
        comes_back = False
        for size, takes in list(self._takes_since_back.items()):
            if nbytes <= size <= nbytes * _FIT:
                comes_back = comes_back or takes < RECENT_TAKES
                if takes + 1 < RECENT_TAKES:
                    self._takes_since_back[size] = takes + 1
                else:  # no longer coming back: as if never recycled
                    del self._takes_since_back[size]
        return comes_back

    def _in_use(self, size: int) -> bool:
        """Whether writes a chunk of ``size`` serves were asked within the last
        ``IN_USE_TAKES`` takes."""
        return any(
            n <= size <= n * _FIT and self._takes - at < IN_USE_TAKES
            for n, at in self._last_taken.items()
        )

    def recycle(self, chunk: shm.MemFd) -> list[str]:
        """Keep a freed chunk (no reader maps it) for the next write of its size, or close it.

        Returns the names of the chunks this closed (``chunk`` itself when not kept; older
        ready ones when that made room for it).
        """
        evicted = []
        with self._lock:
            same = [c for c in self._ready if c.size == chunk.size]
            if len(same) >= _PER_SIZE:  # the oldest of its size goes: it is the least mapped
                evicted.append(same[0])
                self._ready.remove(same[0])
            # Older chunks make room for it (a writer has this one mapped; they may be
            # unused), but not a larger one of a size still being written: writes of two
            # sizes the limit cannot hold together would then both miss every time, the
            # larger (costlier to make) one included. The smaller one is closed instead.
            evictable = [c for c in self._ready if c.size <= chunk.size or not self._in_use(c.size)]
            short = self._held() + chunk.size - self.limit
            if chunk.size <= self.limit and 0 < short <= sum(c.size for c in evictable):
                for c in evictable:  # oldest first
                    if self._held() + chunk.size <= self.limit:
                        break
                    self._ready.remove(c)
                    evicted.append(c)
            keep = (
                not self._closed and self.configured > 0 and self._held() + chunk.size <= self.limit
            )
            if keep:
                self._ready.append(chunk)
                _set_latest(self._takes_since_back, chunk.size, 0)
                self._wake.notify_all()
        if not keep:
            with self._lock:
                self._ready.extend(evicted)
            evicted = [chunk]
        for c in evicted:
            self._discard(c)
        return [c.name for c in evicted]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            ready, self._ready = self._ready, []
            self._wake.notify()
        for chunk in ready:
            self._discard(chunk)

    def _fill(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._wanted:
                    self._wake.wait()
                if self._closed:
                    return
                size = self._wanted.pop(0)
                if self._held() + size > self.limit:
                    continue
                self._making = size
            try:
                made = (self._make or shm.create)(
                    size
                )  # the zeroing happens here, off the write path
            except OSError:  # out of descriptors or memory: the write path reports its own
                made = None
            with self._lock:
                self._making = 0
                if made is None:
                    continue
                # Freed chunks recycled while this one was being made may have filled the
                # reserve: the limit holds, the new chunk goes.
                unwanted = self._closed or self._held() + made.size > self.limit
                if not unwanted:
                    self._ready.append(made)
                    self._wake.notify_all()
            if unwanted:
                self._discard(made)
                if self._closed:
                    return
