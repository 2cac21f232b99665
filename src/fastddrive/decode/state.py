"""What every scaffold decoder shares: the canvas of response ids, its cache, and how a token is chosen.

DESIGN section 6. On a block-diffusion model the scaffold is forced: whatever a decoder drafts, a
scaffold position ends up holding the template token, exactly as greedy `ar` feeds it. Decoders that
know the scaffold (`ss`, `sd`, `fullseq`, `tts`) also show it to the MDM head and never spend a forward
on it; the scaffold-unaware ones (`selfspec`, `selfspec-quad`, `mdm`) mask every position they draft.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fastddrive.model import BlockDiffusionModel, KVCache, PromptInputs
from fastddrive.scaffold import Scaffold

TokenPicker = Callable[[torch.Tensor], int]


def greedy(logits: torch.Tensor) -> int:
    """The argmax token of one logits row."""
    return int(logits.argmax())


def sampler(temperature: float, seed: int) -> TokenPicker:
    """Softmax sampling at `temperature` from a generator seeded with `seed` (greedy at 0)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return greedy
    generator = torch.Generator().manual_seed(seed)

    def pick(logits: torch.Tensor) -> int:
        probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    return pick


@dataclass
class Canvas:
    """The response being decoded.

    `ids` holds the template everywhere (values as |<MASK>|) and the committed tokens in [0, committed).
    The cache holds the prompt and response positions [0, cached), cached <= committed. When they are
    equal, `next_logits` is the causal row that predicts position `committed`.
    """

    scaffold: Scaffold
    cache: KVCache
    prompt_length: int
    ids: list[int]
    committed: int = 0
    cached: int = 0
    next_logits: torch.Tensor | None = None
    accepted_per_step: list[int] = field(default_factory=list)

    @classmethod
    def prefill(cls, model: BlockDiffusionModel, prompt: PromptInputs, scaffold: Scaffold) -> Canvas:
        """Prefill the prompt (one forward) and start an empty canvas after it."""
        logits, cache = model.prefill(prompt)
        return cls(scaffold, cache, cache.length, scaffold.template_ids.tolist(), next_logits=logits)

    def __len__(self) -> int:
        return len(self.ids)

    def is_scaffold(self, position: int) -> bool:
        return not self.scaffold.is_value[position]

    def target(self, position: int, logits: torch.Tensor, pick: TokenPicker) -> int:
        """The AR head's token at `position`: the template on the scaffold, else `pick(logits)`."""
        return int(self.scaffold.template_ids[position]) if self.is_scaffold(position) else pick(logits)

    def blank(self, first: int, last: int, scaffold_aware: bool) -> list[int]:
        """Positions [first, last) before drafting: |<MASK>| everywhere, or only on values if scaffold-aware."""
        mask_id = self.scaffold.mask_id
        return [self.ids[p] if scaffold_aware and self.is_scaffold(p) else mask_id for p in range(first, last)]

    def draft(self, model: BlockDiffusionModel, block_start: int, proposal: list[int]) -> torch.Tensor:
        """MDM logits of the uncached committed tokens followed by `proposal` (cache unchanged). Those
        before `block_start` stay causal, as clean context is in training; row len(head) - 1 + i
        predicts proposal[i]."""
        head = self.ids[self.cached : self.committed]
        causal_head = min(max(0, block_start - self.cached), len(head))
        return model.draft(self.cache, head + proposal, causal_head=causal_head)

    def commit_seed(self, pick: TokenPicker) -> None:
        """Commit the token at `committed` from `next_logits` (one AR step, no forward)."""
        self.ids[self.committed] = self.target(self.committed, self.next_logits, pick)
        self.committed += 1
        self.next_logits = None

    def crop_to(self, position: int) -> None:
        """Keep the cache up to response position `position` (exclusive)."""
        self.cache.crop(self.prompt_length + position)
        self.cached = position

    def fork(self, k: int) -> list[Canvas]:
        """k independent canvases sharing this one's committed prefix (the cache is copied)."""
        return [
            Canvas(
                self.scaffold,
                cache,
                self.prompt_length,
                list(self.ids),
                self.committed,
                self.cached,
                self.next_logits,
                [],
            )
            for cache in self.cache.fork(k)
        ]
