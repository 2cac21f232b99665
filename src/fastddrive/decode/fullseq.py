"""Full-sequence masked diffusion (the dVLM-AD-style baseline, paper 000 section 1): the whole value
canvas is one bidirectional denoising target and every step re-reads prompt and image, no KV reuse."""

from __future__ import annotations

import torch

from fastddrive.core.scaffold import Scaffold
from fastddrive.decode.confidence import confident_positions, within_slots
from fastddrive.decode.mdm import DEFAULT_TAU
from fastddrive.decode.result import Decoded
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs


@torch.no_grad()
def full_sequence_decode(
    model: BlockDiffusionModel, prompt: PromptInputs, scaffold: Scaffold, *, tau: float = DEFAULT_TAU
) -> Decoded:
    """`fullseq`: unmask the values whose confidence exceeds tau (at least one) until none is left."""
    ids = scaffold.template_ids.tolist()
    steps = []
    while masked := [p for p, token in enumerate(ids) if token == scaffold.mask_id]:
        logits = model.full_sequence_logits(prompt, ids)
        chosen = confident_positions(within_slots(logits[masked], masked, scaffold), tau)
        for k, token in chosen:
            ids[masked[k]] = token
        steps.append(len(chosen))
    return Decoded(ids, steps)
