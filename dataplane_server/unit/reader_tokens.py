"""The process tokens of a unit's same-node readers, remembered so a read names its by key.

A read's lease ends when its reader's process dies, which the unit learns from an
object that process owns (its token, ``[ObjectRef]``). Passing that reference on
every read costs Ray borrower bookkeeping on both sides (about 0.2 ms of a call
whose floor is one round trip), so a reader sends it once per unit and names it by
its key (the reference's id bytes) from then on. A unit remembers the most recently
seen ``capacity`` readers; a reader it does not remember (forgotten, or the unit
restarted) is told ``ReaderUnknown`` and sends the token itself again. A forgotten
reader's leases stay safe: the lease table keeps the token itself.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from dataplane_client.wire.errors import InvalidBatch, ReaderUnknown

DEFAULT_CAPACITY = 4096


class ReaderTokens:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._tokens: OrderedDict[bytes, Any] = OrderedDict()

    def resolve(self, owner: list | bytes | None) -> Any:
        """The token a read names: ``[ObjectRef]`` (remembered from now on), the key of
        one sent before, or None (a reader without a token: its leases have no owner)."""
        if owner is None:
            return None
        if isinstance(owner, list):
            (token,) = owner
            key = token.binary()
            self._tokens[key] = token
        elif isinstance(owner, bytes):
            key = owner
            token = self._tokens.get(key)
            if token is None:
                raise ReaderUnknown(f"no reader token with key {key.hex()} is remembered here")
        else:
            raise InvalidBatch(f"a reader's owner is [ObjectRef], its key or None, not {owner!r}")
        self._tokens.move_to_end(key)
        if len(self._tokens) > self.capacity:
            self._tokens.popitem(last=False)
        return token

    def forget(self, dead: set) -> None:
        """Drop the tokens of processes found dead."""
        for key in [k for k, t in self._tokens.items() if t in dead]:
            del self._tokens[key]

    def forget_all(self) -> None:
        self._tokens.clear()

    def __len__(self) -> int:
        return len(self._tokens)
