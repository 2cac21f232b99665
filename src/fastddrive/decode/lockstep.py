"""Rollouts in lockstep: rows of one cache verify guessed windows together, Jacobi-style (paper 003
section 2.1, with the sampled verifier of paper 000 section 3.4).

The rollouts of `tts` stand at the same position in rows of one cache. Each forward feeds every row its
committed tokens not yet cached and its guesses for the next `window` positions, causally, and the
verifier picks each row's token at every fed position given the guesses before it (`RowPicker`: one
uniform per position and seed, so a token is the same exact AR sample whichever forward computed its
logits). A row's guesses agree with its tokens up to its first mismatch (`acceptance.accept`). The rows
commit, together, up to the shortest agreement and the token after it: exact for every row by the rule's
invariant, since all its guesses before that token agreed. So the rows stay at one length, and every
forward takes the cache's plain path (one rope slice, one mask slice, in-place writes) where rows that
each commit their own agreement would need per-row masks and scattered writes.

The guesses past the commit become this forward's tokens there (the Jacobi update): a token that does
not depend on the mismatch before it, as most digits of a trajectory do not, is accepted by the next
forward. Every forward commits at least the first value in its window, so a window longer than the
longest scaffold run takes at most one forward per value, the forwards of jump-forward AR.

Invariant (as `Canvas`, and the same for every row): the cache holds response positions [0, cached),
cached <= committed; `iterates[r][p]` is row r's guess for position p >= committed (the template on the
scaffold).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastddrive.decode.acceptance import Accepted, accept
from fastddrive.decode.state import Canvas, RowPicker
from fastddrive.engine.masks import CAUSAL
from fastddrive.engine.model import BlockDiffusionModel

DEFAULT_WINDOW = 24  # on the embedded model's trajectories 16 and 32 took longer on a 2-core CPU (README)


def commit_rows(canvases: Sequence[Canvas], tokens: list[list[int]], agreed: int) -> None:
    """Every row commits its first `agreed` tokens and the one after them if it has one, all rows equally long
    (`Canvas.commit`); its cache keeps the `agreed`."""
    count = min(agreed + 1, len(tokens[0]))
    for canvas, row in zip(canvases, tokens, strict=True):
        canvas.accepted_per_step.append(canvas.commit(Accepted(agreed, row[:count])))


@torch.no_grad()
def lockstep_rollouts(
    model: BlockDiffusionModel,
    canvases: Sequence[Canvas],
    pick: RowPicker,
    window: int = DEFAULT_WINDOW,
    guesses: Sequence[Sequence[int]] | None = None,
) -> None:
    """Decode canvases that own one row each of one cache and stand at the same position to the end, one
    forward per step for all rows. Row r's iterate starts from guesses[r] (one id per response position;
    by default its canvas's ids: the template, |<MASK>| on values)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    lead, cache = canvases[0], canvases[0].cache
    length = len(lead)
    starts = [c.ids for c in canvases] if guesses is None else guesses
    iterates = [lead.forced(0, list(start)) for start in starts]  # the scaffold is its own guess
    if lead.cached == lead.committed < length:  # the rows' next logits predict `committed`: a step, no forward
        first, logits = lead.committed, torch.stack([c.next_logits for c in canvases])[:, None]
        commit_rows(canvases, [lead.forced(first, row) for row in pick(logits, first).tolist()], 0)
    while lead.committed < length:
        first, head = lead.committed, len(lead.head())
        end = min(first + window, length)  # guessed positions [first, end)
        fed = [c.head() + iterate[first:end] for c, iterate in zip(canvases, iterates, strict=True)]
        logits = model.forward(cache, fed, CAUSAL)  # row head - 1 + i predicts position first + i
        picked = min(end + 1, length) - first  # the guessed positions and the one after them
        rows = pick(logits[:, head - 1 : head - 1 + picked], first).tolist()
        tokens = [lead.forced(first, row) for row in rows]
        agreed = min(accept(iterate[first:end], row).agreed for row, iterate in zip(tokens, iterates, strict=True))
        commit_rows(canvases, tokens, agreed)
        count = lead.committed - first
        for row, iterate in zip(tokens, iterates, strict=True):  # the Jacobi update past the commit
            iterate[first + count : first + picked] = row[count:]
