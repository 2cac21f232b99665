"""Linear self-speculative decoding: one MDM draft and one causal verify per block (paper 002 Algorithm 1),
and Scaffold Speculative Decoding, the same loop over the frozen scaffold (paper 000 section 3.3).

Both return exactly the ids of greedy `ar`: a value is committed only where it equals the AR head's
argmax given the committed prefix, the first mismatch is replaced by that argmax (the bonus token), and
the cache is cropped to what was accepted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastddrive.decode.confidence import masked_rows
from fastddrive.decode.result import Decoded
from fastddrive.decode.state import Canvas, TokenPicker, greedy
from fastddrive.model import BlockDiffusionModel, PromptInputs, block_mask
from fastddrive.scaffold import DEFAULT_BLOCK_SIZE, Scaffold

BlockOf = Callable[[int], tuple[int, int]]  # first uncommitted position -> [start, end) of its block


def section_blocks(scaffold: Scaffold, block_size: int) -> BlockOf:
    """The section-aligned block holding a position (paper 000 section 3.2)."""
    span = {}
    for block in scaffold.blocks(block_size):
        span |= dict.fromkeys(range(block.start, block.end), (block.start, block.end))
    return span.__getitem__


def sliding_window(length: int, block_size: int) -> BlockOf:
    """Algorithm 1's block: the last committed token and the next block_size - 1 positions."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    return lambda n: (n - 1, min(n - 1 + block_size, length))


def _fill(proposal: list[int], logits: torch.Tensor, row_of_first: int, first: int, canvas: Canvas) -> None:
    """Replace the masks of `proposal` (positions first, first + 1, ...) by the MDM head's greedy tokens."""
    masked, rows = masked_rows(proposal, logits, row_of_first, first, canvas.scaffold)
    for i, token in zip(masked, rows.argmax(-1).tolist(), strict=True):
        proposal[i] = token


@torch.no_grad()
def speculative_steps(
    model: BlockDiffusionModel,
    canvas: Canvas,
    block_of: BlockOf,
    scaffold_aware: bool,
    pick: TokenPicker = greedy,
    until: int | None = None,
    fuse: bool = False,
) -> None:
    """Draft-verify-accept on `canvas` until `until` positions are committed (all by default).

    The draft is greedy; `pick` chooses the verifier's token (greedy, or sampled for test-time
    scaling: accepting a draft only where it equals the sample keeps every token an exact AR sample).
    With `fuse`, the verify forward also carries the next block, masked and bidirectional after the
    causal part: when the block is accepted whole, that is the next block's draft and its own draft
    forward is saved (the accepted tokens, and so the ids, are the same either way).
    """
    until = len(canvas) if until is None else until
    mask_id, ids = canvas.scaffold.mask_id, canvas.ids

    ready: tuple[int, int, list[int]] | None = None  # a draft [first, last) made by the previous verify
    while canvas.committed < until:
        if canvas.cached == canvas.committed:
            canvas.commit_seed(pick)
            continue
        n, c = canvas.committed, canvas.cached
        start, end = block_of(n)
        end = min(end, until)
        proposal = canvas.blank(n, end, scaffold_aware)
        if mask_id not in proposal:  # scaffold only: accepted with no forward
            canvas.committed = end
            continue
        head = ids[c:n]
        if ready is not None and ready[:2] == (n, end):
            proposal = ready[2]
        else:
            _fill(proposal, canvas.draft(model, start, proposal), len(head) - 1, n, canvas)
        ready = None
        fed = head + proposal
        following = block_of(end) if fuse and end < until else None
        tail = canvas.blank(end, min(following[1], until), scaffold_aware) if following else []
        if mask_id in tail[1:]:
            logits = model.tree(
                canvas.cache,
                fed + tail,
                torch.arange(len(fed) + len(tail)),
                block_mask(len(fed) + len(tail), causal_head=len(fed)),
            )
            canvas.cache.crop(canvas.cache.length - len(tail))
            checked, tail_logits = logits[: len(fed)], logits[len(fed) :]
        else:
            checked, tail_logits = model.verify(canvas.cache, fed), None
        accepted = 0
        for i, drafted in enumerate(proposal):
            p = n + i
            ids[p] = canvas.target(p, checked[len(head) + i - 1], pick)
            accepted += 1
            if ids[p] != drafted:
                canvas.committed = p + 1
                canvas.crop_to(p)
                break
        else:
            canvas.committed = canvas.cached = end
            canvas.next_logits = checked[-1]
            if end < until:
                canvas.commit_seed(pick)
                accepted += 1
                if tail_logits is not None:  # tail row j predicts position end + j + 1
                    following_draft = tail[1:]
                    _fill(following_draft, tail_logits, 0, end + 1, canvas)
                    ready = (end + 1, end + len(tail), following_draft)
        canvas.accepted_per_step.append(accepted)


def scaffold_speculative_decode(
    model: BlockDiffusionModel,
    prompt: PromptInputs,
    scaffold: Scaffold,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    fuse_draft: bool = True,
) -> Decoded:
    """`ss` (paper 000 section 3.3): per section-aligned block, scaffold auto-accepted with no forward, one
    MDM draft of the value positions, one causal verify, accept to the first mismatch plus the AR token.

    `fuse_draft` (default) lets each verify also draft the next block (see `speculative_steps`); off, every
    block takes the paper's two forwards.
    """
    canvas = Canvas.prefill(model, prompt, scaffold)
    speculative_steps(model, canvas, section_blocks(scaffold, block_size), scaffold_aware=True, fuse=fuse_draft)
    return Decoded(canvas.ids, canvas.accepted_per_step)


def self_speculative_decode(
    model: BlockDiffusionModel, prompt: PromptInputs, scaffold: Scaffold, *, block_size: int = DEFAULT_BLOCK_SIZE
) -> Decoded:
    """`selfspec` (paper 002 Algorithm 1): fixed-size blocks [last token, B - 1 masks], no scaffold
    knowledge in the draft; the verifier forces the scaffold as `ar` does, so the ids equal `ar`'s."""
    canvas = Canvas.prefill(model, prompt, scaffold)
    speculative_steps(model, canvas, sliding_window(len(scaffold), block_size), scaffold_aware=False)
    return Decoded(canvas.ids, canvas.accepted_per_step)


def ss_nfe_floor(scaffold: Scaffold, block_size: int = DEFAULT_BLOCK_SIZE, fuse_draft: bool = False) -> int:
    """The fewest forwards `ss` can take: the prefill and one draft + one verify per block with values
    (the paper's count); with `fuse_draft`, one draft for the first such block and one verify per block."""
    blocks = sum(bool(scaffold.is_value[b.start : b.end].any()) for b in scaffold.blocks(block_size))
    return 1 + (1 + blocks if fuse_draft else 2 * blocks)
