"""Async rollout actors: generate GRPO groups and stream each into the store.

Each actor owns a generation model: the policy's initial weights, replaced by
the trainer's after every training step (``load_weights``, see
``policy_workers.refit``), each load numbered with the policy version it holds.
It samples ``generations`` completions per prompt with ``generate()``, scores
them with a verifiable reward, and writes every finished group with
``put_samples_async`` at once, not batched at the end, with the version that
generated it (``version=``, read back as the ``weight_version`` tag) and the
prompt's index. Before each
write it looks at the service's fill level and backs off while the store is
nearly full.

With ``RolloutConfig.chunk_tokens`` a group is generated in chunks, and a weight
update between two chunks interrupts it: its tokens are thrown away and it starts
over with the new weights, or (``partial_rollouts``) they are stored as a partial
rollout (``append_tokens``) and the group resumes from the store with the new
weights, its tokens of each version carrying that version's logprobs.

A group depends only on (seed, prompt index, the weights): its prompt, lengths
and sampling seed come from an RNG seeded by the first two, not from the
actor's history. So any actor, in any order, writes the same bytes for a
prompt under the same weights, and a run resumed from a checkpoint regenerates
exactly the groups it is missing.
"""

from __future__ import annotations

import asyncio
import collections
import random
from dataclasses import dataclass

import ray
import torch

from dataplane_client.client import connect
from dataplane_client.wire.errors import AdmissionTimeout, CapacityExceeded
from policy_workers.chunked_generation import ChunkedGroup, GroupPlan
from policy_workers.config import ModelConfig
from policy_workers.model import build_hf_model, reference_logprobs
from policy_workers.refit import load_weights

WEIGHT_VERSION = "weight_version"  # the tag naming the policy version a group was generated with

GRPO_FIELDS = [
    "input_ids",
    "input_lengths",
    "token_mask",
    "sample_mask",
    "generation_logprobs",
    "rewards",
]


@dataclass
class RolloutConfig:
    generations: int = 4  # completions per prompt (one GRPO group)
    prompt_len: int = 8
    min_new_tokens: int = 8
    max_new_tokens: int = 24
    temperature: float = 1.0
    high_watermark: float = 0.9  # back off while the store is fuller than this
    backoff_s: float = 0.05
    max_put_attempts: int = 600  # ~30 s of back-off before a full store is reported as an error
    admission_timeout_s: float = 30.0  # produce(): one wait for admission, then ask again
    seed: int = 0
    # Generate in chunks of this many tokens, looking for new weights between them (0: one
    # generate() call, run to its end with the weights it started with). A weight update
    # between chunks interrupts the group: its tokens so far are thrown away and it starts
    # over with the new weights, or, with ``partial_rollouts``, they are stored
    # (``append_tokens``) and the group resumes from the store with the new weights.
    chunk_tokens: int = 0
    partial_rollouts: bool = False


def group_sample_ids(partition_id: str, prompt: int, generations: int) -> list[str]:
    """The sample ids of one prompt's group (the driver looks them up on resume)."""
    return [f"{partition_id}/prompt{prompt}/gen{j}" for j in range(generations)]


def prompt_of(sample_id: str) -> int:
    """The prompt number in a sample id of ``group_sample_ids``."""
    return int(sample_id.split("/")[-2].removeprefix("prompt"))


def parity_reward(prompt: torch.Tensor, completion: torch.Tensor) -> float:
    """Verifiable reward: the fraction of generated tokens with the parity of the prompt's last token."""
    if completion.numel() == 0:
        return 0.0
    return float(((completion % 2) == (prompt[-1] % 2)).float().mean())


@ray.remote
class RolloutActor:
    def __init__(
        self,
        actor_index: int,
        model_cfg: ModelConfig,
        rollout_cfg: RolloutConfig,
        service_name: str,
        namespace: str,
    ):
        torch.set_num_threads(1)
        self.index = actor_index
        self.cfg = rollout_cfg
        self.vocab = model_cfg.vocab_size
        self.model = build_hf_model(model_cfg).eval()
        self.client = connect(service_name, namespace)
        self.version = 0  # the policy version of self.model's weights
        self._new_weights: tuple[int, dict] | None = None  # a refit not applied yet
        # One generation at a time (they seed torch's global RNG); it runs in a thread so
        # that a refit, a stats call or another coroutine is answered meanwhile.
        self._generating = asyncio.Lock()
        self.backoffs = 0
        self.groups_written = 0
        # generated tokens a weight update interrupted: thrown away, or kept and resumed
        self.tokens_discarded = 0
        self.tokens_resumed = 0

    async def _wait_for_room(self) -> None:
        while True:
            info = await self.client.service_info_async()
            if info.bytes < self.cfg.high_watermark * info.capacity_bytes:
                return
            self.backoffs += 1
            await asyncio.sleep(
                self.cfg.backoff_s
            )  # pacing, not synchronisation: re-check the level

    def _generate_group(self, prompt: torch.Tensor, rng: random.Random) -> dict:
        g = self.cfg.generations
        new_tokens = rng.randint(self.cfg.min_new_tokens, self.cfg.max_new_tokens)
        # generate() is synchronous: nothing else in this process draws from torch's RNG
        # between this seed and the sampling.
        torch.manual_seed(rng.randrange(2**31))
        with torch.no_grad():
            seqs = self.model.generate(
                prompt.unsqueeze(0).repeat(g, 1),
                attention_mask=torch.ones(g, len(prompt), dtype=torch.long),
                do_sample=True,
                temperature=self.cfg.temperature,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
            # Completions differ in length inside a group too: cut each at a sampled length.
            lengths = [
                len(prompt) + rng.randint(max(1, new_tokens // 2), new_tokens) for _ in range(g)
            ]
            lengths_t = torch.tensor(lengths)
            logprobs = reference_logprobs(self.model, seqs, lengths_t)
        rows, masks, gen_lp, rewards = [], [], [], []
        for i, n in enumerate(lengths):
            rows.append(seqs[i, :n].clone())
            mask = torch.zeros(n, dtype=torch.bool)
            mask[len(prompt) :] = True
            masks.append(mask)
            gen_lp.append(logprobs[i, :n].clone())
            rewards.append(parity_reward(prompt, seqs[i, len(prompt) : n]))
        return {
            "input_ids": rows,
            "input_lengths": lengths_t,
            "token_mask": masks,
            "sample_mask": torch.ones(g, dtype=torch.float32),
            "generation_logprobs": gen_lp,
            "rewards": torch.tensor(rewards, dtype=torch.float32),
        }

    def load_weights(self, version: int, params: dict[str, torch.Tensor]) -> int:
        """The trainer's weights (``policy_workers.refit``) as policy ``version``: every
        group whose generation starts from now on uses them and carries that version (a
        generation already running finishes with the weights it started with, or, in
        chunks, is interrupted at its next chunk: ``RolloutConfig.chunk_tokens``). Returns it."""
        self._new_weights = (version, params)
        if not self._generating.locked():
            self._take_new_weights()
        return version

    def _take_new_weights(self) -> None:
        if self._new_weights is not None:
            version, params = self._new_weights
            load_weights(self.model, params)
            self.version, self._new_weights = version, None

    async def run(self, partition_id: str, prompt_ids: list[int], first_index: int = 0) -> dict:
        """Generate one group per prompt id and stream each to ``partition_id`` as it finishes.

        Prompt ``p`` is the run's prompt number ``first_index + p`` (its RNG's seed)."""
        for p in prompt_ids:
            ids = group_sample_ids(partition_id, p, self.cfg.generations)
            await self.write_group(partition_id, ids, first_index + p)
            await asyncio.sleep(0)  # let other coroutines of this actor run between groups
        return {"actor": self.index, "groups": len(prompt_ids), "backoffs": self.backoffs}

    async def write_group(self, partition_id: str, ids: list[str], prompt_index: int) -> None:
        """Generates prompt ``prompt_index``'s group with the current weights and puts it
        as ``ids``, tagged with its group, prompt index and weight version."""
        # a str seed is hashed with SHA-512: the same stream in every process
        rng = random.Random(f"{self.cfg.seed}/prompt{prompt_index}")
        prompt = torch.tensor([rng.randrange(3, self.vocab) for _ in range(self.cfg.prompt_len)])
        tag = {
            "group_id": f"prompt{prompt_index}",
            "prompt": prompt_index,
            "actor": self.index,
        }
        tags = [tag] * self.cfg.generations
        tail = None  # the last tokens of a group partly stored already (chunked, resumed)
        async with self._generating:
            self._take_new_weights()
            if self.cfg.chunk_tokens:
                fields, version, tail = await self._generate_in_chunks(
                    partition_id, ids, prompt, rng, tags
                )
            else:
                version = self.version  # the weights this group is generated with
                fields = await asyncio.to_thread(self._generate_group, prompt, rng)
        if tail is None:
            await self._put(ids, partition_id, fields, tags=tags, version=version)
        else:
            # Its last tokens first (finished), then the rest of its fields: a trainer claims
            # only samples with rewards, so the group becomes claimable with the put. And a
            # group with rewards is then always whole, which a resumed run relies on to tell
            # it from one a kill cut short (``async_resume.stored_ids``).
            await self.client.append_tokens_async(ids, partition_id, tail, version, finish=True)
            await self._put(ids, partition_id, fields)
        self.groups_written += 1

    async def _put(self, ids: list[str], partition_id: str, fields: dict, **extras) -> None:
        """``put_samples`` once the store has room, pacing while it finds a unit full."""
        for attempt in range(self.cfg.max_put_attempts):
            await self._wait_for_room()
            try:
                await self.client.put_samples_async(ids, partition_id, fields, **extras)
                return
            except CapacityExceeded:
                # Another writer took the room first (or one unit is full): pace, look again.
                self.backoffs += 1
                if attempt == self.cfg.max_put_attempts - 1:
                    raise
                await asyncio.sleep(self.cfg.backoff_s)

    async def _generate_in_chunks(
        self, partition_id: str, ids: list[str], prompt: torch.Tensor, rng, tags: list[dict]
    ) -> tuple[dict, int, dict | None]:
        """The group in chunks (``chunked_generation``), holding ``_generating``: a refit
        arriving meanwhile waits in ``_new_weights`` until the next chunk boundary, where
        it interrupts the group (``RolloutConfig.chunk_tokens``). Returns the fields to
        put, the version of the last weights used, and the tokens still to append when
        the group was partly stored (None: the fields hold every token)."""
        cfg = self.cfg
        plan = GroupPlan.draw(prompt, rng, cfg.generations, cfg.min_new_tokens, cfg.max_new_tokens)
        group = ChunkedGroup(plan, cfg.chunk_tokens)
        version, stored = self.version, False
        while not group.finished:
            if self._new_weights is not None and group.done:  # a weight update: interrupted
                kept = group.generated_kept()
                if cfg.partial_rollouts:
                    await self.client.append_tokens_async(
                        ids, partition_id, group.unsaved(), version,
                        tags=None if stored else tags, start=not stored,
                    )  # fmt: skip
                    stored = True
                    self._take_new_weights()
                    rows = await self.client.get_samples_async(ids, partition_id, ["input_ids"])
                    group.resume_from(list(rows["input_ids"].unbind()))
                    self.tokens_resumed += kept
                else:
                    self._take_new_weights()
                    group = ChunkedGroup(plan, cfg.chunk_tokens)  # over again
                    self.tokens_discarded += kept
                version = self.version
            await asyncio.to_thread(group.step, self.model, cfg.temperature)
        rewards = [parity_reward(prompt, c) for c in group.completions()]
        dense = {
            "input_lengths": torch.tensor(plan.lengths),
            "sample_mask": torch.ones(cfg.generations, dtype=torch.float32),
            "rewards": torch.tensor(rewards, dtype=torch.float32),
        }
        if stored:
            return dense, version, group.unsaved()
        return {**group.whole(), **dense}, version, None

    async def produce(self, partition_id: str, counter) -> None:
        """``dataplane demo --async``: until the actor is killed, take the next prompt
        number from ``counter``, ask the store to admit its group (waiting while the
        samples started and not trained fill the staleness window), generate it with the
        newest weights loaded, put it, release the grant.

        The prompt comes first: a grant taken and then left unused would still count
        toward its version's over-sampling cap, in this service and in any checkpoint
        of it, holding back the groups a resumed run must generate at that version."""
        g = self.cfg.generations
        while True:
            index = await counter.take.remote()
            grant = None
            while grant is None:
                try:
                    grant = await self.client.admit_rollouts_async(
                        partition_id, g, wait=True, timeout_s=self.cfg.admission_timeout_s
                    )
                except AdmissionTimeout:
                    pass  # the trainer is slow (a long step): still no room, ask again
            try:
                ids = group_sample_ids(partition_id, index, g)
                await self.write_group(partition_id, ids, index)
            finally:
                await self.client.release_rollouts_async(grant)

    def stats(self) -> dict:
        """Back-offs so far (full store), groups written and generated tokens weight updates
        interrupted (thrown away, or stored and resumed), over every ``run`` of this actor
        (a ``run`` that raised returns nothing, so its counts are read here)."""
        return {
            "backoffs": self.backoffs,
            "groups_written": self.groups_written,
            "tokens_discarded": self.tokens_discarded,
            "tokens_resumed": self.tokens_resumed,
        }


@ray.remote(num_cpus=0)
class PromptCounter:
    """Hands out the run's prompt numbers to the producing actors (``--async``), in order:
    a group's prompt is a function of its number, whichever actor generates it. Once
    they run out, ``take`` waits: a prompt the store dropped as stale comes back
    (``give_back``) to be generated again, before the rest."""

    def __init__(self, prompts: list[int]) -> None:
        self.queue = collections.deque(prompts)
        self.more = asyncio.Event()

    async def take(self) -> int:
        while not self.queue:
            self.more.clear()
            await self.more.wait()
        return self.queue.popleft()

    async def give_back(self, prompts: list[int]) -> None:
        self.queue.extendleft(sorted(prompts, reverse=True))
        self.more.set()


def in_prompt_order(meta):
    """The batch sorted by (prompt number, sample id): rollouts finish in any order, a
    batch in a fixed order makes a step (and a resumed run) reproducible bit for bit."""
    order = sorted(range(meta.size), key=lambda i: (meta.tags[i]["prompt"], meta.sample_ids[i]))
    return meta.subset(order)
