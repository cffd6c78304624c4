"""A GRPO group generated in chunks of tokens, so a weight update can interrupt it between
chunks, and the generation can resume from what the store holds of it.

The group's plan comes first, from the prompt's RNG: how many tokens to generate, where
each completion is cut, and a seed per chunk (``seed + j`` for chunk ``j``). So a chunk
depends only on the tokens before it, the weights and its index: generating chunks
0..j, storing them (``append_tokens``), reading them back and going on with the same
weights gives the same bytes as never stopping (``tests/workers/test_resumed_generation``).
Each chunk's behaviour logprobs are those of the weights that sampled it: a rollout
resumed under newer weights carries per-token logprobs of two policies, which the
decoupled loss (``policy_workers.loss``) weighs token by token.

All rows of a group generate together (one batch); a completion cut before the
group's end still rides along, and its tokens past its cut are never kept. On resume
such a row is padded with its last token: the other rows do not depend on it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from policy_workers.model import reference_logprobs


@dataclass(frozen=True)
class GroupPlan:
    """What a group's generation will be, drawn before its first token."""

    prompt: torch.Tensor  # [P] token ids
    new_tokens: int  # tokens the group generates
    lengths: list[int]  # per completion: prompt + the tokens kept (cut at a sampled length)
    seed: int  # chunk j samples under torch.manual_seed(seed + j)

    @classmethod
    def draw(
        cls, prompt: torch.Tensor, rng: random.Random, generations: int, low: int, high: int
    ) -> GroupPlan:
        new_tokens = rng.randint(low, high)
        seed = rng.randrange(2**31 - 1024)
        cut = [
            len(prompt) + rng.randint(max(1, new_tokens // 2), new_tokens)
            for _ in range(generations)
        ]
        return cls(prompt, new_tokens, cut, seed)


class ChunkedGroup:
    """One group's generation so far: ``seqs`` [G, prompt + done] and their behaviour
    logprobs; ``saved[i]``: row i's tokens already in the store (0: none)."""

    def __init__(self, plan: GroupPlan, chunk_tokens: int):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.plan, self.chunk_tokens = plan, chunk_tokens
        g = len(plan.lengths)
        self.seqs = plan.prompt.unsqueeze(0).repeat(g, 1)
        self.logprobs = torch.zeros(self.seqs.shape, dtype=torch.float32)
        self.done = 0  # tokens generated
        self.saved = [0] * g

    @property
    def finished(self) -> bool:
        return self.done >= self.plan.new_tokens

    def step(self, model: Any, temperature: float) -> None:
        """Generate the next chunk with ``model`` (its weights: this chunk's behaviour
        policy), and score every token of it with them."""
        n = min(self.chunk_tokens, self.plan.new_tokens - self.done)
        g, length = self.seqs.shape
        torch.manual_seed(self.plan.seed + self.done // self.chunk_tokens)
        with torch.no_grad():
            seqs = model.generate(
                self.seqs,
                attention_mask=torch.ones(g, length, dtype=torch.long),
                do_sample=True,
                temperature=temperature,
                max_new_tokens=n,
                min_new_tokens=n,
                eos_token_id=None,
                pad_token_id=0,
            )
            scored = reference_logprobs(model, seqs, torch.full((g,), length + n))
        # the prompt's own logprobs come with the first chunk (position 0 has none)
        first = 0 if self.done == 0 else length
        self.logprobs = torch.cat([self.logprobs[:, :first], scored[:, first:]], dim=1)
        self.seqs = seqs
        self.done += n

    def kept(self) -> list[int]:
        """Per row: its tokens so far that it keeps (up to its cut)."""
        return [min(self.seqs.shape[1], n) for n in self.plan.lengths]

    def generated_kept(self) -> int:
        """Generated tokens (not the prompt's) the rows keep so far: what an interruption
        throws away, or stores and resumes."""
        prompt = len(self.plan.prompt)
        return sum(n - prompt for n in self.kept())

    def rows_from(self, start: list[int]) -> dict[str, list[torch.Tensor]]:
        """Each row's kept tokens from ``start[i]`` on, as ``append_tokens`` / put fields."""
        prompt = len(self.plan.prompt)
        spans = list(zip(start, self.kept()))
        return {
            "input_ids": [self.seqs[i, a:b].clone() for i, (a, b) in enumerate(spans)],
            "generation_logprobs": [
                self.logprobs[i, a:b].clone() for i, (a, b) in enumerate(spans)
            ],
            "token_mask": [torch.arange(a, b) >= prompt for a, b in spans],
        }

    def unsaved(self) -> dict[str, list[torch.Tensor]]:
        """Each row's kept tokens not in the store yet."""
        return self.rows_from(self.saved)

    def mark_saved(self) -> None:
        self.saved = self.kept()

    def resume_from(self, stored: list[torch.Tensor]) -> None:
        """Go on from the rows the store holds (every kept token saved): a row cut before
        the group's progress is padded with its last token (never kept)."""
        length = self.seqs.shape[1]
        rows = [torch.cat([r, r[-1:].repeat(length - len(r))]) for r in stored]
        self.seqs = torch.stack(rows)
        self.logprobs = torch.zeros(self.seqs.shape, dtype=torch.float32)  # all saved already
        self.saved = [len(r) for r in stored]

    def completions(self) -> list[torch.Tensor]:
        """Each row's generated tokens, cut (what the reward scores)."""
        prompt = len(self.plan.prompt)
        return [self.seqs[i, prompt:n] for i, n in enumerate(self.plan.lengths)]

    def whole(self) -> dict[str, list[torch.Tensor]]:
        """Every row's kept tokens, as one put writes them when nothing was stored."""
        return self.rows_from([0] * len(self.saved))
