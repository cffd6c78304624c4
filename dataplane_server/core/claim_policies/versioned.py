"""``version_order`` and ``freshest_first``: claims ordered by policy version.

For a partition registered with a ``StalenessSpec``. ``version_order`` hands
out the oldest version first (ties: commit order), so a trainer drains each
generation before the next; ``freshest_first`` the newest first, for a trainer
that would rather learn from the most on-policy samples and let the window drop
the rest. The default policies (``sequential``, ``grpo_groups``) hand out in
commit order: oldest committed first. A GRPO partition's groups stay whole and
complete, ordered by their oldest member's version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dataplane_client.wire.errors import InvalidBatch
from dataplane_server.core.claim_policies.base import (
    PartitionTraits,
    ReadyRows,
    only_options,
    register,
)
from dataplane_server.core.claim_policies.grpo_groups import complete_groups, whole_groups


class _ByVersion:
    name = ""
    newest_first = False

    def check_options(self, options: Mapping[str, Any], traits: PartitionTraits) -> dict:
        only_options(self.name, options, ())
        if traits.version_tag is None:
            raise InvalidBatch(
                f"claim policy {self.name!r} needs a partition registered with a StalenessSpec"
            )
        return {}

    def choose(self, ready: ReadyRows, batch_size: int, options: Mapping[str, Any]) -> np.ndarray:
        if not len(ready):
            return np.zeros(0, dtype=np.int64)
        key = -ready.versions if self.newest_first else ready.versions
        if ready.group_size is None:
            # A stable sort keeps commit order among rows of one version.
            return np.argsort(key, kind="stable")[:batch_size]
        positions, codes = complete_groups(ready)
        if not len(positions):
            return positions
        _, first = np.unique(codes, return_index=True)  # each group's oldest ready row
        first = np.sort(first)
        ordered = codes[first][np.argsort(key[positions[first]], kind="stable")]
        return whole_groups(positions, codes, ordered, batch_size // ready.group_size)


@register("version_order")
class VersionOrder(_ByVersion):
    name = "version_order"


@register("freshest_first")
class FreshestFirst(_ByVersion):
    name = "freshest_first"
    newest_first = True
