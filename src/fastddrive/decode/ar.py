"""Autoregressive decoding with the KV cache: the speed baseline (DESIGN section 6).

On a Fast-dDrive model the scaffold is forced: scaffold tokens are fed, values are the argmax (or a
sample). The separately trained AR baseline writes the JSON freely until <|im_end|>.
"""

from __future__ import annotations

import torch

from fastddrive.decode.result import Decoded
from fastddrive.decode.state import Canvas, TokenPicker, greedy, sampler
from fastddrive.model import BlockDiffusionModel, PromptInputs
from fastddrive.scaffold import Scaffold


@torch.no_grad()
def ar_scaffold_decode(
    model: BlockDiffusionModel, prompt: PromptInputs, scaffold: Scaffold, pick: TokenPicker = greedy
) -> list[int]:
    """AR over the scaffold: one forward per position; scaffold positions take the template token."""
    canvas = Canvas.prefill(model, prompt, scaffold)
    while canvas.committed < len(canvas):
        canvas.commit_seed(pick)
        if canvas.committed < len(canvas):
            canvas.next_logits = model.verify(canvas.cache, [canvas.ids[canvas.committed - 1]])[-1]
            canvas.cached = canvas.committed
    return canvas.ids


@torch.no_grad()
def ar_free_decode(
    model: BlockDiffusionModel, prompt: PromptInputs, stop_id: int, max_new_tokens: int, pick: TokenPicker = greedy
) -> list[int]:
    """AR without a scaffold, up to `stop_id` (not included) or `max_new_tokens`."""
    logits, cache = model.prefill(prompt)
    ids: list[int] = []
    while len(ids) < max_new_tokens:
        token = pick(logits)
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
    pick = sampler(temperature, seed)
    if model.info.kind == "autoregressive":
        end = model.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = ar_free_decode(model, prompt, end, max_new_tokens=len(scaffold) + 16, pick=pick)
    else:
        ids = ar_scaffold_decode(model, prompt, scaffold, pick)
    return Decoded(ids, [1] * len(ids))
