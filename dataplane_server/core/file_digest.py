"""The checksum a checkpoint keeps of each of its files, named with its algorithm.

A checkpoint's copy hashes every byte it writes, in the thread that a paced copy keeps
to a small share of a core (``core/unit/checkpoint.py``), so the hash's cost is the
checkpoint's speed at that share: SHA-256 runs at 2.0 GiB/s here, CRC-32C with the
CPU's instruction (the ``crc32c`` package) at 32 GiB/s (2026-11-29). A checkpoint file
is guarded against a torn, truncated or bit-flipped copy, not against tampering, which
is what a CRC is for. A digest reads ``"crc32c:<8 hex>"``; where the package is missing
(it comes with the ``mooncake`` extra) ``"sha256:<hex>"``, so a checkpoint says how to
check it whichever wrote it. Checkpoints of format 2 named a bare SHA-256 hex string:
``legacy`` turns one into a digest.
"""

from __future__ import annotations

import hashlib
from typing import Any

from dataplane_client.wire.errors import CheckpointError

_crc32c: Any
try:
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - make setup and CI install it
    _crc32c = None

CRC32C, SHA256 = "crc32c", "sha256"


class Digest:
    """A running digest: ``update`` with each piece, ``value`` at the end."""

    def __init__(self, algorithm: str | None = None):
        self.algorithm = algorithm or (CRC32C if _crc32c is not None else SHA256)
        if self.algorithm == CRC32C:
            if _crc32c is None:
                raise CheckpointError(
                    "this checkpoint's files are checked with CRC-32C, and the crc32c "
                    "package is not installed here (pip install 'rl-dataplane[mooncake]')"
                )
            self._crc = 0
        elif self.algorithm == SHA256:
            self._sha = hashlib.sha256()
        else:
            raise CheckpointError(f"unknown checksum algorithm {self.algorithm!r}")

    def update(self, data: Any) -> None:
        if self.algorithm == CRC32C:
            self._crc = _crc32c.crc32c(data, self._crc)
        else:
            self._sha.update(data)

    def value(self) -> str:
        if self.algorithm == CRC32C:
            return f"{CRC32C}:{self._crc:08x}"
        return f"{SHA256}:{self._sha.hexdigest()}"


def of(data: Any) -> str:
    """The digest of one buffer."""
    d = Digest()
    d.update(data)
    return d.value()


def checker(expected: str) -> Digest:
    """A running digest of the algorithm ``expected`` names, to compare with it."""
    algorithm, _, _ = expected.partition(":")
    return Digest(algorithm)


def matches(expected: str, data: Any) -> bool:
    d = checker(expected)
    d.update(data)
    return d.value() == expected


def legacy(sha256_hex: str) -> str:
    """A format-2 manifest's bare SHA-256 as a digest."""
    return f"{SHA256}:{sha256_hex}"
