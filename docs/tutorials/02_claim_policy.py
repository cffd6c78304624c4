"""Tutorial 02: a claim policy of your own, in one class.

Run it: ``.venv/bin/python docs/tutorials/02_claim_policy.py`` (no Ray; a few seconds).

A claim policy decides which of a partition's *ready* samples a claim hands out, and
in which order. The key space works out what is ready (produced, not consumed or
leased) and hands the policy a ``ReadyRows`` view: position 0 is the oldest ready
sample; ``sequence_lengths``, ``group``, ``tag(name)`` and ``sample_ids`` are columns
gathered on first read. The policy returns positions into it (at most ``batch_size``,
distinct, in the order the claimer gets them); everything else (due or not, journal,
leases) stays the key space's. ``@register("name")`` makes it known by name; a
partition names it at registration and a claim may name another.

This one, ``shortest_first``: among the oldest ``window`` ready samples, the shortest
first (a length curriculum that cannot starve a long sample: once it is among the
oldest ``window`` it is handed out like the rest). Two rules every policy keeps:

- it is pure: no state between claims (a restarted controller chooses alike);
- a row it holds back is handed out once nothing else comes, or a blocking claim
  waits for it in vain.

Here it runs twice: alone, on ``ReadyRows.of(...)`` (how its unit test drives it),
then through the in-process client, which runs the same key space in this process.
The Ray service's controller runs in another process, so there a policy must be
importable by it: put the class in its own file in
``dataplane_server/core/claim_policies/`` (the package imports every module in it)
with its test beside the built-in ones (``tests/core/test_claim_policies.py``).

Next: ``03_operate_a_service.py`` runs the service as an operator does.
"""

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dataplane_client.wire.errors import InvalidBatch
from dataplane_server.core.claim_policies.base import (
    PartitionTraits,
    ReadyRows,
    only_options,
    register,
)
from dataplane_server.core.inprocess import InProcessDataPlaneClient


@register("shortest_first")
class ShortestFirst:
    def check_options(self, options: Mapping[str, Any], traits: PartitionTraits) -> dict:
        """At registration and per claim: the options as ``choose`` uses them, or
        ``InvalidBatch`` naming what is wrong (raised before anything changes)."""
        only_options("shortest_first", options, ("window",))
        window = options.get("window", 64)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise InvalidBatch(f"shortest_first: window must be an int >= 1, got {window!r}")
        return {"window": window}

    def choose(self, ready: ReadyRows, batch_size: int, options: Mapping[str, Any]) -> np.ndarray:
        oldest = np.arange(min(len(ready), max(options["window"], batch_size)))
        lengths = ready.sequence_lengths[oldest]  # -1 where the writer gave none
        return oldest[np.argsort(lengths, kind="stable")][:batch_size]


def main() -> None:
    # 1. Alone: five ready rows of these lengths, oldest first.
    ready = ReadyRows.of([7, 2, 5, 9, 3])
    picked = ShortestFirst().choose(ready, batch_size=2, options={"window": 4})
    print("alone:", picked.tolist())  # [1, 2]: lengths 2 and 5; row 4 (3) is outside the window

    # 2. Through a client: the partition names the policy; a claim may override options.
    client = InProcessDataPlaneClient()
    client.register_partition(
        "prompts",
        fields=["input_ids"],
        consumer_tasks=["train"],
        claim_policy="shortest_first",
        policy_options={"window": 8},
    )
    ids = [f"p{i}" for i in range(5)]
    rows = [torch.arange(n) for n in (7, 2, 5, 9, 3)]  # a jagged field: its length is recorded
    client.put_samples(ids, "prompts", {"input_ids": rows})
    first = client.claim_meta("prompts", "train", ["input_ids"], batch_size=2)
    rest = client.claim_meta("prompts", "train", ["input_ids"], batch_size=3)
    print("claims:", first.sample_ids, rest.sample_ids)
    try:
        client.claim_meta("prompts", "train", ["input_ids"], 1, policy_options={"window": 0})
    except InvalidBatch as exc:
        print("refused:", exc)
    client.close()


if __name__ == "__main__":
    main()
