"""Jacobi decoding on the AR head (paper 003 section 2.1): blocks of n tokens solved by fixed-point iteration.

Greedy AR is the fixed point of y_i = argmax p(y | y_<i, x). Starting from a guess of a block of n
tokens, one causal forward over [committed tokens not yet cached ; the block's current iterate]
computes every position's argmax given the iterate before it: the next iterate. The prefix of the
iterate that equals those argmaxes was conditioned on correct tokens, so it is AR's, and so is the
argmax right after it (at least one token per forward); they are committed and the cache keeps the
keys and values of the agreeing part only. The rest of the block continues from the new iterate. A
block is done when all its positions are committed; the next block starts from a fresh guess.

On a Fast-dDrive model the scaffold is part of the `Answer` layout: its positions hold the template
and are never iterated (the verifier forces them exactly as `ar` does). On an AR model writing JSON
freely every position is iterated, up to <|im_end|>.

Invariant (as `Canvas`): the cache holds the prompt and answer positions [0, cached), cached <=
len(ids); ids[cached:] are committed and fed at the head of the next forward; when cached == len(ids),
`next_logits` predicts the next position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from fastddrive.decode.result import Decoded
from fastddrive.kv_cache import KVCache
from fastddrive.masks import CAUSAL
from fastddrive.model import BlockDiffusionModel, PromptInputs
from fastddrive.scaffold import Scaffold

DEFAULT_JACOBI_BLOCK = 16
FREE_SLACK = 16  # an AR model writing freely may run this many tokens past the scaffold's length


@dataclass
class Answer:
    """The answer being decoded: the template (a token where the scaffold fixes it, None where the model
    chooses), the stop token of free decoding, the committed ids and the cache after the prompt."""

    template: list[int | None]
    stop_id: int | None
    cache: KVCache
    prompt_length: int
    next_logits: torch.Tensor | None
    ids: list[int] = field(default_factory=list)
    cached: int = 0
    accepted_per_step: list[int] = field(default_factory=list)

    @classmethod
    def prefill(cls, model: BlockDiffusionModel, prompt: PromptInputs, scaffold: Scaffold, room: int) -> Answer:
        """Prefill the prompt (one forward). A block-diffusion model answers in the scaffold; an AR
        model (`info.kind == "autoregressive"`) writes freely until <|im_end|>."""
        if model.info.kind == "autoregressive":
            template: list[int | None] = [None] * (len(scaffold) + FREE_SLACK)
            stop_id = model.tokenizer.convert_tokens_to_ids("<|im_end|>")
        else:
            template = [None if v else int(t) for t, v in zip(scaffold.template_ids, scaffold.is_value, strict=True)]
            stop_id = None
        logits, cache = model.prefill(prompt, room=len(template) + room)
        return cls(template, stop_id, cache, cache.length, logits)

    @property
    def committed(self) -> int:
        return len(self.ids)

    @property
    def done(self) -> bool:
        stopped = self.stop_id is not None and bool(self.ids) and self.ids[-1] == self.stop_id
        return stopped or self.committed >= len(self.template)

    def head(self) -> list[int]:
        """Committed tokens not yet in the cache."""
        return self.ids[self.cached :]

    def fixed(self, first: int, tokens: list[int]) -> list[int]:
        """`tokens` for positions first, first + 1, ... with the template put back where it is fixed."""
        return [t if self.template[first + i] is None else self.template[first + i] for i, t in enumerate(tokens)]

    def commit_seed(self) -> None:
        """Commit the argmax of `next_logits` (an AR step with no forward)."""
        self.ids += self.fixed(self.committed, [int(self.next_logits.argmax())])
        self.next_logits = None

    def answer_ids(self) -> list[int]:
        """The decoded ids, without the stop token."""
        return self.ids[:-1] if self.stop_id is not None and self.ids and self.ids[-1] == self.stop_id else self.ids


@dataclass
class Verified:
    """The AR head's tokens for a draft at positions first, first + 1, ... and how far the draft agrees."""

    targets: list[int]  # target i is the argmax at position first + i given the draft before it
    agreed: int  # draft[:agreed] == targets[:agreed]
    after: torch.Tensor | None  # when the whole draft agrees: the logits of the position after it


def agreement(tokens: list[int], guesses: list[int]) -> int:
    """How many leading `guesses` equal the verifier's `tokens` at the same positions."""
    return next((i for i, (t, g) in enumerate(zip(tokens, guesses, strict=False)) if t != g), len(guesses))


def verify_rows(answer: Answer, first: int, draft: list[int], rows: torch.Tensor) -> Verified:
    """Greedy verification of `draft` from causal logits `rows` (len(draft) + 1, V): row i predicts
    position first + i, the last row the position after the draft. One transfer to the host."""
    targets = answer.fixed(first, rows[:-1].argmax(-1).tolist())
    agreed = agreement(targets, draft)
    return Verified(targets, agreed, rows[-1] if agreed == len(draft) else None)


def commit(answer: Answer, first: int, verified: Verified, cached_to: int) -> int:
    """Commit the agreeing targets and the first disagreeing one (or, if all agree, leave the next one to
    `next_logits`), stopping at the stop token; the cache keeps positions [0, cached_to). Returns how
    many tokens were committed."""
    take = verified.targets[: verified.agreed + 1]
    if answer.stop_id in take:
        take = take[: take.index(answer.stop_id) + 1]
    answer.ids[first:] = take
    answer.cache.crop(answer.prompt_length + cached_to)
    answer.cached = cached_to
    answer.next_logits = verified.after if verified.agreed == len(verified.targets) else None
    return len(take)


def initial_guess(prompt: PromptInputs, n: int, rng: np.random.Generator, image_token_id: int | None) -> list[int]:
    """A random start for a block: n tokens drawn from the prompt's text (paper 003 starts from random
    tokens; the prompt's own tokens are the reference implementation's choice)."""
    ids = prompt.input_ids[0].tolist()
    text = [t for t in ids if t != image_token_id] or ids
    return [int(t) for t in rng.choice(text, n)]


class Guesser:
    """Initial iterates for blocks: from `drafts` (answer ids: an oracle or a recorded guess) where given,
    else `initial_guess`, seeded."""

    def __init__(self, model: BlockDiffusionModel, prompt: PromptInputs, seed: int, drafts: list[int] | None) -> None:
        self.prompt = prompt
        self.image_token_id = model.image_token_id
        self.rng = np.random.default_rng(seed)
        self.drafts = drafts

    def __call__(self, first: int, n: int) -> list[int]:
        if self.drafts is not None:
            return [self.drafts[p] if p < len(self.drafts) else 0 for p in range(first, first + n)]
        return initial_guess(self.prompt, n, self.rng, self.image_token_id)


Recorder = Callable[[int, list[int]], None]  # (block start, the block's iterate before a forward)


def jacobi_block(
    model: BlockDiffusionModel, answer: Answer, start: int, end: int, guess: list[int], record: Recorder | None = None
) -> None:
    """Iterate the block [start, end) from `guess` (its tokens, committed ones included) to its fixed point."""
    iterate = answer.fixed(start, guess)
    while answer.committed < end and not answer.done:
        if answer.cached == answer.committed:
            answer.commit_seed()
            answer.accepted_per_step.append(1)
            continue
        first = answer.committed
        iterate[: first - start] = answer.ids[start:first]
        if record is not None:
            record(start, list(iterate))
        head = answer.head()
        draft = iterate[first - start :]
        logits = model.forward(answer.cache, head + draft, CAUSAL)[0]
        verified = verify_rows(answer, first, draft, logits[len(head) - 1 :])
        answer.accepted_per_step.append(commit(answer, first, verified, first + verified.agreed))
        iterate[first - start :] = verified.targets  # the Jacobi update of every position at once
    if record is not None:
        record(start, answer.ids[start:end])  # the fixed point (shorter than the block after the stop token)


def jacobi_blocks(
    model: BlockDiffusionModel,
    answer: Answer,
    block_size: int,
    guesser: Callable[[int, int], list[int]],
    record: Recorder | None = None,
) -> None:
    """Vanilla Jacobi decoding: consecutive blocks of `block_size`, each iterated to its fixed point."""
    while not answer.done:
        start = answer.committed - answer.committed % block_size
        end = min(start + block_size, len(answer.template))
        jacobi_block(model, answer, start, end, guesser(start, end - start), record)


def check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


@torch.no_grad()
def jacobi_decode(
    model: BlockDiffusionModel,
    prompt: PromptInputs,
    scaffold: Scaffold,
    *,
    block_size: int = DEFAULT_JACOBI_BLOCK,
    seed: int = 0,
    drafts: list[int] | None = None,
) -> Decoded:
    """`jacobi` (paper 003 section 2.1): blocks of `block_size` tokens iterated to their fixed point on the
    AR head; the ids of greedy `ar`. `seed` draws the initial guesses; `drafts` (answer ids) replace them
    (with `ar`'s own ids every block takes one forward)."""
    check_block_size(block_size)
    answer = Answer.prefill(model, prompt, scaffold, room=2 * block_size)
    jacobi_blocks(model, answer, block_size, Guesser(model, prompt, seed, drafts))
    return Decoded(answer.answer_ids(), answer.accepted_per_step)
