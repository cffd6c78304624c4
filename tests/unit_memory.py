"""What one storage-unit process holds, read from /proc: its own figures, never the machine's.

A unit keeps its bytes in memfds it does not map, so they are not in its
resident pages: its memory is its unique set size (USS) plus the sizes of the
memfds its descriptors hold.
"""

import os

import psutil
import ray


def unit_pid(handle, index: int = 0) -> int:
    return ray.get(handle.units[index].ping.remote()).pid


def unit_bytes(handle, index: int = 0) -> int:
    """The bytes the unit counts as held (its metrics' figure), staged ones included."""
    return ray.get(handle.units[index].metrics_snapshot.remote()).bytes


def open_fds(pid: int) -> list[str]:
    return os.listdir(f"/proc/{pid}/fd")


# Descriptors Ray and gRPC open and close on their own (connections to other workers,
# wakeup pipes, epoll/eventfd): not a resource the unit's data path holds.
_TRANSPORT_PREFIXES = ("socket:", "pipe:", "anon_inode:")


def data_fds(pid: int) -> int:
    """Open descriptors that are files or memfds (the unit's own resources)."""
    count = 0
    for fd in open_fds(pid):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed while we looked
            continue
        count += not target.startswith(_TRANSPORT_PREFIXES)
    return count


def _memfd_paths(pid: int) -> list[str]:
    out = []
    for fd in open_fds(pid):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(path).startswith("/memfd:"):
                out.append(path)
        except FileNotFoundError:  # closed while we looked
            continue
    return out


def memfds(pid: int) -> int:
    """How many memfd descriptors the process holds."""
    return len(_memfd_paths(pid))


def memfd_bytes(pid: int) -> int:
    """Bytes of the memfds the process holds open (each counted once)."""
    seen, total = set(), 0
    for path in _memfd_paths(pid):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if st.st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_size
    return total


def unit_memory(pid: int) -> int:
    return psutil.Process(pid).memory_full_info().uss + memfd_bytes(pid)
