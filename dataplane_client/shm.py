"""Same-node shared memory for bulk bytes.

A storage unit keeps each chunk in an anonymous ``memfd`` and never names it in
a file system, so nothing leaks when a unit dies: the kernel frees the memory
once the unit's descriptor and every mapping are gone. A client on the same
node opens ``/proc/<unit pid>/fd/<n>`` (same user only) and

- writes a put's bytes straight into the chunk the unit allocated (one copy);
- reads by mapping the chunk copy-on-write: a contiguous selection becomes a
  writable tensor with no copy at all, and the mapping keeps the bytes alive
  even if the unit frees the chunk afterwards.
"""

from __future__ import annotations

import mmap
import os
import sys
from dataclasses import dataclass

import numpy as np

from dataplane_client.codec import EncodedField

PAGE = mmap.PAGESIZE


def supported() -> bool:
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "memfd_create")
        and os.path.isdir("/proc/self/fd")
    )


_ZEROS = bytes(4 << 20)


def create(
    nbytes: int, name: str = "dataplane-chunk", *, map_populated: bool = False
) -> tuple[int, np.ndarray]:
    """A new memfd of ``nbytes`` with every page allocated and cleared, and a writable view.

    The pages are written with ``pwrite`` (which releases the GIL), so the
    kernel's allocate-and-zero work on first touch is done here, and a
    background thread can do it while the owner's event loop keeps serving;
    whoever maps the chunk later finds its pages ready. ``map_populated`` also
    pre-faults this process's mapping, worth it when this process writes the
    chunk itself.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        size = max(int(nbytes), 1)
        os.ftruncate(fd, size)
        for offset in range(0, size, len(_ZEROS)):
            os.pwrite(fd, memoryview(_ZEROS)[: min(len(_ZEROS), size - offset)], offset)
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if map_populated else 0)
        mm = mmap.mmap(fd, size, flags=flags)
    except BaseException:
        os.close(fd)
        raise
    return fd, np.frombuffer(mm, dtype=np.uint8)[: int(nbytes)]


def path_of(fd: int, pid: int | None = None) -> str:
    return f"/proc/{pid or os.getpid()}/fd/{fd}"


def _map(
    path: str, start: int, end: int, *, private: bool, writable: bool, populate: bool
) -> np.ndarray:
    """Map bytes [start, end) of ``path``; offsets need not be page aligned."""
    if end <= start:
        return np.empty(0, dtype=np.uint8)
    base = start - start % PAGE
    fd = os.open(path, os.O_RDWR if writable and not private else os.O_RDONLY)
    try:
        flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
        if populate:  # fault every page in now, in bulk, rather than one fault per page later
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, end - base, flags=flags, prot=prot, offset=base)
    finally:
        os.close(fd)  # the mapping keeps the memory alive on its own
    return np.frombuffer(mm, dtype=np.uint8, count=end - start, offset=start - base)


def map_for_write(path: str, nbytes: int) -> np.ndarray:
    """A writable shared view of a unit's freshly allocated chunk."""
    return _map(path, 0, nbytes, private=False, writable=True, populate=True)


def map_for_read(path: str, start: int, end: int) -> np.ndarray:
    """A read-only shared view of bytes a unit holds (the source of a gather)."""
    return _map(path, start, end, private=False, writable=False, populate=True)


def map_private(path: str, start: int, end: int) -> np.ndarray:
    """A writable copy-on-write view: reads share the unit's pages, writes stay private.

    Not pre-faulted: a reader pays only for the pages it touches.
    """
    return _map(path, start, end, private=True, writable=True, populate=False)


@dataclass
class SharedRows:
    """Where a unit holds some rows of one field: row i is bytes [starts[i], ends[i])
    of the chunk at ``paths[which[i]]``. ``header`` describes the field (no bytes)."""

    header: EncodedField
    paths: list[str]
    which: np.ndarray
    starts: np.ndarray
    ends: np.ndarray

    @property
    def nbytes(self) -> int:
        return int((self.ends - self.starts).sum())
