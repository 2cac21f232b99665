"""Linear self-speculative decoding: one MDM draft and one causal verify per block (paper 002 Algorithm 1),
and Scaffold Speculative Decoding, the same loop over the frozen scaffold (paper 000 section 3.3).

Per block, `Speculation` takes the paper's steps in order (read them beside section 3.3):

1. `auto_accept`: a block with no value left is the scaffold, accepted with no forward;
2. `draft` / `read_draft`: one forward in which the MDM head fills the block's value masks (`propose`);
3. `verify` / `accept`: one causal forward over the draft; `acceptance.accept` keeps it up to its first
   disagreement with the AR head plus the AR head's token there (the bonus), so both decoders return the ids
   of greedy `ar` (the invariant is written once, in `acceptance`); the cache is cropped to what was accepted.

`next_feed` takes every step that needs no forward and says what the next forward must read, `receive` takes
that forward's logits. `run` drives one canvas; `run_rows` drives several canvases that share one batched
cache with one forward per step for all of them (test-time scaling's rollouts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from fastddrive.core.scaffold import DEFAULT_BLOCK_SIZE, Scaffold
from fastddrive.decode import acceptance
from fastddrive.decode.blocks import BlockOf, section_blocks, sliding_window
from fastddrive.decode.confidence import masked_rows
from fastddrive.decode.result import Decoded
from fastddrive.decode.state import Canvas, TokenPicker, greedy
from fastddrive.engine.kv_cache import KVCache
from fastddrive.engine.masks import CAUSAL, FULL, as_pattern, block_mask
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs


@lru_cache(maxsize=256)
def fused_layout(fed: int, tail: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Offsets and attention of a verify that also drafts the next block.

    `fed` tokens are verified causally. The `tail` repeats the last fed token at its own position and
    masks the next block after it, so that the drafted block starts with a known token, as every block
    does in training (its first token is never masked): the tail sees the fed tokens before that last
    one, and itself bidirectionally. Tail row j predicts the position after the last fed one + j.
    """
    offsets = torch.cat([torch.arange(fed), fed - 1 + torch.arange(tail)])
    allowed = torch.zeros(fed + tail, fed + tail, dtype=torch.bool)
    allowed[:fed, :fed] = block_mask(fed, fed)
    allowed[fed:, : fed - 1] = True
    allowed[fed:, fed:] = True
    return offsets, allowed


@dataclass
class Feed:
    """One forward a speculation asks for: tokens after its row's cached prefix, who sees whom, their
    position offsets, and how many of them the cache keeps (a draft keeps none)."""

    tokens: list[int]
    pattern: torch.Tensor | str
    offsets: torch.Tensor | None
    keep: int


@dataclass
class DraftStats:
    """Drafted value positions and how many the verifier accepted: for drafts made by a forward of their
    own, and for drafts made inside the previous verify (fused)."""

    drafted: int = 0
    accepted: int = 0
    fused_drafts: int = 0
    fused_drafted: int = 0
    fused_accepted: int = 0

    def to_json(self) -> dict[str, int]:
        return {
            "drafted_values": self.drafted,
            "accepted_values": self.accepted,
            "fused_drafts": self.fused_drafts,
            "fused_drafted_values": self.fused_drafted,
            "fused_accepted_values": self.fused_accepted,
        }


class Speculation:
    """Paper 000 section 3.3's rounds on one canvas until `until` positions are committed (all by default).

    A block goes through the paper's steps in order: `auto_accept` (the scaffold, no forward), `draft` (the
    MDM head fills the value masks, one forward, read by `read_draft`), `verify` (one causal forward over
    the uncached head and the draft) and `accept` (`acceptance.accept`: the draft up to its first
    disagreement with the AR head, and the AR head's token there). A forward is asked for by `next_feed`
    and its logits handed back to `receive`, so that `run_rows` can batch the canvases of several rollouts.

    The draft is greedy; `pick` chooses the verifier's token (greedy, or sampled for test-time scaling:
    accepting a draft only where it equals the sample keeps every token an exact AR sample). With
    `fuse`, a verify also drafts the next block (`fused_layout`); when its block is accepted whole,
    that draft is used and the next block's own draft forward is saved (the accepted tokens, and so the
    ids, are the same either way). The last verify before `until` drafts the block after it only if
    `draft_past_until` (for whoever continues the canvas by drafting: `tts`'s rollouts).
    """

    def __init__(
        self,
        canvas: Canvas,
        block_of: BlockOf,
        scaffold_aware: bool,
        pick: TokenPicker = greedy,
        until: int | None = None,
        fuse: bool = False,
        drafted: tuple[int, list[int], bool] | None = None,
        drafts: list[int] | None = None,
        draft_past_until: bool = True,
    ) -> None:
        self.canvas = canvas
        self.drafts = drafts  # ids to draft instead of the MDM head (the verifier still decides)
        self.block_of = block_of
        self.scaffold_aware = scaffold_aware
        self.pick = pick
        self.until = len(canvas) if until is None else until
        self.fuse = fuse
        self.fuse_limit = len(canvas) if draft_past_until else self.until  # no verify drafts from here on
        self.stats = DraftStats()
        self.drafted = drafted  # (first position, draft, made by a verify) waiting for its round
        self._round: tuple[str, int, int, list[int], list[int] | None] | None = None

    def next_feed(self) -> Feed | None:
        """Take every step that needs no forward; return the forward this canvas needs next, or None."""
        canvas = self.canvas
        while canvas.committed < self.until:
            if canvas.cached == canvas.committed:  # the last verify's bonus (or the prefill's next token)
                canvas.commit_seed(self.pick)
                continue
            start, end = self.block_of(canvas.committed)
            end = min(end, self.until)
            proposal = canvas.blank(canvas.committed, end, self.scaffold_aware)
            if self.auto_accept(proposal, end):
                continue
            if (
                self.drafted is not None
                and self.drafted[0] == canvas.committed
                and len(self.drafted[1]) == len(proposal)
            ):
                return self.verify(end, self.drafted[1])
            return self.draft(start, end, proposal)
        return None

    def receive(self, logits: torch.Tensor) -> None:
        """Take the logits (tokens fed, V) of the forward `next_feed` asked for."""
        if self._round[0] == "draft":
            self.read_draft(logits)
        else:
            self.accept(logits)

    def auto_accept(self, proposal: list[int], end: int) -> bool:
        """Step 1: a block left with no value to decide is accepted as the scaffold, with no forward."""
        if self.canvas.scaffold.mask_id in proposal:
            return False
        self.canvas.committed = end
        return True

    def draft(self, start: int, end: int, proposal: list[int]) -> Feed:
        """Step 2's forward: the uncached head (causal before `start`) and the block's masks, which the MDM
        head fills bidirectionally; nothing is kept in the cache."""
        canvas = self.canvas
        self.drafted = None
        self._round = ("draft", canvas.committed, end, proposal, None)
        head = canvas.head()
        causal_head = min(max(0, start - canvas.cached), len(head))
        pattern = block_mask(len(head) + len(proposal), causal_head) if causal_head else FULL
        return Feed(head + proposal, pattern, None, 0)

    def read_draft(self, logits: torch.Tensor) -> None:
        """Step 2's draft: the MDM head's greedy tokens on the block's masks (`propose`)."""
        _, first, _, proposal, _ = self._round
        masked, tokens = self._propose(proposal, logits, len(self.canvas.head()) - 1, first)
        for i, token in zip(masked, tokens.tolist(), strict=True):
            proposal[i] = token
        self.drafted = (first, proposal, False)

    def verify(self, end: int, proposal: list[int]) -> Feed:
        """Step 3's forward: the uncached head and the draft, causally, all kept in the cache; with `fuse`,
        followed by the next block's draft (`fused_layout`) when that block has a value to decide."""
        canvas, mask_id = self.canvas, self.canvas.scaffold.mask_id
        fed = canvas.head() + proposal
        tail = None
        if self.fuse and end < self.fuse_limit:
            tail = [proposal[-1]] + canvas.blank(end, self.block_of(end)[1], self.scaffold_aware)
            tail = tail if mask_id in tail[2:] else None
        self._round = ("verify", canvas.committed, end, proposal, tail)
        if tail is None:
            return Feed(fed, CAUSAL, None, len(fed))
        offsets, allowed = fused_layout(len(fed), len(tail))
        return Feed(fed + tail, allowed, offsets, len(fed))

    def accept(self, logits: torch.Tensor) -> None:
        """Step 3's acceptance of the verify's logits: commit by `acceptance.accept` (its invariant makes the
        ids AR's); when the whole block is accepted, the verifier's next token seeds the next block and a
        fused verify's draft of that block waits for its round."""
        _, first, end, proposal, tail = self._round
        fused = self.drafted is not None and self.drafted[2]
        self.drafted = None
        canvas = self.canvas
        head = len(canvas.head())
        canvas.cached += head + len(proposal)  # the verify kept head and proposal
        # The verifier's tokens and, for a fused verify, the next block's draft: one transfer to the host.
        picked = self.pick(logits[head - 1 : head - 1 + len(proposal)], torch.arange(first, end))
        following = tail[2:] if tail is not None else []
        if tail is not None:
            masked, drafted = self._propose(following, logits[head + len(proposal) :], 1, end + 1)
            picked = torch.cat([picked, drafted])
        host = picked.tolist()
        targets = canvas.forced(first, host[: len(proposal)])
        accepted = canvas.commit(acceptance.accept(proposal, targets), logits[head - 1 + len(proposal)])
        self._count(fused, first, proposal)
        if canvas.cached == end and end < len(canvas):  # accepted whole: the bonus seeds the next block
            if end < self.until:
                canvas.commit_seed(self.pick)
                accepted += 1
            if tail is not None:  # tail row j predicts position end + j
                for i, token in zip(masked, host[len(proposal) :], strict=True):
                    following[i] = token
                self.drafted = (end + 1, following, True)
        canvas.accepted_per_step.append(accepted)

    def _propose(
        self, proposal: list[int], logits: torch.Tensor, row_of_first: int, first: int
    ) -> tuple[list[int], torch.Tensor]:
        if self.drafts is None:
            return propose(proposal, logits, row_of_first, first, self.canvas)
        masked = [i for i, token in enumerate(proposal) if token == self.canvas.scaffold.mask_id]
        return masked, torch.tensor([self.drafts[first + i] for i in masked], device=logits.device)

    def _count(self, fused: bool, first: int, proposal: list[int]) -> None:
        values = [first + i for i in range(len(proposal)) if not self.canvas.is_scaffold(first + i)]
        agreed = sum(p < self.canvas.committed and self.canvas.ids[p] == proposal[p - first] for p in values)
        if fused:
            self.stats.fused_drafts += 1
            self.stats.fused_drafted += len(values)
            self.stats.fused_accepted += agreed
        else:
            self.stats.drafted += len(values)
            self.stats.accepted += agreed


def propose(
    proposal: list[int], logits: torch.Tensor, row_of_first: int, first: int, canvas: Canvas
) -> tuple[list[int], torch.Tensor]:
    """The MDM head's draft for the masks of `proposal` (positions first, first + 1, ...): their indices
    and greedy tokens inside each slot's vocabulary, on the device; logits[row_of_first + i] predicts
    proposal[i]."""
    masked, rows = masked_rows(proposal, logits, row_of_first, first, canvas.scaffold)
    return masked, rows.argmax(-1)


def run(model: BlockDiffusionModel, speculation: Speculation) -> None:
    """Drive one canvas to its end, one forward at a time."""
    while (feed := speculation.next_feed()) is not None:
        cache = speculation.canvas.cache
        speculation.receive(model.forward(cache, feed.tokens, feed.pattern, feed.offsets, keep=feed.keep)[0])


def run_rows(model: BlockDiffusionModel, cache: KVCache, speculations: Sequence[Speculation]) -> None:
    """Drive canvases that own one row each of `cache` together: each step, one forward reads every
    unfinished row's next feed (padded to the longest; padding sees only itself and is never kept)."""
    while True:
        feeds = [s.next_feed() for s in speculations]
        live = [f for f in feeds if f is not None]
        if not live:
            return
        n = max(len(f.tokens) for f in live)
        pad = speculations[0].canvas.scaffold.mask_id
        tokens, patterns, offsets, keep = [], [], [], []
        for feed in feeds:
            feed = feed or Feed([pad], FULL, None, 0)
            m = len(feed.tokens)
            tokens.append(feed.tokens + [pad] * (n - m))
            pattern = torch.eye(n, dtype=torch.bool)
            pattern[:m, :m] = as_pattern(feed.pattern, m)
            patterns.append(pattern)
            steps = torch.arange(m) if feed.offsets is None else feed.offsets
            offsets.append(torch.cat([steps, steps[-1] + 1 + torch.arange(n - m)]))
            keep.append(feed.keep)
        logits = model.forward(cache, torch.tensor(tokens), patterns, torch.stack(offsets), keep=keep)
        for row, (speculation, feed) in enumerate(zip(speculations, feeds, strict=True)):
            if feed is not None:
                speculation.receive(logits[row, : len(feed.tokens)])


def scaffold_speculative_decode(
    model: BlockDiffusionModel,
    prompt: PromptInputs,
    scaffold: Scaffold,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    fuse_draft: bool = True,
    drafts: list[int] | None = None,
) -> Decoded:
    """`ss` (paper 000 section 3.3): per section-aligned block, scaffold auto-accepted with no forward, one
    MDM draft of the value positions, one causal verify, accept to the first mismatch plus the AR token.

    `fuse_draft` (default) lets each verify also draft the next block (see `fused_layout`); off, every
    block takes the paper's two forwards. `drafts` (response ids) replace the MDM head's drafts: the
    verifier still decides every token, so the ids stay `ar`'s; with `ar`'s own ids it times the speed
    bound at perfect acceptance.
    """
    if drafts is not None and len(drafts) != len(scaffold):
        raise ValueError(f"drafts must hold {len(scaffold)} response ids, got {len(drafts)}")
    canvas = Canvas.prefill(model, prompt, scaffold)
    blocks = section_blocks(scaffold, block_size)
    speculation = Speculation(canvas, blocks, scaffold_aware=True, fuse=fuse_draft, drafts=drafts)
    run(model, speculation)
    return Decoded(canvas.ids, canvas.accepted_per_step, speculation.stats.to_json())


def self_speculative_decode(
    model: BlockDiffusionModel, prompt: PromptInputs, scaffold: Scaffold, *, block_size: int = DEFAULT_BLOCK_SIZE
) -> Decoded:
    """`selfspec` (paper 002 Algorithm 1): fixed-size blocks [last token, B - 1 masks], no scaffold
    knowledge in the draft; the verifier forces the scaffold as `ar` does, so the ids equal `ar`'s."""
    canvas = Canvas.prefill(model, prompt, scaffold)
    run(model, Speculation(canvas, sliding_window(len(scaffold), block_size), scaffold_aware=False))
    return Decoded(canvas.ids, canvas.accepted_per_step)


def ss_nfe_floor(scaffold: Scaffold, block_size: int = DEFAULT_BLOCK_SIZE, fuse_draft: bool = True) -> int:
    """The forwards `ss` takes when every draft is right: the prefill, then for every block with a value
    left to decide one verify, plus one draft forward unless the previous verify drafted it (fused, when
    that block has a value after its first position, which the previous verify's bonus decides)."""
    blocks = [(b.start, b.end) for b in scaffold.blocks(block_size)]
    is_value = scaffold.is_value
    forwards, committed, drafted = 1, 1, False  # the prefill's logits commit position 0
    for k, (start, end) in enumerate(blocks):
        if not is_value[max(start, committed) : end].any():  # scaffold only: accepted with no forward
            committed, drafted = end, False
            continue
        forwards += 1 if drafted else 2
        following = blocks[k + 1] if k + 1 < len(blocks) else None
        drafted = bool(fuse_draft and following and is_value[end + 1 : following[1]].any())
        committed = end + 1 if following else end
    return forwards
