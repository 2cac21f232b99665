"""Plan-Verify-Fill (paper 001, Algorithm 1): a training-free parallel decoder on the MDM head, over the
frozen scaffold and section-aligned blocks exactly as `sd` (only value positions are masked).

A step starts from the MDM head's predictions on the window's masks (made by the previous forward) and
forms the base branch (section 3): the masks `sd` would commit, those with confidence above `tau` (at
least one). Beside it, up to width - 1 drafts are verified in one forward:

- Planning Route (sections 4.1-4.2): masks outside the base set whose top-1 token is in the calibrated
  planning vocabulary (Appendix A.2) and whose confidence lies in [plan_low, plan_high), the most
  confident first, each added alone to the base branch (Eq. 2). Filter 1 (Eq. 3) keeps a draft when the
  impact set (Eq. 1: the base branch's masks whose top-1 it makes confident) is not empty and the draft
  keeps every one of those top-1 tokens; of the drafts kept, the one with the largest verified information
  gain (the mean entropy reduction over the window's other masks, section 3) is committed, else the base.
- AR Fallback Route (section 4.3), when no mask is a planning candidate: the leftmost masks outside the
  base set with confidence at least `tau_ar`; branch k adds the first k of them; the longest branch whose
  fills are all still the top-1 under the branch itself (the immediate-context consistency check) is
  committed, else the base.

The forward that verifies the branches also predicts for the next step (the committed branch's logits are
the next step's), so a step costs one forward, as a step of `sd` does: width 1 without revelation or fused
writes is `sd`.
The branches ride in the sequence dimension of that forward: the uncached committed head once, then one
copy of the window per branch that sees the cached prefix, the head's causal part and itself only (a tree
mask), at the window's own positions. Each copy attends exactly as the same branch drafted alone would, as
rows of a forked cache would, without copying the prefix's keys and values.

Early cross-block revelation (Appendix A.5.1): once the block's base branch has at most `reveal` masks
left, the next block joins the window and its masks may be committed (and drafted) early; they are kept
when that block's turn comes, and a block decided whole this way costs no forward of its own. The
revealed block sees the current one, not the other way round, so the current block is predicted exactly
as without revelation (the paper asks for a conservative expansion; a 64-token bidirectional window gave
worse trajectories on the embedded model). As in `sd`, a finished block is written to the cache by one
causal forward, which also gives the AR seed of a next block that starts with an undecided value; when
the next block starts with a decided token (the scaffold's, or one revealed early) there is no seed to
read, and with `fuse_write` the finished block is fed causally at the head of the next block's first
forward instead (the keys and values are the same ones; the forward carries more tokens, there is one
forward less per block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from fastddrive.core.scaffold import DEFAULT_BLOCK_SIZE, Scaffold
from fastddrive.decode.blocks import BlockOf, section_blocks
from fastddrive.decode.confidence import confident_positions, within_slots
from fastddrive.decode.planning_vocabulary import (
    PlanningVocabularyError,
    read_vocabulary,
    vocabulary_path,
)
from fastddrive.decode.result import Decoded
from fastddrive.decode.state import Canvas, greedy
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs

DEFAULT_TAU = 0.9  # tau_high, shared with `sd` (paper 001 section 5.1)
DEFAULT_WIDTH = 4  # the base branch and 3 drafts in one forward (section 5.1: batch size 4)
# Table 5's band for HumanEval and MATH: its band for GSM8K and MMLU-Pro, (0.2, 0.65), commits generic words
# early in the 32-token explanation, which the later sections read, and gave worse answers in more forwards.
DEFAULT_PLAN_BAND = (0.8, 0.9)
DEFAULT_TAU_AR = 0.1  # Table 5 (GSM8K, MMLU-Pro)
# Off: Table 5's N_s = 5 (GSM8K, MMLU-Pro) let blocks of the merge scenes commit the next block's
# waypoints before their own were decided (ADE@5s 1.85 against sd's 0.21 m there).
DEFAULT_REVEAL = 0
# A finished block's causal write rides along the next block's first forward when that block starts with a
# decided token, so a block costs its steps and no forward of its own for the write.
DEFAULT_FUSE_WRITE = True

Fill = tuple[int, int]  # (window index, token) added to the base branch


@dataclass(frozen=True)
class Candidate:
    """A mask outside the base set: its window index, its top-1 token and that token's probability."""

    index: int
    token: int
    confidence: float


@dataclass
class Verified:
    """What one batched forward says about the base branch's masks (`columns`, window indices) under each
    branch (rows, the base first): top-1 token, its probability, and the entropy of the slot-restricted
    distribution, each (branches, masks)."""

    columns: list[int]
    top: torch.Tensor
    confidence: torch.Tensor
    entropy: torch.Tensor
    tau: float

    def column(self, index: int) -> int:
        return self.columns.index(index)

    def impact_set(self) -> list[int]:
        """Eq. 1: columns still masked in the base branch whose top-1 is confident under it (above tau,
        the base rule's own comparison)."""
        return [c for c in range(len(self.columns)) if self.confidence[0, c] > self.tau]

    def compatible(self, branch: int, fills: list[Fill]) -> bool:
        """Eq. 3: the impact set is not empty and `branch` keeps the base branch's top-1 on all of it (at a
        filled position the branch's token is the one compared)."""
        impact = self.impact_set()
        own = {self.column(i): token for i, token in fills}
        return bool(impact) and all(own.get(c, int(self.top[branch, c])) == int(self.top[0, c]) for c in impact)

    def information_gain(self, branch: int, fills: list[Fill]) -> float:
        """Section 3's Delta H: the mean entropy reduction from the base branch to `branch` over the base
        branch's other masks (0 when there are none)."""
        filled = {self.column(i) for i, _ in fills}
        others = [c for c in range(len(self.columns)) if c not in filled]
        if not others:
            return 0.0
        return float((self.entropy[0, others] - self.entropy[branch, others]).mean())

    def keeps_fills(self, branch: int, fills: list[Fill]) -> bool:
        """Section 4.3: every fill of `branch` is still the top-1 at its position under the branch."""
        return all(int(self.top[branch, self.column(i)]) == token for i, token in fills)


@dataclass(frozen=True)
class Proposal:
    """The drafts a route asks one forward to verify beside the base branch, and the route that made them."""

    route: str
    drafts: list[list[Fill]]


NO_DRAFTS = Proposal("base", [])
ROUTES = ("planning", "fallback")


class Route(Protocol):
    """Which drafts a step verifies beside the base branch, and which branch it commits (0: the base)."""

    def propose(self, candidates: list[Candidate]) -> Proposal: ...

    def choose(self, proposal: Proposal, verified: Verified) -> int: ...


@dataclass
class PlanVerifyFill:
    """Algorithm 1's routes: planning when some mask is a planning candidate, else the AR fallback (if on).
    An empty `planning_ids` switches planning off; width 1 verifies nothing beside the base branch."""

    width: int
    plan_band: tuple[float, float]
    tau_ar: float
    planning_ids: frozenset[int]
    fallback: bool
    stats: dict[str, int] = field(
        default_factory=lambda: {f"{route}_{what}": 0 for route in ROUTES for what in ("steps", "accepted", "tokens")}
    )

    def propose(self, candidates: list[Candidate]) -> Proposal:
        if self.width < 2:
            return NO_DRAFTS
        low, high = self.plan_band
        planning = [c for c in candidates if c.token in self.planning_ids and low <= c.confidence < high]
        if planning:
            best = sorted(planning, key=lambda c: -c.confidence)[: self.width - 1]
            return Proposal("planning", [[(c.index, c.token)] for c in best])
        if not self.fallback:
            return NO_DRAFTS
        leftmost = sorted((c for c in candidates if c.confidence >= self.tau_ar), key=lambda c: c.index)
        fills = [(c.index, c.token) for c in leftmost[: self.width - 1]]
        return Proposal("fallback", [fills[:k] for k in range(1, len(fills) + 1)])

    def choose(self, proposal: Proposal, verified: Verified) -> int:
        drafts = proposal.drafts
        if not drafts:
            return 0
        self.stats[f"{proposal.route}_steps"] += 1
        if proposal.route == "planning":  # Filter 1, then the largest verified information gain
            kept = [b for b, fills in enumerate(drafts, 1) if verified.compatible(b, fills)]
            best = max(kept, key=lambda b: verified.information_gain(b, drafts[b - 1]), default=0)
        else:  # the longest nested fill that keeps all its tokens
            best = max((b for b, fills in enumerate(drafts, 1) if verified.keeps_fills(b, fills)), default=0)
        if best:
            self.stats[f"{proposal.route}_accepted"] += 1
            self.stats[f"{proposal.route}_tokens"] += len(drafts[best - 1])
        return best


@dataclass
class ForwardLog:
    """Tokens fed by each decode forward (the prefill not counted) and the drafts verified beside a base."""

    tokens: list[int] = field(default_factory=list)
    branches: int = 0

    def to_json(self) -> dict[str, Any]:
        fed = self.tokens or [0]
        return {
            "decode_forwards": len(self.tokens),
            "branches_verified": self.branches,
            "tokens_per_forward_mean": sum(fed) / len(fed),
            "tokens_per_forward_max": max(fed),
        }


def tree_layout(
    head: list[int], causal: int, branches: list[list[int]], block: int
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Tokens, attention (n, n) and position offsets of one forward verifying `branches` (windows of equal
    length) after the uncached `head`, whose first `causal` tokens are causal: those once, then per branch
    the rest of the head and the window, seeing the causal part and their own copy only. The copy's first
    `block` window tokens (the current block) see one another bidirectionally; any after them (a revealed
    next block) see the whole copy, and the current block does not see them."""
    shared, own = head[:causal], head[causal:]
    size = causal + sum(len(own) + len(b) for b in branches)
    allowed = torch.zeros(size, size, dtype=torch.bool)
    allowed[:causal, :causal] = torch.ones(causal, causal, dtype=torch.bool).tril()
    offsets, at = [torch.arange(causal)], causal
    for branch in branches:
        m, current = len(own) + len(branch), len(own) + block
        allowed[at : at + m, :causal] = True
        allowed[at : at + current, at : at + current] = True
        allowed[at + current : at + m, at : at + m] = True
        offsets.append(causal + torch.arange(m))
        at += m
    return shared + [t for b in branches for t in own + b], allowed, torch.cat(offsets)


def branch_logits(
    model: BlockDiffusionModel,
    canvas: Canvas,
    block_start: int,
    block: int,
    branches: list[list[int]],
    log: ForwardLog,
) -> torch.Tensor:
    """One forward over the branches (after the canvas's uncached head), whose first `block` tokens are the
    current block's; logits (branches, window, V), row [b, i] predicting branches[b][i]."""
    head, n = canvas.head(), len(branches[0])
    log.branches += len(branches) - 1
    if len(branches) == 1 and block == n:  # exactly `sd`'s draft
        log.tokens.append(len(head) + n)
        return canvas.draft(model, block_start, branches[0])[len(head) - 1 : len(head) - 1 + n][None]
    causal = min(max(0, block_start - canvas.cached), len(head))
    tokens, pattern, offsets = tree_layout(head, causal, branches, block)
    log.tokens.append(len(tokens))
    logits = model.forward(canvas.cache, tokens, pattern, offsets, keep=0)[0]
    own = len(head) - causal
    rows = causal + own - 1 + torch.arange(len(branches))[:, None] * (own + n) + torch.arange(n)  # token shift
    if own == 0:
        rows[:, 0] = causal - 1  # a window without its own head token is predicted by the last causal one
    return logits[rows.to(logits.device)]


def predictions(restricted: torch.Tensor, columns: list[int], tau: float) -> Verified:
    """`Verified` of slot-restricted logits (branches, len(columns), V), in one host transfer."""
    probs = torch.softmax(restricted, dim=-1)
    confidence, top = probs.max(dim=-1)
    entropy = torch.special.entr(probs).sum(dim=-1)
    host = torch.stack([top.to(probs.dtype), confidence, entropy]).cpu()
    return Verified(columns, host[0].long(), host[1], host[2], tau)


def filled(tokens: list[int], fills: list[Fill]) -> list[int]:
    branch = list(tokens)
    for i, token in fills:
        branch[i] = token
    return branch


@dataclass
class Window:
    """The committed branch over response positions [first, first + len(tokens)), its masks (window
    indices), their slot-restricted logits rows and top-1 predictions with probabilities."""

    first: int
    tokens: list[int]
    masked: list[int]
    rows: torch.Tensor
    top: list[int]
    confidence: list[float]


class BlockWalker:
    """`sd`'s loop over a canvas, block after block, with each step's drafts verified in the forward that
    also predicts for the next step. `route` proposes and chooses; `revealed` counts tokens committed in
    a block before its turn."""

    def __init__(
        self,
        model: BlockDiffusionModel,
        canvas: Canvas,
        block_of: BlockOf,
        tau: float,
        reveal: int,
        route: Route,
        fuse_write: bool = False,
    ) -> None:
        self.model, self.canvas, self.block_of = model, canvas, block_of
        self.tau, self.reveal, self.route, self.fuse_write = tau, reveal, route, fuse_write
        self.mask_id = canvas.scaffold.mask_id
        self.decided = list(canvas.ids)  # the template with every commitment written in, early ones too
        self.log = ForwardLog()
        self.revealed = 0

    def run(self) -> None:
        canvas = self.canvas
        while canvas.committed < len(canvas):
            start, end = self.block_of(canvas.committed)
            if canvas.cached == canvas.committed:
                self.seed(start)
            n, c = canvas.committed, canvas.cached
            drafted = self.mask_id in self.decided[n:end]
            if drafted:
                self.decode_block(start, end)
            canvas.ids[n:end] = self.decided[n:end]
            canvas.committed = end
            # A block with nothing to draft rides along with the next forward; so does a finished one whose
            # successor starts with a decided token (no AR seed to read), when the write is fused.
            if drafted and end < len(canvas) and not (self.fuse_write and self.decided[end] != self.mask_id):
                self.log.tokens.append(end - c)
                canvas.next_logits = self.model.verify(canvas.cache, canvas.ids[c:end])[-1]
                canvas.cached = end

    def seed(self, start: int) -> None:
        """The block's first token: the one committed early if any, else one AR step (as `sd`)."""
        canvas = self.canvas
        if self.decided[start] == self.mask_id:
            canvas.commit_seed(greedy)
            self.decided[start] = canvas.ids[start]
        else:
            canvas.ids[start] = self.decided[start]
            canvas.committed, canvas.next_logits = start + 1, None

    def decode_block(self, start: int, end: int) -> None:
        first = self.canvas.committed
        window = self.forward(start, end, first, [self.extended(first, end, self.decided[first:end])], NO_DRAFTS)
        while self.mask_id in window.tokens[: end - first]:
            window = self.step(start, end, window)
        self.decided[first : first + len(window.tokens)] = window.tokens

    def extended(self, first: int, end: int, tokens: list[int]) -> list[int]:
        """Eq. 4: the block's window, with the next block joined once at most `reveal` masks are left."""
        if first + len(tokens) == end < len(self.canvas) and tokens.count(self.mask_id) <= self.reveal:
            return tokens + self.decided[end : self.block_of(end)[1]]
        return tokens

    def step(self, start: int, end: int, window: Window) -> Window:
        """One step of Algorithm 1: the base branch, the route's drafts, one forward unless the base branch
        finishes the block."""
        first, mask_id = window.first, self.mask_id
        base = confident_positions(window.rows, self.tau)
        tokens = list(window.tokens)
        for k, token in base:
            tokens[window.masked[k]] = token
        if mask_id in tokens[: end - first]:
            in_base = {window.masked[k] for k, _ in base}
            proposal = self.route.propose(
                [
                    Candidate(i, t, p)
                    for i, t, p in zip(window.masked, window.top, window.confidence, strict=True)
                    if i not in in_base
                ]
            )
            tokens = self.extended(first, end, tokens)
            branches = [tokens] + [filled(tokens, fills) for fills in proposal.drafts]
            new = self.forward(start, end, first, branches, proposal)
        else:
            new = Window(first, tokens, [], window.rows[:0], [], [])
        committed = [i for i, t in enumerate(window.tokens) if t == mask_id and new.tokens[i] != mask_id]
        self.canvas.accepted_per_step.append(len(committed))
        self.revealed += sum(i >= end - first for i in committed)
        return new

    def forward(self, start: int, end: int, first: int, branches: list[list[int]], proposal: Proposal) -> Window:
        """One forward over the branches (the base first); the branch the route chooses as the new window."""
        logits = branch_logits(self.model, self.canvas, start, end - first, branches, self.log)
        columns = [i for i, t in enumerate(branches[0]) if t == self.mask_id]
        b, m, v = len(branches), len(columns), logits.shape[-1]
        positions = [first + i for i in columns] * b
        restricted = within_slots(logits[:, columns].reshape(b * m, v), positions, self.canvas.scaffold)
        restricted = restricted.view(b, m, v)
        result = predictions(restricted, columns, self.tau)
        chosen = self.route.choose(proposal, result)
        tokens = branches[chosen]
        keep = [k for k, i in enumerate(columns) if tokens[i] == self.mask_id]
        return Window(
            first,
            tokens,
            [columns[k] for k in keep],
            restricted[chosen, keep],
            result.top[chosen, keep].tolist(),
            result.confidence[chosen, keep].tolist(),
        )


def planning_ids(model: BlockDiffusionModel, vocabulary: str | Path | None) -> frozenset[int]:
    """The planning tokens of `vocabulary` (a file or folder), by default the one beside the model's weights,
    checked against the model's tokenizer."""
    if vocabulary is None:
        if model.source is None:
            raise PlanningVocabularyError(
                "this model was not loaded from a folder, so no planning vocabulary lies beside it; "
                "give vocabulary=PATH, or decode with planning=false"
            )
        vocabulary = vocabulary_path(model.source)
    read = read_vocabulary(vocabulary)
    tokenizer = model.tokenizer
    for token in read.tokens:
        here = tokenizer.decode([token.id]) if token.id < len(tokenizer) else None
        if here != token.text:
            raise PlanningVocabularyError(
                f"planning vocabulary {vocabulary} was calibrated for another tokenizer: token {token.id} is "
                f"{token.text!r} there and {here!r} here"
            )
    return read.ids


@torch.no_grad()
def pvf_decode(
    model: BlockDiffusionModel,
    prompt: PromptInputs,
    scaffold: Scaffold,
    *,
    tau: float = DEFAULT_TAU,
    width: int = DEFAULT_WIDTH,
    plan_low: float = DEFAULT_PLAN_BAND[0],
    plan_high: float = DEFAULT_PLAN_BAND[1],
    tau_ar: float = DEFAULT_TAU_AR,
    reveal: int = DEFAULT_REVEAL,
    planning: bool = True,
    fallback: bool = True,
    vocabulary: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    fuse_write: bool = DEFAULT_FUSE_WRITE,
) -> Decoded:
    """`pvf` (paper 001 Algorithm 1) over the scaffold's section-aligned blocks of `block_size`.

    tau: tau_high, the base branch's threshold (as `sd`'s tau). width: K, branches per forward with the base
    (1 with reveal 0 is `sd` exactly). plan_low, plan_high: the planning band [tau_plan^l, tau_plan^u).
    tau_ar: tau_AR^l, the fallback's confidence floor. reveal: N_s of early cross-block revelation (0: off).
    fuse_write: a finished block's write rides along the next block's first forward where it can.
    planning, fallback: switch a route off. vocabulary: the planning vocabulary file (default: the model
    folder's `pvf_vocabulary.json`; read only when planning is on and width > 1). Confidences and
    entropies are those of the slot-restricted distributions every MDM decoder here reads.

    Defaults: tau 0.9 and K = 4 as section 5.1; tau_AR 0.1 as Table 5's GSM8K rows; revelation off (see
    DEFAULT_REVEAL: with N_s 5 the merge scenes' waypoints went wrong), fused writes on. The planning band is
    Table 5's (0.8, 0.9) of HumanEval and MATH (see DEFAULT_PLAN_BAND).

    `extra`: decode forwards (the prefill not counted), drafts verified beside a base branch, tokens fed per
    forward (mean, max), steps, and per route the steps that verified drafts, the steps that committed one
    and the tokens committed; tokens revealed early; the size of the planning vocabulary.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if not 0.0 <= plan_low < plan_high <= 1.0:
        raise ValueError(f"the planning band needs 0 <= plan_low < plan_high <= 1, got [{plan_low}, {plan_high})")
    if not 0.0 <= tau_ar <= 1.0:
        raise ValueError(f"tau_ar must be in [0, 1], got {tau_ar}")
    if reveal < 0:
        raise ValueError(f"reveal must be >= 0, got {reveal}")
    plan_ids = planning_ids(model, vocabulary) if planning and width > 1 else frozenset()
    route = PlanVerifyFill(width, (plan_low, plan_high), tau_ar, plan_ids, fallback)
    canvas = Canvas.prefill(model, prompt, scaffold)
    walker = BlockWalker(model, canvas, section_blocks(scaffold, block_size), tau, reveal, route, fuse_write)
    walker.run()
    extra = {
        **walker.log.to_json(),
        "steps": len(canvas.accepted_per_step),
        **route.stats,
        "revealed_tokens": walker.revealed,
        "planning_vocabulary": len(plan_ids),
    }
    return Decoded(canvas.ids, canvas.accepted_per_step, extra)
