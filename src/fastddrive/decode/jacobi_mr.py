"""Multi-block Jacobi decoding with rejection recycling (paper 003 section 3.2, Appendix A Algorithm 1).

Up to K blocks of n positions are refined together in one causal forward. The first is the real-active
block (RA): its draft is verified greedily against the AR head and the agreeing prefix plus one token is
committed, exactly as in `jacobi`. The blocks after it are pseudo-active: they continue the sequence
after RA's draft, so their tokens are conditioned on a noisy context; each keeps a pseudo-accepted
prefix (tokens equal to the head's prediction at the last forward, fed again but not updated) and
Jacobi-updates the rest. Nothing of a pseudo-active block is committed: when RA is complete, the next
block is promoted and its refined draft is verified from scratch. A new pseudo-active block is spawned
after the last one when some block has pseudo-accepted ceil(r n) tokens and fewer than K are active.

Rejection recycling: the tails of RA drafts that the verifier rejected go into an n-gram pool keyed by
their first token. Each forward also verifies up to `candidates` continuations of the last committed
token from the pool, at RA's positions; the one that commits most wins (RA's own draft on ties).
Candidates ride in the sequence dimension of the same forward: each sees the cached prefix, the
uncached head and itself only (a tree mask, as lookahead decoding verifies n-grams), which is the
batched verification of Algorithm 1 without copying the prefix's keys and values into more rows.

Lossless: RA's draft or a candidate is committed by `acceptance.accept`, whose invariant makes every token the
AR head's argmax given committed tokens.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from fastddrive.core.scaffold import Scaffold
from fastddrive.decode.jacobi import Guesser, check_block_size, jacobi_canvas, verify_rows
from fastddrive.decode.result import Decoded
from fastddrive.decode.state import Canvas, greedy
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs

POOL_PER_KEY = 4  # continuations kept per key token (the most recent)
# The block of Jacobi Forcing's later rounds (paper 003 section 4.1 trains at 16, then 32). On 16 validation
# scenes of the first shipped `default-jf` at K = 2 with 4 candidates, n = 16 / 32 / 64 committed 2.66 / 3.32 /
# 3.62 tokens per forward and took 559 / 582 / 790 ms on the 2-core CPU (64 doubles the tokens each forward
# carries).
DEFAULT_MR_BLOCK = 32


@dataclass
class Block:
    """Positions [start, end) and the block's current iterate over them; `pseudo_accepted` tokens at its
    front are frozen (a pseudo-active block's converged prefix)."""

    start: int
    end: int
    iterate: list[int]
    pseudo_accepted: int = 0


class NgramPool:
    """Rejected draft tails, by first token: each key's most recent distinct continuations."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.entries: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, tokens: list[int]) -> None:
        """Every n-gram of `tokens`: key token i, continuation tokens[i + 1 : i + 1 + length]."""
        for i in range(len(tokens) - 1):
            continuations = self.entries.setdefault(tokens[i], OrderedDict())
            gram = tuple(tokens[i + 1 : i + 1 + self.length])
            continuations.pop(gram, None)
            continuations[gram] = None
            while len(continuations) > POOL_PER_KEY:
                continuations.popitem(last=False)

    def continuations(self, key: int) -> list[list[int]]:
        """Most recent first."""
        return [list(gram) for gram in reversed(self.entries.get(key, {}))]


@dataclass
class Layout:
    """Where the tokens of one multi-block forward sit: head, RA draft, pseudo-active blocks, candidates."""

    tokens: list[int]
    pattern: torch.Tensor
    offsets: torch.Tensor
    head: int
    draft: int
    block_rows: list[int]  # first row of each pseudo-active block
    candidate_rows: list[int]  # first row of each candidate


def layout(head: list[int], draft: list[int], pseudo: list[list[int]], candidates: list[list[int]]) -> Layout:
    """One sequence: [head ; RA draft ; pseudo-active blocks] causal, then each candidate seeing the head
    and itself, at the RA draft's positions."""
    main = head + draft + [t for block in pseudo for t in block]
    size = len(main) + sum(len(c) for c in candidates)
    allowed = torch.zeros(size, size, dtype=torch.bool)
    allowed[: len(main), : len(main)] = torch.ones(len(main), len(main), dtype=torch.bool).tril()
    offsets = [torch.arange(len(main))]
    block_rows, row = [], len(head) + len(draft)
    for block in pseudo:
        block_rows.append(row)
        row += len(block)
    candidate_rows = []
    for candidate in candidates:
        candidate_rows.append(row)
        m = len(candidate)
        allowed[row : row + m, : len(head)] = True
        allowed[row : row + m, row : row + m] = torch.ones(m, m, dtype=torch.bool).tril()
        offsets.append(len(head) + torch.arange(m))
        row += m
    tokens = main + [t for c in candidates for t in c]
    return Layout(tokens, allowed, torch.cat(offsets), len(head), len(draft), block_rows, candidate_rows)


class MultiBlockJacobi:
    """Algorithm 1 on one canvas: `step` takes one forward (or an AR step with none) until it is done."""

    def __init__(
        self, canvas: Canvas, guesser: Guesser, block_size: int, max_blocks: int, spawn_ratio: float, candidates: int
    ) -> None:
        self.canvas = canvas
        self.guesser = guesser
        self.n = block_size
        self.max_blocks = max_blocks
        self.spawn_at = math.ceil(spawn_ratio * block_size)
        self.candidates = candidates
        self.pool = NgramPool(block_size)
        self.blocks: list[Block] = []
        self.stats = {"candidate_wins": 0, "spawned_blocks": 0, "promoted_drafts": 0}

    def new_block(self, start: int, guess: list[int] | None = None) -> Block:
        end = min(start + self.n, len(self.canvas))
        tokens = (guess or [])[: end - start]
        tokens += self.guesser(start + len(tokens), end - start - len(tokens))
        return Block(start, end, self.canvas.forced(start, tokens))

    def promote(self) -> None:
        """Make sure the real-active block holds the first uncommitted position."""
        canvas = self.canvas
        while not self.blocks or canvas.committed >= self.blocks[0].end:
            finished = self.blocks.pop(0) if self.blocks else None
            if not self.blocks:
                start = finished.end if finished else canvas.committed - canvas.committed % self.n
                self.blocks.append(self.new_block(start))
            else:
                self.stats["promoted_drafts"] += 1
            self.blocks[0].pseudo_accepted = 0  # everything in RA is verified again

    def step(self, model: BlockDiffusionModel) -> None:
        """One forward of Algorithm 1 (lines 4-14), or an AR step with none when the next logits are known."""
        canvas = self.canvas
        self.promote()
        if canvas.cached == canvas.committed:
            canvas.commit_seed(greedy)
            canvas.accepted_per_step.append(1)
            return
        ra = self.blocks[0]
        first = canvas.committed
        ra.iterate[: first - ra.start] = canvas.ids[ra.start : first]
        draft = ra.iterate[first - ra.start :]
        pseudo = self.blocks[1:]
        candidates = self.pool_candidates(draft)
        plan = layout(canvas.head(), draft, [b.iterate for b in pseudo], candidates)
        logits = model.forward(canvas.cache, plan.tokens, plan.pattern, plan.offsets, keep=plan.head + plan.draft)[0]

        # Real-active block and candidates: greedy verification; the best one commits.
        seed_row = logits[plan.head - 1 : plan.head]
        verified = verify_rows(canvas, first, draft, logits[plan.head - 1 : plan.head + plan.draft])
        best, best_tokens = verified, draft
        for row, candidate in zip(plan.candidate_rows, candidates, strict=True):
            rows = torch.cat([seed_row, logits[row : row + len(candidate)]])
            trial = verify_rows(canvas, first, candidate, rows)
            if trial.accepted.agreed > best.accepted.agreed:
                best, best_tokens = trial, candidate
        if best is verified:
            committed = canvas.commit(verified.accepted, verified.after)
        else:
            self.stats["candidate_wins"] += 1
            # The candidate's keys and values were not kept: its tokens are fed again as the head.
            committed = canvas.commit(best.accepted, None, cached_to=first)
        canvas.accepted_per_step.append(committed)
        agreed = verified.accepted.agreed
        self.pool.add(draft[max(0, agreed - 1) :])  # the rejected tail, from the last agreeing token
        # Jacobi update of RA's tail: the winner's predictions where it reached, RA's own beyond.
        tail = best.targets + verified.targets[len(best_tokens) :]
        ra.iterate[first - ra.start :] = tail

        for block, row in zip(pseudo, plan.block_rows, strict=True):
            self.refine(block, logits[row - 1 : row - 1 + len(block.iterate)])
        self.spawn(draft)

    def pool_candidates(self, draft: list[int]) -> list[list[int]]:
        """Continuations of the last committed token from the pool, cut to RA's draft length, the
        template put back, none equal to RA's own draft."""
        canvas, first = self.canvas, self.canvas.committed
        chosen: list[list[int]] = []
        for gram in self.pool.continuations(canvas.ids[first - 1]):
            if len(chosen) == self.candidates:
                break
            candidate = canvas.forced(first, gram[: len(draft)])
            if candidate and candidate != draft[: len(candidate)] and candidate not in chosen:
                chosen.append(candidate)
        return chosen

    def refine(self, block: Block, rows: torch.Tensor) -> None:
        """A pseudo-active block after a forward: row j predicts its position j. Its pseudo-accepted prefix
        grows while the iterate equals the prediction; the rest takes the predictions (Jacobi update)."""
        predicted = self.canvas.forced(block.start, rows.argmax(-1).tolist())
        k = block.pseudo_accepted
        while k < len(block.iterate) and block.iterate[k] == predicted[k]:
            k += 1
        block.pseudo_accepted = k
        block.iterate[k:] = predicted[k:]

    def spawn(self, draft: list[int]) -> None:
        """Algorithm 1 line 14: a new pseudo-active block after the last, seeded with RA's draft."""
        ra_accepted = self.canvas.committed - self.blocks[0].start
        progressed = max([ra_accepted] + [b.pseudo_accepted for b in self.blocks[1:]])
        last = self.blocks[-1]
        if progressed >= self.spawn_at and len(self.blocks) < self.max_blocks and last.end < len(self.canvas):
            self.blocks.append(self.new_block(last.end, list(draft)))
            self.stats["spawned_blocks"] += 1


@torch.no_grad()
def jacobi_mr_decode(
    model: BlockDiffusionModel,
    prompt: PromptInputs,
    scaffold: Scaffold,
    *,
    block_size: int = DEFAULT_MR_BLOCK,
    max_blocks: int = 2,
    spawn_ratio: float = 0.85,
    candidates: int = 4,
    seed: int = 0,
    drafts: list[int] | None = None,
) -> Decoded:
    """`jacobi-mr` (paper 003 Algorithm 1): up to `max_blocks` (K) blocks of `block_size` (n) in flight,
    spawn threshold ceil(`spawn_ratio` n), up to `candidates` recycled n-grams verified per forward (the
    paper's K = 2, r = 0.85 and n-gram verification size 4; n = 32 is `tiny-jf`'s training block in rounds 2-3,
    see DEFAULT_MR_BLOCK). The ids of greedy `ar`."""
    check_block_size(block_size)
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    if not 0 < spawn_ratio <= 1:
        raise ValueError(f"spawn_ratio must be in (0, 1], got {spawn_ratio}")
    if candidates < 0:
        raise ValueError(f"candidates must be >= 0, got {candidates}")
    # A forward holds the answer's blocks (never past its end) and the candidates, each at most a block: the
    # pool keeps POOL_PER_KEY per key, so more candidates are never fed.
    room = (min(candidates, POOL_PER_KEY) + 1) * block_size
    canvas = jacobi_canvas(model, prompt, scaffold, room=room)
    decoder = MultiBlockJacobi(
        canvas, Guesser(model, prompt, seed, drafts), block_size, max_blocks, spawn_ratio, candidates
    )
    while not canvas.done:
        decoder.step(model)
    return Decoded(canvas.answer_ids(), canvas.accepted_per_step, dict(decoder.stats))
