"""Autoregressive decoding with the KV cache: the speed baselines (DESIGN section 6).

On a Fast-dDrive model the scaffold is forced: scaffold tokens are fed, values are the argmax (or a
sample). `ar` spends one forward per position, as a plain AR decoder does. `ar-jump` is the strongest
exact AR baseline: like a grammar-constrained server's jump-forward decoding it feeds each run of
scaffold tokens, with the value before it, in one forward, so it takes one forward per value (plus the
prefill) and returns the same ids. The separately trained AR baseline writes the JSON freely until
<|im_end|>.
"""

from __future__ import annotations

import torch

from fastddrive.core.scaffold import Scaffold
from fastddrive.decode.result import Decoded
from fastddrive.decode.state import Canvas, TokenPicker, greedy, sampler
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs


@torch.no_grad()
def ar_scaffold_decode(
    model: BlockDiffusionModel, prompt: PromptInputs, scaffold: Scaffold, pick: TokenPicker = greedy, jump: bool = False
) -> Canvas:
    """AR over the scaffold: scaffold positions take the template token, values `pick` the AR head's.

    Without `jump` every position costs a forward; with it, a forward is spent only where the next
    position is a value (the forward feeds every committed token since the last one)."""
    canvas = Canvas.prefill(model, prompt, scaffold)
    while canvas.committed < len(canvas):
        canvas.commit_seed(pick)
        steps = 1
        while jump and canvas.committed < len(canvas) and canvas.is_scaffold(canvas.committed):
            canvas.committed += 1  # the template is already in place
            steps += 1
        canvas.accepted_per_step.append(steps)
        if canvas.committed < len(canvas):
            canvas.next_logits = model.verify(canvas.cache, canvas.head())[-1]
            canvas.cached = canvas.committed
    return canvas


@torch.no_grad()
def ar_free_decode(
    model: BlockDiffusionModel, prompt: PromptInputs, stop_id: int, max_new_tokens: int, pick: TokenPicker = greedy
) -> list[int]:
    """AR without a scaffold, up to `stop_id` (not included) or `max_new_tokens`."""
    logits, cache = model.prefill(prompt, room=max_new_tokens)
    ids: list[int] = []
    while len(ids) < max_new_tokens:
        token = int(pick(logits[None], torch.tensor([len(ids)]))[0])
        if token == stop_id:
            break
        ids.append(token)
        logits = model.verify(cache, [token])[-1]
    return ids


def ar_decode(
    model: BlockDiffusionModel,
    prompt: PromptInputs,
    scaffold: Scaffold,
    *,
    temperature: float = 0.0,
    seed: int = 0,
) -> Decoded:
    """`ar`: greedy (temperature 0) or sampled causal decoding, one token per forward."""
    if model.info.kind == "autoregressive":
        end = model.tokenizer.convert_tokens_to_ids("<|im_end|>")
        limit = len(scaffold) + 16
        ids = ar_free_decode(model, prompt, end, max_new_tokens=limit, pick=sampler(temperature, seed, limit))
        return Decoded(ids, [1] * len(ids))
    canvas = ar_scaffold_decode(model, prompt, scaffold, sampler(temperature, seed, len(scaffold)))
    return Decoded(canvas.ids, canvas.accepted_per_step)


def ar_jump_decode(
    model: BlockDiffusionModel,
    prompt: PromptInputs,
    scaffold: Scaffold,
    *,
    temperature: float = 0.0,
    seed: int = 0,
) -> Decoded:
    """`ar-jump`: exact AR that feeds each scaffold run in one forward; the ids (and samples) of `ar`."""
    canvas = ar_scaffold_decode(model, prompt, scaffold, sampler(temperature, seed, len(scaffold)), jump=True)
    return Decoded(canvas.ids, canvas.accepted_per_step)
