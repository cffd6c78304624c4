"""``core/file_digest.py``: a checkpoint file's checksum names its algorithm. CRC-32C where
the ``crc32c`` package is installed (checked here against the package directly), SHA-256
where it is not, each verifiable by either kind of process; a running digest over pieces
equals one over the whole; format 2's bare SHA-256 reads as a digest; an unknown or
uncheckable algorithm is a ``CheckpointError`` naming why."""

import hashlib
import os

import pytest

from dataplane_client.wire.errors import CheckpointError
from dataplane_server.core import file_digest

crc32c = pytest.importorskip("crc32c")  # the mooncake extra: make setup and CI install it

DATA = os.urandom(3 << 20) + b"tail"


def test_crc32c_where_installed_and_a_running_digest_equals_one_over_the_whole():
    whole = file_digest.of(DATA)
    assert whole == f"crc32c:{crc32c.crc32c(DATA):08x}"
    running = file_digest.Digest()
    for start in range(0, len(DATA), 1 << 20):
        running.update(memoryview(DATA)[start : start + (1 << 20)])
    assert running.value() == whole
    assert file_digest.matches(whole, DATA)
    assert not file_digest.matches(whole, DATA[:-1] + b"!")


def test_sha256_without_the_package_and_either_checks_the_other(monkeypatch):
    crc = file_digest.of(DATA)
    monkeypatch.setattr(file_digest, "_crc32c", None)
    sha = file_digest.of(DATA)
    assert sha == f"sha256:{hashlib.sha256(DATA).hexdigest()}"
    assert file_digest.matches(sha, DATA)
    with pytest.raises(CheckpointError, match="crc32c package is not installed"):
        file_digest.matches(crc, DATA)  # written where it was, read where it is not
    monkeypatch.undo()
    assert file_digest.matches(sha, DATA)  # and the other way round


def test_format_2s_bare_sha256_and_unknown_algorithms():
    legacy = file_digest.legacy(hashlib.sha256(DATA).hexdigest())
    assert file_digest.matches(legacy, DATA)
    with pytest.raises(CheckpointError, match="unknown checksum algorithm 'md5'"):
        file_digest.matches("md5:abc", DATA)
