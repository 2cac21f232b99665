"""Jacobi decoding on the AR head (paper 003 section 2.1): blocks of n tokens solved by fixed-point iteration.

Greedy AR is the fixed point of y_i = argmax p(y | y_<i, x). Starting from a guess of a block of n
tokens, one causal forward over [committed tokens not yet cached ; the block's current iterate]
computes every position's argmax given the iterate before it: the next iterate. The prefix of the
iterate that equals those argmaxes was conditioned on correct tokens, so it is AR's, and so is the
argmax right after it (at least one token per forward); they are committed and the cache keeps the
keys and values of the agreeing part only. The rest of the block continues from the new iterate. A
block is done when all its positions are committed; the next block starts from a fresh guess.

On a Fast-dDrive model the scaffold is part of the `Canvas`: its positions hold the template and are never
iterated (the verifier forces them exactly as `ar` does). On an AR model writing JSON freely the canvas is
free: every position is iterated, up to <|im_end|>. What is committed follows `acceptance.accept`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fastddrive.core.scaffold import Scaffold
from fastddrive.decode.acceptance import Accepted, accept
from fastddrive.decode.result import Decoded
from fastddrive.decode.state import Canvas, greedy
from fastddrive.engine.masks import CAUSAL
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs

DEFAULT_JACOBI_BLOCK = 16


def jacobi_canvas(model: BlockDiffusionModel, prompt: PromptInputs, scaffold: Scaffold, room: int) -> Canvas:
    """Prefill the prompt (one forward): the scaffolded canvas of a block-diffusion model, or the free one of
    an AR model (`info.kind == "autoregressive"`), which writes until <|im_end|> (paper 003 section 2.1)."""
    return Canvas.prefill(model, prompt, scaffold, room=room, free=model.info.kind == "autoregressive")


@dataclass
class Verified:
    """The AR head's tokens for a draft at positions first, first + 1, ... (target i is the argmax at first +
    i given the draft before it), what of the draft `acceptance.accept` keeps, and, when it keeps all, the
    logits of the position after the draft."""

    targets: list[int]
    accepted: Accepted
    after: torch.Tensor | None


def verify_rows(canvas: Canvas, first: int, draft: list[int], rows: torch.Tensor) -> Verified:
    """Greedy verification of `draft` from causal logits `rows` (len(draft) + 1, V): row i predicts
    position first + i, the last row the position after the draft. One transfer to the host."""
    targets = canvas.forced(first, rows[:-1].argmax(-1).tolist())
    accepted = accept(draft, targets)
    return Verified(targets, accepted, rows[-1] if accepted.whole else None)


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
    model: BlockDiffusionModel, canvas: Canvas, start: int, end: int, guess: list[int], record: Recorder | None = None
) -> None:
    """Iterate the block [start, end) from `guess` (its tokens, committed ones included) to its fixed point."""
    iterate = canvas.forced(start, guess)
    while canvas.committed < end and not canvas.done:
        if canvas.cached == canvas.committed:
            canvas.commit_seed(greedy)
            canvas.accepted_per_step.append(1)
            continue
        first = canvas.committed
        iterate[: first - start] = canvas.ids[start:first]
        if record is not None:
            record(start, list(iterate))
        head = canvas.head()
        draft = iterate[first - start :]
        logits = model.forward(canvas.cache, head + draft, CAUSAL)[0]
        verified = verify_rows(canvas, first, draft, logits[len(head) - 1 :])
        canvas.accepted_per_step.append(canvas.commit(verified.accepted, verified.after))
        iterate[first - start :] = verified.targets  # the Jacobi update of every position at once
    if record is not None:
        record(start, canvas.ids[start : min(end, canvas.committed)])  # the fixed point (shorter after the stop)


def jacobi_blocks(
    model: BlockDiffusionModel,
    canvas: Canvas,
    block_size: int,
    guesser: Callable[[int, int], list[int]],
    record: Recorder | None = None,
) -> None:
    """Vanilla Jacobi decoding: consecutive blocks of `block_size`, each iterated to its fixed point."""
    while not canvas.done:
        start = canvas.committed - canvas.committed % block_size
        end = min(start + block_size, len(canvas))
        jacobi_block(model, canvas, start, end, guesser(start, end - start), record)


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
    canvas = jacobi_canvas(model, prompt, scaffold, room=2 * block_size)
    jacobi_blocks(model, canvas, block_size, Guesser(model, prompt, seed, drafts))
    return Decoded(canvas.answer_ids(), canvas.accepted_per_step)
