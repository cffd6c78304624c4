"""``dataplane demo --async`` with ``--checkpoint-dir`` / ``--resume``: across any number
of kills and resumes, every prompt of the run is trained exactly once.

The run's dataset is its ``steps x prompts_per_step`` prompts, numbered from 0: prompt
``p``'s tokens and sampling seed come from ``(seed, p)`` (``RolloutActor.write_group``).
The producers take prompt numbers in order from a ``PromptCounter`` and stop when it
runs out.

Saving, after step ``k`` when one is due (``demo.checkpoint_if_due``): the policy is
written into the run checkpoint's temporary directory; ``commit_step(k + 1)`` marks
every claim so far as trained into it; the store is checkpointed, holding that mark;
the manifest records which prompts each step trained (``trained_prompts``, this
module's log) and the directory is renamed into place. Only then are the batches
trained since the last save cleared from the store: until the save is complete, a
resumed run may still need them.

Resuming from ``step-n`` (the store already restored from its checkpoint):
``rewind_to_step(n)`` makes every sample claimed after the mark claimable again (none
in a checkpoint taken at the mark; all claimed since, for a store that outlived its
trainer), the samples of prompts the log says were trained are cleared (trained into
the restored policy), the complete groups of the other prompts stay to be claimed,
and the producers get the remaining prompts, in order. With ``--partial-rollouts`` the
store may hold rollouts a kill interrupted (started, or finished short of their
rewards): their actors are gone, so their groups count as cut short, are cleared and
generated again whole (their partial tokens are not resumed across a kill; they are
across weight updates). So each prompt is trained once
(the log and the mark agree on what the policy holds) and none is skipped (each one
is in the log, in the store or handed out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TRAINED = "trained_prompts"  # the run manifest's entry: step -> prompts it trained


@dataclass
class AsyncLedger:
    """What the async run trained, step by step, and what its store still holds of it."""

    dataset: int  # prompts 0 .. dataset - 1
    checkpointing: bool
    trained: dict[int, list[int]] = field(default_factory=dict)
    # sample ids trained since the last save: cleared once the next one is complete
    uncleared: list[str] = field(default_factory=list)

    @classmethod
    def of_run(cls, args: Any) -> AsyncLedger:
        """The run's dataset; resumed: the log its checkpoint saved."""
        ledger = cls(args.steps * args.prompts_per_step, bool(args.checkpoint_dir))
        if args.resume_manifest:
            saved = args.resume_manifest.get(TRAINED, {})
            ledger.trained = {int(k): list(prompts) for k, prompts in saved.items()}
        return ledger

    def trained_prompts(self) -> set[int]:
        return {p for prompts in self.trained.values() for p in prompts}

    def finish_step(self, client: Any, k: int, meta: Any) -> None:
        """Step ``k`` trained ``meta``'s batch: logged; its samples go now, or after the
        next save when the run saves checkpoints."""
        self.trained[k] = sorted({int(tag["prompt"]) for tag in meta.tags})
        if self.checkpointing:
            self.uncleared += meta.sample_ids
        else:
            client.clear_samples(meta.sample_ids, meta.partition_id)

    def manifest_entry(self) -> dict[str, Any]:
        return {TRAINED: {str(k): prompts for k, prompts in sorted(self.trained.items())}}

    def saved(self, client: Any, partition_id: str) -> None:
        """A checkpoint holding every step so far is complete: their samples go."""
        if self.uncleared:
            client.clear_samples(self.uncleared, partition_id)
        self.uncleared = []


def resume_partition(
    client: Any, partition_id: str, task: str, step: int, ledger: AsyncLedger, generations: int
) -> tuple[list[int], int]:
    """A run resumed from its ``step`` checkpoint (module docstring). Returns the prompts
    the producers must generate, in order, and how many samples the rewind handed back."""
    from policy_workers.rollout import group_sample_ids

    handed_back = client.rewind_to_step(partition_id, task, step)
    trained = ledger.trained_prompts()
    remaining = []
    for prompt in range(ledger.dataset):
        ids = group_sample_ids(partition_id, prompt, generations)
        whole, short = stored_ids(client, partition_id, ids)
        if prompt in trained:
            gone = whole + short  # trained into the restored policy
        elif len(whole) == len(ids):
            continue  # a whole group to claim
        else:  # never written, or cut short (partial rollouts too): generated again, whole
            gone = whole + short
            remaining.append(prompt)
        if gone:
            client.clear_samples(gone, partition_id)
    return remaining, handed_back


def stored_ids(client: Any, partition_id: str, ids: list[str]) -> tuple[list[str], list[str]]:
    """Which of ``ids`` the partition holds whole (with rewards), and which it holds short
    of them: partial rollouts a kill interrupted, in progress or finished and not yet
    given their rewards (``RolloutActor.write_group`` writes them last). One read for a
    whole group, else one per id."""
    from dataplane_client.wire.errors import FieldNotProduced, SamplesNotFound

    def state(some: list[str]) -> str:
        try:
            client.get_samples(some, partition_id, ["rewards"])
        except SamplesNotFound:
            return "absent"
        except FieldNotProduced:
            return "short"
        return "whole"

    if state(ids) == "whole":
        return ids, []
    states = [state([i]) for i in ids]
    return (
        [i for i, st in zip(ids, states) if st == "whole"],
        [i for i, st in zip(ids, states) if st == "short"],
    )
