"""Block-causal masked diffusion with a confidence threshold (paper 002 section 3.4), and Section
Diffusion, the same loop over the frozen scaffold and section-aligned blocks (paper 000 section 3.3).

Each block is seeded by one AR step from the cached causal context, its masked positions are unmasked
in parallel by the MDM head (those whose confidence exceeds tau, at least one per step), and the
finished block is written to the cache with one causal forward. Not lossless: the MDM head decides.
"""

from __future__ import annotations

import torch

from fastddrive.core.scaffold import DEFAULT_BLOCK_SIZE, Scaffold
from fastddrive.decode.blocks import BlockOf, grid_blocks, section_blocks
from fastddrive.decode.confidence import confident_positions, masked_rows
from fastddrive.decode.result import Decoded
from fastddrive.decode.state import Canvas, greedy
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs

DEFAULT_TAU = 0.9


@torch.no_grad()
def diffusion_steps(
    model: BlockDiffusionModel, canvas: Canvas, block_of: BlockOf, scaffold_aware: bool, tau: float
) -> None:
    """Decode the whole response on `canvas`, block after block."""
    mask_id, ids = canvas.scaffold.mask_id, canvas.ids
    end = 0
    while end < len(canvas):
        start, end = block_of(end)
        if canvas.cached == canvas.committed:
            canvas.commit_seed(greedy)
        n, c = canvas.committed, canvas.cached
        proposal = canvas.blank(n, end, scaffold_aware)
        drafted = mask_id in proposal
        while mask_id in proposal:
            logits = canvas.draft(model, start, proposal)
            masked, rows = masked_rows(proposal, logits, n - c - 1, n, canvas.scaffold)
            chosen = confident_positions(rows, tau)
            for k, token in chosen:
                i = masked[k]
                proposal[i] = ids[n + i] if canvas.is_scaffold(n + i) else token
            canvas.accepted_per_step.append(len(chosen))
        ids[n:end] = proposal
        canvas.committed = end
        if drafted and end < len(canvas):  # scaffold-only blocks ride along with the next block's forward
            canvas.next_logits = model.verify(canvas.cache, ids[c:end])[-1]
            canvas.cached = end


def mdm_decode(
    model: BlockDiffusionModel,
    prompt: PromptInputs,
    scaffold: Scaffold,
    *,
    tau: float = DEFAULT_TAU,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Decoded:
    """`mdm`: fixed-size blocks, every drafted position masked (no scaffold knowledge in the draft; scaffold
    positions still end up with the template, as in `ar`)."""
    canvas = Canvas.prefill(model, prompt, scaffold)
    diffusion_steps(model, canvas, grid_blocks(len(scaffold), block_size), scaffold_aware=False, tau=tau)
    return Decoded(canvas.ids, canvas.accepted_per_step)


def section_diffusion_decode(
    model: BlockDiffusionModel,
    prompt: PromptInputs,
    scaffold: Scaffold,
    *,
    tau: float = DEFAULT_TAU,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Decoded:
    """`sd` (paper 000 section 3.3): `mdm` over the scaffold's section-aligned blocks, only values masked."""
    canvas = Canvas.prefill(model, prompt, scaffold)
    diffusion_steps(model, canvas, section_blocks(scaffold, block_size), scaffold_aware=True, tau=tau)
    return Decoded(canvas.ids, canvas.accepted_per_step)
