"""``SegmentWriter``: a checkpoint segment written past the page cache (O_DIRECT) where the
filesystem allows, plainly where it refuses (tmpfs), the same bytes either way: every
size around the 4 KiB block, a last partial block padded and cut back, appends larger
than the buffer, and a file synced and closed."""

import errno
import os

import numpy as np
import pytest

from dataplane_server.core.unit.segment_file import ALIGN, SegmentWriter, Staging

SIZES = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN + 17, (1 << 20) + 3]


def _direct_opens(directory) -> bool:
    """Whether this filesystem accepts O_DIRECT (the writer's own choice, checked apart)."""
    path = os.path.join(directory, "probe")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0)))
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    finally:
        if os.path.exists(path):
            os.remove(path)
    return hasattr(os, "O_DIRECT")


def _places(tmp_path):
    places = [str(tmp_path)]
    if os.path.isdir("/dev/shm"):  # tmpfs: refuses O_DIRECT, so the plain path runs too
        shm = tmp_path / "shm"
        os.symlink(os.path.realpath("/dev/shm"), shm)
        places.append(str(shm))
    return places


@pytest.mark.parametrize("size", SIZES)
def test_a_segment_holds_exactly_the_bytes_committed_on_either_path(tmp_path, size):
    rng = np.random.default_rng(size)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    for i, place in enumerate(_places(tmp_path)):
        path = os.path.join(place, f"seg-{os.getpid()}-{size}-{i}.data")
        try:
            out = SegmentWriter(path)
            assert out.direct == _direct_opens(place)
            pos = 0
            for step in (7, ALIGN, 1, 5 * ALIGN + 3):  # uneven commits, some across blocks
                n = min(step, size - pos)
                out.reserve(n)[:] = data[pos : pos + n]
                out.commit(n)
                pos += n
            rest = size - pos  # the rest in one append, larger than the buffer
            out.reserve(rest)[:] = data[pos:]
            out.commit(rest)
            out.close()
            assert out.size == size
            with open(path, "rb") as f:
                assert f.read() == data.tobytes()
        finally:
            if os.path.exists(path):
                os.remove(path)


def test_a_segment_is_never_written_over_an_existing_file(tmp_path):
    path = tmp_path / "taken.data"
    path.write_bytes(b"kept")
    with pytest.raises(FileExistsError):
        SegmentWriter(str(path))
    assert path.read_bytes() == b"kept"


def test_a_staging_buffer_serves_file_after_file_without_growing_again(tmp_path):
    """The copy keeps one buffer from one checkpoint to the next (a fresh one is faulted in
    page by page each time): the second file reuses it, and both hold their own bytes."""
    staging = Staging()
    first, second = os.urandom(3 * ALIGN + 5), os.urandom(2 * ALIGN + 1)
    for name, data in (("a", first), ("b", second)):
        out = SegmentWriter(str(tmp_path / name), staging)
        out.reserve(len(data))[:] = np.frombuffer(data, dtype=np.uint8)
        out.commit(len(data))
        out.close()
        if name == "a":
            buffer = staging.buf
    assert staging.buf is buffer, "not grown for a file that fits"
    assert (tmp_path / "a").read_bytes() == first
    assert (tmp_path / "b").read_bytes() == second
