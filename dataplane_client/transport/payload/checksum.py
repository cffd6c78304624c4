"""The checksum every cross-node transfer is checked with: CRC-32C (Castagnoli), computed
by the ``crc32c`` package with the CPU's CRC32 instruction where it has one.

Why not ``zlib.crc32``: on this machine CRC-32C hashes 128 MiB in 8.6 ms against zlib's
19 ms (2026-11-29), and a get checks every byte it pulls before it returns. The package
comes with the ``mooncake`` extra; a process without it cannot check what it pulls, so it
is one more reason the probe falls back to Ray (both sides must hash alike: the unit
refuses to offer Mooncake without it, a reader refuses to use it).
"""

from __future__ import annotations

from typing import Any

NAME = "CRC-32C"

_crc32c: Any
try:
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - the extra installs it
    _crc32c = None


def missing() -> str | None:
    """Why this process cannot compute the checksum, or None when it can."""
    if _crc32c is None:
        return "the crc32c package is not installed (pip install 'rl-dataplane[mooncake]')"
    return None


def of(buf: Any) -> int:
    """The CRC-32C of a bytes-like object (the GIL is released while it hashes)."""
    assert _crc32c is not None, missing()
    return int(_crc32c.crc32c(buf))
