"""Same-node shared memory for bulk bytes.

A storage unit keeps its bytes in anonymous ``memfd`` chunks and never names
them in a file system, so nothing leaks when a unit dies: the kernel frees the
memory once the unit's descriptor and every mapping are gone. The unit holds
exactly one descriptor per chunk and no mapping of its own (it copies with
``pread``/``pwrite``), so its descriptors grow with the chunks it holds.

A client on the same node opens ``/proc/<unit pid>/fd/<n>`` (same user only) and

- writes a put's bytes straight into the region the unit allocated (one copy),
  through a mapping of the whole chunk that it keeps (:class:`KeptMaps`): the
  unit recycles freed chunks for later writes of their size, so the next write
  finds its destination mapped and faulted in, and pays for the copy alone
  (mapping, faulting in and unmapping 128 MiB cost about as much as copying it);
- reads a contiguous selection as a writable tensor with no copy at all: a view
  of a copy-on-write mapping of the chunk, which it keeps too (:class:`ViewMaps`),
  lent to one get at a time, so a steady-state get maps and faults nothing anew;
  any other selection is gathered into a fresh buffer out of a kept read-only
  mapping (:data:`read_maps`). Each read holds the unit's lease on the chunks it
  named until its last view is gone, so a chunk a reader still sees is never
  recycled for another write (the mapping keeps the bytes alive if the unit
  frees the chunk meanwhile).

Descriptor numbers are reused by the kernel, so what was opened is checked
against the chunk's unique memfd name (:class:`ChunkChanged` on a mismatch).

A unit with a durability level above ``memory`` keeps its chunks as named files in
a directory instead (``create(..., directory=)``): they outlive its process, and a
restarted unit opens them again. A reader opens such a chunk by its file path, and
checks that the descriptor it got is that file; file names are unique too.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import secrets
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from dataplane_client.wire import failpoints
from dataplane_client.wire.messages import ChunkRef

PAGE = mmap.PAGESIZE

# Chunk names are unique for the life of this process: a token per process, a serial per chunk.
_PROCESS_TOKEN = secrets.token_hex(4)
_SERIAL = itertools.count()
_ZEROS = bytes(4 << 20)


class ChunkChanged(OSError):
    """The descriptor a unit named now holds another chunk (the one meant was freed)."""


def chunk_prefix() -> str:
    """What every chunk name this process makes starts with."""
    return f"dataplane-{_PROCESS_TOKEN}-"


ALIGN = 64  # fields of one write laid out in one region start on cache-line boundaries


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """(offset of each field, bytes in all) of a write's fields placed back to back in one
    region; writer and unit compute it alike for a leased region."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += -(-int(n) // ALIGN) * ALIGN
    return offsets, pos


def supported() -> bool:
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "memfd_create")
        and os.path.isdir("/proc/self/fd")
    )


@dataclass
class MemFd:
    """One shared-memory chunk as its owner holds it: a single descriptor, no mapping."""

    fd: int
    size: int
    name: str
    path: str | None = None  # a named file's path (durable units); None: an anonymous memfd

    def ref(self) -> ChunkRef:
        if self.path is not None:
            return ChunkRef(self.path, self.name)
        return ChunkRef(f"/proc/{os.getpid()}/fd/{self.fd}", self.name)

    def write(self, offset: int, data: np.ndarray) -> None:
        view = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
        while len(view):
            done = os.pwrite(self.fd, view, offset)
            view, offset = view[done:], offset + done

    def read_into(self, offset: int, out: np.ndarray) -> None:
        view = out.data
        while len(view):
            done = os.preadv(self.fd, [view], offset)
            if done <= 0:
                raise OSError(f"chunk {self.name}: short read at offset {offset}")
            view, offset = view[done:], offset + done

    def close(self) -> None:
        os.close(self.fd)


def create(nbytes: int, directory: str | None = None, prefault: bool = True) -> MemFd:
    """A new memfd of ``nbytes`` with every page allocated and cleared; with ``directory``,
    a new file there instead (named like a memfd, so unique), which outlives this process.

    The pages are written with ``pwrite`` (which releases the GIL), so the
    kernel's allocate-and-zero work on first touch is done here, and a
    background thread can do it while the owner's event loop keeps serving;
    whoever maps the chunk later finds its pages ready. ``prefault=False`` (a file on
    a disk) reserves the blocks with ``fallocate`` instead of writing zeros to the disk.
    """
    name = f"{chunk_prefix()}{next(_SERIAL)}"
    path = None if directory is None else os.path.join(directory, name)
    if path is None:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        size = max(int(nbytes), 1)
        os.ftruncate(fd, size)
        if not prefault:
            os.posix_fallocate(fd, 0, size)
        else:
            for offset in range(0, size, len(_ZEROS)):
                os.pwrite(fd, memoryview(_ZEROS)[: min(len(_ZEROS), size - offset)], offset)
    except BaseException:
        os.close(fd)
        if path is not None:
            os.unlink(path)
        raise
    return MemFd(fd, size, name, path)


def open_file(path: str) -> MemFd:
    """A chunk file an earlier process of a durable unit made (``create(..., directory=)``)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    return MemFd(fd, os.fstat(fd).st_size, os.path.basename(path), path)


def _open_verified(chunk: ChunkRef, flags: int, end: int) -> int:
    """Open ``chunk.path`` and check it is that chunk (and holds ``end`` bytes)."""
    failpoints.reached(failpoints.CHUNK_OPEN, chunk.path)  # the unit may free it meanwhile
    fd = os.open(chunk.path, flags)
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
        # A durable unit's chunk is a named file: the path opened must be that file still.
        meant = chunk.path if not chunk.path.startswith("/proc/") else None
        if opened != (meant or f"/memfd:{chunk.name} (deleted)"):
            raise ChunkChanged(f"{chunk.path} is {opened!r} now, not chunk {chunk.name}")
        if os.fstat(fd).st_size < end:  # mapping past the end would fault (SIGBUS) on access
            raise ChunkChanged(f"chunk {chunk.name} is shorter than {end} bytes")
    except BaseException:
        os.close(fd)
        raise
    return fd


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    """One mapped range, unmapped when the last array viewing it is gone.

    Python's ``mmap`` keeps a duplicate descriptor for as long as the mapping
    lives, so a reader holding many tensors would hold as many descriptors;
    the kernel needs none once a range is mapped, so this maps with libc and
    owns only the address range.
    """

    def __init__(self, fd: int, length: int, prot: int, flags: int, offset: int, keep: Any = None):
        addr = _libc.mmap(None, length, prot, flags, fd, offset)
        if addr in (None, _MAP_FAILED):
            code = ctypes.get_errno() or errno.ENOMEM
            raise OSError(code, f"mmap of {length} bytes failed: {os.strerror(code)}")
        self.addr, self.length = addr, length
        self.keep = keep  # e.g. the read lease, released only once this mapping is gone
        # The registrar (e.g. CUDA's) that pinned this range, undone before the unmap;
        # None: not pinned; False: pinning was refused (not asked again).
        self.pinned_by: Any = None
        self.lent = False  # a kept copy-on-write mapping some get's views use (ViewMaps)
        read_only = not prot & mmap.PROT_WRITE
        self.__array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (addr, read_only),
            "version": 3,
        }

    def __del__(self, _munmap=_libc.munmap):  # bound now: module globals go at exit
        if self.pinned_by:  # last view gone: no device copy can still be using the range
            try:
                self.pinned_by.unregister(self.addr)
            except Exception:  # noqa: BLE001 - CUDA already torn down (exit): nothing to undo
                pass
        _munmap(self.addr, self.length)


def _map(
    chunk: ChunkRef,
    start: int,
    end: int,
    *,
    private: bool,
    writable: bool,
    populate: bool,
    keep: Any = None,
    whole: bool = False,
) -> np.ndarray:
    """Map bytes [start, end) of ``chunk`` (``whole``: the whole chunk); offsets need not
    be page aligned."""
    if end <= start:
        return np.empty(0, dtype=np.uint8)
    base = 0 if whole else start - start % PAGE
    fd = _open_verified(chunk, os.O_RDWR if writable and not private else os.O_RDONLY, end)
    try:
        length = os.fstat(fd).st_size if whole else end - base
        flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
        if populate:  # fault every page in now, in bulk, rather than one fault per page later
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mapping = _Mapping(fd, length, prot, flags, base, keep)
    finally:
        os.close(fd)  # the mapping keeps the memory alive on its own
    view = np.asarray(mapping)
    return view if whole else view[start - base : end - base]


class Registrar(Protocol):
    """Pins host memory for a device's copies (``devices.CudaRegistrar``; tests inject
    their own): ``register`` says whether it pinned the range."""

    def register(self, addr: int, nbytes: int) -> bool: ...

    def unregister(self, addr: int) -> None: ...


class KeptMaps:
    """A process's shared mappings of units' chunks, kept across writes or reads (one per
    chunk): writable for writers (:data:`write_maps`), read-only as the source of a
    reader's gathers (:data:`read_maps`).

    A unit hands a freed chunk to the next write of its size, so a writer that
    mapped it before copies into pages that are already mapped and faulted in, and
    a reader copies out of such pages. A chunk's name is checked when it is mapped
    (``_open_verified``) and names are never reused, so a mapping found by name is
    that chunk's. Bounded: least recently used mappings beyond ``max(floor, 2 x the
    largest chunk)`` bytes are dropped, as are chunks the unit reports closed (a kept
    mapping of a closed chunk would hold its memory).

    A process that moves bytes to or from a GPU also reads through these mappings
    (``assembly.assemble_on``) and pins them (``pin_with``): each kept mapping is
    registered once, when kept, and unregistered when it goes (its last view gone),
    since registering costs about as much as copying the bytes.
    """

    FLOOR_BYTES = 512 << 20

    def __init__(self, writable: bool = True) -> None:
        self.writable = writable
        self._maps: OrderedDict[str, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._largest = 0
        self._lock = threading.Lock()  # async puts of several threads share one process
        self.registrar: Registrar | None = None  # set by pin_with: pin every kept mapping
        self._pin_lock = threading.Lock()  # one registration at a time, apart from lookups

    def pin_with(self, registrar: Registrar) -> None:
        """Pin every kept mapping with ``registrar`` from now on (those kept already too)."""
        self.registrar = registrar
        with self._lock:
            kept = list(self._maps.values())
        for whole in kept:
            self._pin(whole)

    def _pin(self, whole: np.ndarray) -> None:
        """Register a kept mapping once (never again after a refusal)."""
        registrar, mapping = self.registrar, whole.base
        if registrar is None or not isinstance(mapping, _Mapping):
            return
        with self._pin_lock:
            if mapping.pinned_by is None:
                ok = registrar.register(mapping.addr, mapping.length)
                mapping.pinned_by = registrar if ok else False

    def region(self, chunk: ChunkRef, start: int, nbytes: int) -> np.ndarray:
        """A shared view of bytes [start, start + nbytes) of ``chunk`` (writable if the
        mappings are)."""
        with self._lock:
            whole = self._maps.get(chunk.name)
            if whole is not None:
                self._maps.move_to_end(chunk.name)
        if whole is None or len(whole) < start + nbytes:
            whole = _map(
                chunk,
                start,
                start + nbytes,
                private=False,
                writable=self.writable,
                populate=True,
                whole=True,
            )
            self._pin(whole)
            self._keep(chunk.name, whole)
        return whole[start : start + nbytes]

    def _keep(self, name: str, whole: np.ndarray) -> None:
        with self._lock:
            old = self._maps.pop(name, None)
            self._bytes += len(whole) - (len(old) if old is not None else 0)
            self._maps[name] = whole
            self._largest = max(self._largest, len(whole))
            while self._bytes > max(self.FLOOR_BYTES, 2 * self._largest) and len(self._maps) > 1:
                _, dropped = self._maps.popitem(last=False)
                self._bytes -= len(dropped)

    def forget(self, names: list[str], prefix: str | None = None) -> None:
        """Drop the mappings of closed chunks (``prefix``: of every chunk of that unit)."""
        with self._lock:
            gone = [n for n in self._maps if prefix is not None and n.startswith(prefix)]
            for name in [*gone, *names]:
                dropped = self._maps.pop(name, None)
                if dropped is not None:
                    self._bytes -= len(dropped)

    def mapped_bytes(self, prefix: str = "") -> int:
        """Bytes mapped in all, or of the chunks whose names start with ``prefix`` (one
        unit's chunks: ``chunk_prefix()`` in its process)."""
        with self._lock:
            if not prefix:
                return self._bytes
            return sum(len(m) for name, m in self._maps.items() if name.startswith(prefix))

    def pinned_bytes(self) -> int:
        """Bytes of the kept mappings a registrar pinned (reports, ``make gpu-check``)."""
        with self._lock:
            return sum(len(m) for m in self._maps.values() if getattr(m.base, "pinned_by", None))


class _Loan:
    """One get's use of a kept copy-on-write mapping: the base of every view it made, it
    holds the read's lease while they live and gives the mapping back when they are gone."""

    def __init__(self, mapping: _Mapping, lease: Any):
        self.mapping, self.lease = mapping, lease
        self.__array_interface__ = mapping.__array_interface__

    def __del__(self) -> None:
        self.mapping.lent = False  # one assignment: safe from whichever thread drops it


class ViewMaps(KeptMaps):
    """Copy-on-write mappings of units' chunks, kept across gets and lent to one get at a time.

    A get's tensors view such a mapping with no copy, and stay writable: a caller's
    write makes a private copy of the page it touches and never reaches the unit. Two
    gets sharing a mapping would see each other's writes, so a mapping is lent to one
    get (a :class:`_Loan`, which its views hold) and a get that finds it lent maps the
    chunk afresh, as before mappings were kept. Once a loan's views are all gone, the
    pages its caller wrote are found (the ``PAGEMAP_SCAN`` ioctl of ``/proc/self/pagemap``,
    Linux 6.7+: present, no longer the chunk's page) and dropped before the next loan,
    whose views then read the chunk's bytes again: a steady-state get faults in nothing
    but those pages. Without that ioctl every get maps afresh.
    """

    def lend(self, chunk: ChunkRef, end: int, lease: Any) -> np.ndarray | None:
        """A writable view of the whole of ``chunk`` (at least ``end`` bytes long) for one
        get, holding ``lease`` until its last view goes; None when another get's views
        still use the kept mapping, or the kernel cannot scan this process's page map."""
        if _pagemap() is None:
            return None
        with self._lock:
            whole = self._maps.get(chunk.name)
            kept = None if whole is None else _mapping_of(whole)
            if kept is not None:
                self._maps.move_to_end(chunk.name)
                if kept.lent:
                    return None
                if kept.length < end:
                    kept = None  # mapped before the chunk was this long: map it again
                else:
                    kept.lent = True
        if kept is None:
            whole = _map(chunk, 0, end, private=True, writable=True, populate=False, whole=True)
            kept = _mapping_of(whole)
            kept.lent = True
            self._keep(chunk.name, whole)
        else:
            try:
                _drop_written_pages(kept)
            except OSError:
                self.forget([chunk.name])  # not made pristine: never lent again
                return None
        return np.asarray(_Loan(kept, lease))


def _mapping_of(whole: np.ndarray) -> _Mapping:
    """The mapping a kept array views (``_map(..., whole=True)`` made it)."""
    mapping = whole.base
    assert isinstance(mapping, _Mapping)
    return mapping


_pagemap_fd: tuple[int, int] | None = None  # (pid that opened it, descriptor)
_pagemap_lock = threading.Lock()


class _ScanArgs(ctypes.Structure):
    """``struct pm_scan_arg`` of the ``PAGEMAP_SCAN`` ioctl (Linux 6.7+, linux/fs.h)."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "size",
            "flags",
            "start",
            "end",
            "walk_end",
            "vec",
            "vec_len",
            "max_pages",
            "category_inverted",
            "category_mask",
            "category_anyof_mask",
            "return_mask",
        )
    ]


_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArgs) << 16) | (ord("f") << 8) | 16  # _IOWR
_PAGE_IS_FILE, _PAGE_IS_PRESENT = 1 << 2, 1 << 3
_SCAN_REGIONS = 256  # (start, end, categories) triples per call
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]


def _pagemap() -> int | None:
    """This process's ``/proc/self/pagemap``, opened once per process, if the kernel can
    scan it for written pages (``PAGEMAP_SCAN``); None otherwise."""
    global _pagemap_fd
    held = _pagemap_fd
    if held is not None and held[0] == os.getpid():
        return held[1]
    with _pagemap_lock:
        if _pagemap_fd is None or _pagemap_fd[0] != os.getpid():  # none, or a parent's
            try:
                fd = os.open("/proc/self/pagemap", os.O_RDONLY)
            except OSError:
                return None
            try:
                _written_ranges(fd, 0, 0)
            except OSError:  # an older kernel: no kept copy-on-write mappings
                os.close(fd)
                return None
            _pagemap_fd = (os.getpid(), fd)
        return _pagemap_fd[1]


def _written_ranges(fd: int, addr: int, length: int) -> list[tuple[int, int]]:
    """(start, end) address ranges of the pages in [addr, addr + length) that are present
    but no longer a file's page: in a private mapping of a chunk, the pages written since
    (private copies). The kernel walks the page tables and returns only those ranges."""
    regions = (ctypes.c_uint64 * (3 * _SCAN_REGIONS))()
    found, start, end = [], addr, addr + length
    while True:
        args = _ScanArgs(
            size=ctypes.sizeof(_ScanArgs),
            start=start,
            end=end,
            vec=ctypes.addressof(regions),
            vec_len=_SCAN_REGIONS,
            category_inverted=_PAGE_IS_FILE,  # matches: present and not a file page
            category_mask=_PAGE_IS_FILE | _PAGE_IS_PRESENT,
            return_mask=_PAGE_IS_PRESENT,
        )
        count = _libc.ioctl(fd, _PAGEMAP_SCAN, ctypes.addressof(args))
        if count < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"PAGEMAP_SCAN failed: {os.strerror(code)}")
        found += [(regions[3 * i], regions[3 * i + 1]) for i in range(count)]
        if args.walk_end >= end:
            return found
        start = args.walk_end  # the regions were full: go on from where the walk stopped


def _drop_written_pages(mapping: _Mapping) -> None:
    """Drop the pages of a copy-on-write mapping that were written (now private copies): the
    next read of each faults the chunk's page back in."""
    fd = _pagemap()
    if fd is None:
        raise OSError(errno.ENOTSUP, "this kernel cannot scan its page map (PAGEMAP_SCAN)")
    for lo, hi in _written_ranges(fd, mapping.addr, mapping.length):
        if _libc.madvise(lo, hi - lo, mmap.MADV_DONTNEED) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"madvise of a kept mapping failed: {os.strerror(code)}")


# One of each per process: every client of this process shares them.
write_maps = KeptMaps()
read_maps = KeptMaps(writable=False)
view_maps = ViewMaps()


def forget_closed(names: list[str], prefix: str | None = None) -> None:
    """A unit closed these chunks (``prefix``: maybe any of its chunks): drop this process's
    kept mappings of them, which would otherwise hold their memory."""
    for maps in (write_maps, read_maps, view_maps):
        maps.forget(names, prefix)


def map_for_write(chunk: ChunkRef, start: int, nbytes: int) -> np.ndarray:
    """A writable shared view of a region a unit allocated for a staged write."""
    return write_maps.region(chunk, start, nbytes)


def map_for_read(chunk: ChunkRef, start: int, end: int, keep: Any = None) -> np.ndarray:
    """A read-only shared view of bytes a unit holds (the source of a gather)."""
    return _map(chunk, start, end, private=False, writable=False, populate=True, keep=keep)


def map_private(chunk: ChunkRef, start: int, end: int, keep: Any = None) -> np.ndarray:
    """A writable copy-on-write view: reads share the unit's pages, writes stay private.

    Not pre-faulted: a reader pays only for the pages it touches. Safe because a
    unit never rewrites bytes it has published, and recycles a chunk only after
    every reader's lease on it (``keep``, held by this mapping) is released.
    """
    return _map(chunk, start, end, private=True, writable=True, populate=False, keep=keep)
