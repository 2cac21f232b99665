"""What every decoder that keeps a cache shares: the canvas of answer ids, its cache, and how a token is chosen.

DESIGN section 6. On a block-diffusion model the scaffold is forced: whatever a decoder drafts, a
scaffold position ends up holding the template token, exactly as greedy `ar` feeds it. Decoders that
know the scaffold (`ss`, `sd`, `fullseq`, `tts`, `ar-jump`) also show it to the model and never spend a
forward on it alone; the scaffold-unaware ones (`selfspec`, `selfspec-quad`, `mdm`) mask every position
they draft.

The same `Canvas` carries a free answer: on an AR model writing the JSON freely (`jacobi`, `jacobi-mr`,
paper 003) no position is scaffold and the answer ends at <|im_end|>, within FREE_SLACK positions past the
scaffold's length.

Tokens are chosen on the device for a whole block of logits at once and reach the host in one transfer
per forward (`Canvas.targets`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fastddrive.core.scaffold import Scaffold
from fastddrive.decode.acceptance import Accepted
from fastddrive.engine.kv_cache import KVCache
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs

FREE_SLACK = 16  # an AR model writing freely may run this many tokens past the scaffold's length
TokenPicker = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # logits (m, V), positions (m,) -> tokens (m,)
# logits (rows, m, V) of rows at the same positions first, first + 1, ... -> tokens (rows, m)
RowPicker = Callable[[torch.Tensor, int], torch.Tensor]


def greedy(logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The argmax token of every logits row."""
    return logits.argmax(-1)


def inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float) -> torch.Tensor:
    """Tokens (m,) sampled from softmax(logits / temperature) (m, V) by inverse CDF with one uniform per row."""
    cdf = torch.softmax(logits.double() / temperature, dim=-1).cumsum(-1)
    u = uniforms * cdf[:, -1]  # the total is 1 up to rounding
    tokens = torch.searchsorted(cdf, u[:, None]).squeeze(-1)
    return tokens.clamp(max=logits.shape[-1] - 1)


class Sampler:
    """Softmax sampling at `temperature`, on the device, by inverse CDF with one uniform per position.

    The uniforms are drawn once from `seed` for positions 0..length-1, so the token at a position does not
    depend on which forward computed its logits or how many were tried before: a speculative decoder
    that accepts a draft only where it equals this sample commits exactly the AR sample (paper 000
    section 3.4), and batched rollouts equal sequential ones with the same seeds.
    """

    def __init__(self, temperature: float, seed: int, length: int) -> None:
        if temperature <= 0:
            raise ValueError(f"a sampler needs temperature > 0, got {temperature}")
        self.temperature = temperature
        self.uniforms = torch.rand(length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def __call__(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.uniforms.device != logits.device:
            self.uniforms = self.uniforms.to(logits.device)
        return inverse_cdf(logits, self.uniforms[positions.to(logits.device)], self.temperature)


def sampler(temperature: float, seed: int, length: int) -> TokenPicker:
    """Greedy at temperature 0, else a `Sampler` over `length` positions."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return greedy if temperature == 0 else Sampler(temperature, seed, length)


class RowSampler:
    """`Sampler`s of one temperature for rows that stand at the same positions (the rollouts of test-time
    scaling): row r gets the tokens samplers[r] would pick, and all rows take one set of device ops."""

    def __init__(self, samplers: Sequence[Sampler]) -> None:
        self.temperature = samplers[0].temperature
        self.uniforms = torch.stack([s.uniforms for s in samplers])

    def __call__(self, logits: torch.Tensor, first: int) -> torch.Tensor:
        if self.uniforms.device != logits.device:
            self.uniforms = self.uniforms.to(logits.device)
        rows, m, _ = logits.shape
        uniforms = self.uniforms[:, first : first + m].reshape(-1)
        return inverse_cdf(logits.reshape(rows * m, -1), uniforms, self.temperature).view(rows, m)


def row_picker(temperature: float, seeds: Sequence[int], length: int) -> RowPicker:
    """The rows' `sampler`s as one picker for rows at the same positions: the argmax at temperature 0."""
    picks = [sampler(temperature, seed, length) for seed in seeds]
    return (lambda logits, first: logits.argmax(-1)) if picks[0] is greedy else RowSampler(picks)


@dataclass
class Canvas:
    """The answer being decoded, by every decoder that keeps a cache (DESIGN section 6).

    Invariant: `ids` holds the template everywhere (values as |<MASK>|) and the committed tokens in
    [0, committed). The cache holds the prompt and the answer positions [0, cached), cached <=
    committed; the committed tokens ids[cached:committed] are fed at the head of the next forward.
    When cached == committed, `next_logits` is the causal row that predicts position `committed`.
    A `free` canvas (an AR model writing freely) has no scaffold position and stops after `stop_id`.
    """

    scaffold: Scaffold
    cache: KVCache
    prompt_length: int
    ids: list[int]
    committed: int = 0
    cached: int = 0
    next_logits: torch.Tensor | None = None
    accepted_per_step: list[int] = field(default_factory=list)
    row: int = 0  # this canvas's row of the cache
    free: bool = False
    stop_id: int | None = None

    @classmethod
    def prefill(
        cls,
        model: BlockDiffusionModel,
        prompt: PromptInputs,
        scaffold: Scaffold,
        room: int | None = None,
        free: bool = False,
    ) -> Canvas:
        """Prefill the prompt (one forward) and start an empty canvas after it, with `room` positions past
        the answer for the widest forward (default: two of the scaffold's longest blocks). `free`: the
        answer of an AR model writing freely, FREE_SLACK positions longer, ending at <|im_end|>."""
        room = 2 * max(len(b) for b in scaffold.blocks()) if room is None else room
        length = len(scaffold) + (FREE_SLACK if free else 0)
        logits, cache = model.prefill(prompt, room=length + room)
        if free:
            stop_id = model.tokenizer.convert_tokens_to_ids("<|im_end|>")
            return cls(
                scaffold,
                cache,
                cache.length,
                [scaffold.mask_id] * length,
                next_logits=logits,
                free=True,
                stop_id=stop_id,
            )
        return cls(scaffold, cache, cache.length, scaffold.template_ids.tolist(), next_logits=logits)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def done(self) -> bool:
        """Every position committed, or the stop token of a free answer."""
        return self.stopped or self.committed >= len(self.ids)

    def answer_ids(self) -> list[int]:
        """The committed ids, without the stop token of a free answer."""
        return self.ids[: self.committed - 1] if self.stopped else self.ids[: self.committed]

    @property
    def stopped(self) -> bool:
        """Whether the last committed token is the stop token of a free answer."""
        return self.stop_id is not None and self.committed > 0 and self.ids[self.committed - 1] == self.stop_id

    def is_scaffold(self, position: int) -> bool:
        return not self.free and not self.scaffold.is_value[position]

    def targets(self, first: int, logits: torch.Tensor, pick: TokenPicker) -> list[int]:
        """The AR head's tokens at positions first, first + 1, ... from causal logits rows (m, V): the
        template on the scaffold, else `pick`. One transfer to the host."""
        return self.forced(first, pick(logits, torch.arange(first, first + len(logits))).tolist())

    def forced(self, first: int, picked: list[int]) -> list[int]:
        """Tokens picked for positions first, first + 1, ... with the template put back on the scaffold."""
        if self.free:
            return list(picked)
        template = self.scaffold.template_ids
        return [int(template[first + i]) if self.is_scaffold(first + i) else t for i, t in enumerate(picked)]

    def blank(self, first: int, last: int, scaffold_aware: bool) -> list[int]:
        """Positions [first, last) before drafting: |<MASK>| everywhere, or only on values if scaffold-aware."""
        mask_id = self.scaffold.mask_id
        return [self.ids[p] if scaffold_aware and self.is_scaffold(p) else mask_id for p in range(first, last)]

    def head(self) -> list[int]:
        """The committed tokens not yet in the cache (fed before whatever comes next)."""
        return self.ids[self.cached : self.committed]

    def draft(self, model: BlockDiffusionModel, block_start: int, proposal: list[int]) -> torch.Tensor:
        """MDM logits of the uncached committed tokens followed by `proposal` (cache unchanged). Those
        before `block_start` stay causal, as clean context is in training; row len(head) - 1 + i
        predicts proposal[i]."""
        head = self.head()
        causal_head = min(max(0, block_start - self.cached), len(head))
        return model.draft(self.cache, head + proposal, causal_head=causal_head)

    def commit_seed(self, pick: TokenPicker) -> None:
        """Commit the token at `committed` from `next_logits` (one AR step, no forward)."""
        self.ids[self.committed] = self.targets(self.committed, self.next_logits[None], pick)[0]
        self.committed += 1
        self.next_logits = None

    def commit(self, accepted: Accepted, after: torch.Tensor | None = None, cached_to: int | None = None) -> int:
        """Commit what the verifier accepted at `committed` (`acceptance.accept`: the invariant is there), up
        to the stop token of a free answer. The cache keeps the agreeing tokens (or positions [0, cached_to)
        where the verified ones were not kept); when every token agreed, `after`, the verify row past them,
        predicts the next position. Returns how many tokens were committed."""
        first, tokens = self.committed, accepted.tokens
        if self.stop_id in tokens:
            tokens = tokens[: tokens.index(self.stop_id) + 1]
        self.ids[first : first + len(tokens)] = tokens
        self.committed = first + len(tokens)
        self.crop_to(first + accepted.agreed if cached_to is None else cached_to)
        self.next_logits = after if accepted.whole else None
        return len(tokens)

    def crop_to(self, position: int) -> None:
        """Keep the cache up to response position `position` (exclusive)."""
        self.cache.crop(self.prompt_length + position, row=self.row)
        self.cached = position
