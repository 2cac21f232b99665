"""Greedy autoregressive decoding with the KV cache: the speed baseline (DESIGN section 6).

On a Fast-dDrive model the scaffold is forced: scaffold tokens are fed, values are the argmax.
The separately trained AR baseline writes the JSON freely until <|im_end|>.
"""

from __future__ import annotations

import torch

from fastddrive.model import BlockDiffusionModel, PromptInputs
from fastddrive.scaffold import Scaffold


@torch.no_grad()
def ar_scaffold_decode(model: BlockDiffusionModel, prompt: PromptInputs, scaffold: Scaffold) -> list[int]:
    """Greedy AR over the scaffold: one verify per position; scaffold positions take the template token."""
    logits, cache = model.prefill(prompt)
    ids = []
    for position, template in enumerate(scaffold.template_ids.tolist()):
        token = int(logits.argmax()) if scaffold.is_value[position] else template
        ids.append(token)
        if position + 1 < len(scaffold):
            logits = model.verify(cache, [token])[-1]
    return ids


@torch.no_grad()
def ar_free_decode(model: BlockDiffusionModel, prompt: PromptInputs, stop_id: int, max_new_tokens: int) -> list[int]:
    """Greedy AR without a scaffold, up to `stop_id` (not included) or `max_new_tokens`."""
    logits, cache = model.prefill(prompt)
    ids: list[int] = []
    while len(ids) < max_new_tokens:
        token = int(logits.argmax())
        if token == stop_id:
            break
        ids.append(token)
        logits = model.verify(cache, [token])[-1]
    return ids
