"""Claim policies: which ready rows a claim hands out (see ``base``), by name.

Every module of this package is imported here, so a policy in a new file of
it registers itself: nothing else to edit. No Ray anywhere in it.
"""

from __future__ import annotations

import importlib
import pkgutil

from dataplane_server.core.claim_policies.base import (
    ClaimPolicy,
    PartitionTraits,
    ReadyRows,
    RowColumns,
    get,
    names,
    register,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "ClaimPolicy",
    "PartitionTraits",
    "ReadyRows",
    "RowColumns",
    "get",
    "names",
    "register",
]
