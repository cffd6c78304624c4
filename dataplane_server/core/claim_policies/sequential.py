"""``sequential``: the oldest ready rows first, up to the batch size (the default)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dataplane_server.core.claim_policies.base import (
    PartitionTraits,
    ReadyRows,
    only_options,
    register,
)


@register("sequential")
class Sequential:
    def check_options(self, options: Mapping[str, Any], traits: PartitionTraits) -> dict:
        only_options("sequential", options, ())
        return {}

    def choose(self, ready: ReadyRows, batch_size: int, options: Mapping[str, Any]) -> np.ndarray:
        return np.arange(min(batch_size, len(ready)), dtype=np.int64)
