"""Holding writes to the units back for the instant a checkpoint takes its cut.

A cut names the samples committed up to one commit sequence number, with the
consumption of that instant; the units then pin exactly those samples' bytes
(``core/unit/checkpoint.py``). Between the two, the units must hold what the key
space says: no publish may be half done (published on a unit, not yet applied),
and no clear or delete may free bytes the cut names before they are pinned.

So commits pass ``publishing`` (from their check to their apply) and frees pass
``freeing``; ``closed`` stops new ones, waits for commits under way to finish,
and lets the cut happen. Claims, acks and reads never wait here. The gate is
closed only while the units pin (metadata, milliseconds); the copy of the bytes
happens after it opens.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class CutGate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()  # no commit between its check and its apply
        self._idle.set()
        self._under_way = 0

    @contextlib.asynccontextmanager
    async def publishing(self) -> AsyncIterator[None]:
        """A commit from its check to its apply (and its undo, if any)."""
        await self._open.wait()
        self._under_way += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._under_way -= 1
            if not self._under_way:
                self._idle.set()

    async def freeing(self) -> None:
        """Before bytes are freed on the units: wait while a cut is being taken."""
        await self._open.wait()

    @contextlib.asynccontextmanager
    async def closed(self) -> AsyncIterator[None]:
        """No commit under way nor starting, no free starting, until the block ends."""
        self._open.clear()
        try:
            await self._idle.wait()
            yield
        finally:
            self._open.set()
