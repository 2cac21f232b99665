"""Quadratic self-speculative decoding (paper 002 Algorithm 2): one forward both verifies the current
draft and proposes the next one, for every possible acceptance length at once.

The draft d_0..d_{B-1} (d_0 committed) becomes B groups [d_i, |<MASK>| x (B - 1)], group i at positions
i..i+B-1 after d_0. The first tokens see the cache and the first tokens before them (causal: the AR
verification of d_1..); a group's masks see its own group and the first tokens up to d_i (a block
seeded at d_i, as in training). If d_0..d_{k-1} are accepted, group k-1 holds the next draft: the AR
token after d_{k-1} (the bonus) and its masks' proposals. Only the first tokens of accepted groups stay
in the cache. What is accepted follows `acceptance.accept`, so the ids equal greedy `ar`'s; the scaffold is
forced by the verifier as in `ar`.
"""

from __future__ import annotations

import torch

from fastddrive.core.scaffold import Scaffold
from fastddrive.decode.acceptance import accept
from fastddrive.decode.confidence import within_slots
from fastddrive.decode.result import Decoded
from fastddrive.decode.state import Canvas, greedy
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs

DEFAULT_QUAD_BLOCK_SIZE = 8


def quadratic_layout(block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position offsets (B*B,) and allowed attention (B*B, B*B) of the B groups of B tokens."""
    b = block_size
    group = torch.arange(b).repeat_interleave(b)
    within = torch.arange(b).repeat(b)
    offsets = group + within
    first = within == 0
    same_group = group[:, None] == group[None, :]
    earlier_first = first[None, :] & (group[None, :] <= group[:, None])
    allowed = earlier_first | (same_group & ~first[:, None])
    return offsets, allowed


@torch.no_grad()
def quadratic_speculative_decode(
    model: BlockDiffusionModel, prompt: PromptInputs, scaffold: Scaffold, *, block_size: int = DEFAULT_QUAD_BLOCK_SIZE
) -> Decoded:
    """`selfspec-quad`: one forward per step at the cost of block_size^2 input tokens."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    b, length, mask_id = block_size, len(scaffold), scaffold.mask_id
    canvas = Canvas.prefill(model, prompt, scaffold)
    canvas.commit_seed(greedy)
    ids = canvas.ids
    offsets, allowed = quadratic_layout(b)
    draft = [ids[0]] + [mask_id] * (b - 1)  # the first forward verifies nothing and proposes
    while canvas.committed < length:
        base = canvas.committed - 1  # position of d_0: committed, not yet cached
        groups = torch.tensor([[d] + [mask_id] * (b - 1) for d in draft]).reshape(-1)
        logits = model.forward(canvas.cache, groups, allowed, offsets)[0].reshape(b, b, -1)
        verified, proposals = _read_groups(logits, base, canvas)
        verifiable = min(b, length - base - 1)  # the verified positions base + 1, ... inside the answer
        accepted = accept(draft[1 : 1 + verifiable], verified[:verifiable])
        ids[base + 1 : base + 1 + len(accepted.tokens)] = accepted.tokens
        k = accepted.agreed + 1  # d_0 .. d_{k-1} accepted; the AR token at base + k (if inside) is the bonus
        canvas.cache.keep(canvas.cache.length - b * b, [i * b for i in range(k)])
        canvas.cached = base + k
        canvas.committed = min(base + k + 1, length)
        canvas.accepted_per_step.append(canvas.committed - 1 - base)
        start = base + k + 1  # the masks of group k - 1 propose positions start .. start + b - 2
        inside = max(0, min(b - 1, length - start))
        draft = [ids[base + k] if base + k < length else mask_id] + proposals[k - 1][:inside]
        draft += [mask_id] * (b - len(draft))
    return Decoded(ids, canvas.accepted_per_step)


def _read_groups(logits: torch.Tensor, base: int, canvas: Canvas) -> tuple[list[int], list[list[int]]]:
    """From the (B, B, V) logits of one step, in one host transfer: the AR tokens at base + 1 .. base + B
    (group g's first token predicts base + g + 1) and each group's MDM proposal for the positions after
    it (group g's mask j predicts base + g + 1 + j), kept inside the slots."""
    b, length = logits.shape[0], len(canvas)
    first = torch.arange(base + 1, base + 1 + b).clamp(max=length - 1)
    after = (base + 2 + torch.arange(b)[:, None] + torch.arange(b - 1)[None]).clamp(max=length - 1)
    proposed = within_slots(logits[:, 1:].reshape(b * (b - 1), -1), after.flatten(), canvas.scaffold).argmax(-1)
    rows = torch.cat([greedy(logits[:, 0], first)[:, None], proposed.reshape(b, b - 1)], dim=1).tolist()
    template = canvas.scaffold.template_ids
    firsts = zip(first.tolist(), rows, strict=True)
    verified = [int(template[p]) if canvas.is_scaffold(p) else row[0] for p, row in firsts]
    return verified, [row[1:] for row in rows]
