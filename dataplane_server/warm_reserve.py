"""Pre-faulted shared-memory chunks, made ahead of time off the write path.

Fresh memory costs the kernel a page fault and a page of zeroing per 4 KiB on
first touch: for a 128 MiB write that is several times the copy itself. A unit
therefore keeps a small reserve of chunks that a background thread has already
created and faulted in, sized like the writes it has seen, and hands one out
when a write fits. Chunks are never recycled after holding data: a reader may
still map them copy-on-write, so their pages must stay as they were.
"""

from __future__ import annotations

import threading

from dataplane_client import shm


class WarmReserve:
    def __init__(self, limit_bytes: int):
        self.limit = int(limit_bytes)
        self._ready: list[shm.MemFd] = []  # faulted in
        self._wanted: list[int] = []  # sizes to make next
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._fill, name="warm-reserve", daemon=True)
        if self.limit > 0:
            self._thread.start()

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held()

    def _held(self) -> int:
        return sum(chunk.size for chunk in self._ready)

    def wait_until_holding(self, nbytes: int, timeout_s: float) -> bool:
        """Block until at least ``nbytes`` are ready (tests and warm-up); False on timeout."""
        with self._lock:
            return self._wake.wait_for(lambda: self._held() >= nbytes, timeout_s)

    def take(self, nbytes: int) -> shm.MemFd | None:
        """A ready chunk for ``nbytes`` (at most 25% larger), or None; asks for a replacement."""
        if self.limit <= 0 or nbytes <= 0 or nbytes > self.limit:
            return None
        with self._lock:
            fit = [i for i, c in enumerate(self._ready) if nbytes <= c.size <= nbytes * 1.25]
            got = self._ready.pop(min(fit, key=lambda i: self._ready[i].size)) if fit else None
            # Writes of this size keep coming: have the next one ready, and after a miss
            # one more, so back-to-back writes find the reserve a step ahead.
            self._wanted.extend([nbytes] * (1 if got else 2))
            self._wake.notify()
        return got

    def close(self) -> None:
        with self._lock:
            self._closed = True
            ready, self._ready = self._ready, []
            self._wake.notify()
        for chunk in ready:
            chunk.close()

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
            try:
                made = shm.create(size)  # the zeroing happens here, off the write path
            except OSError:
                continue  # out of descriptors or memory: the write path makes (and reports) its own
            with self._lock:
                if self._closed:
                    made.close()
                    return
                self._ready.append(made)
                self._wake.notify_all()
