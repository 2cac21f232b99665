"""How the MDM head's predictions become tokens: kept inside each slot's vocabulary, and unmasked by
confidence threshold, the parallel step of every MDM decoder (paper 002 section 3.4)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastddrive.core.scaffold import Scaffold


def within_slots(logits: torch.Tensor, positions: Sequence[int], scaffold: Scaffold) -> torch.Tensor:
    """Logits (m, V) of response `positions` with every token their slot cannot hold there at -inf.

    Only MDM predictions are restricted: the AR head's (and so greedy `ar`, which the lossless decoders
    reproduce) stay as the model gives them.
    """
    index = torch.as_tensor(positions, dtype=torch.long, device=logits.device)
    allowed = scaffold.allowed_mask(logits.shape[-1], logits.device)[index]
    return logits.float().masked_fill(~allowed, float("-inf"))


def masked_rows(
    proposal: Sequence[int], logits: torch.Tensor, row_of_first: int, first: int, scaffold: Scaffold
) -> tuple[list[int], torch.Tensor]:
    """The masked indices of `proposal` (positions first, first + 1, ...) and their MDM logits restricted to
    their slots; proposal[i] is predicted by logits[row_of_first + i]."""
    masked = [i for i, token in enumerate(proposal) if token == scaffold.mask_id]
    rows = within_slots(logits[[row_of_first + i for i in masked]], [first + i for i in masked], scaffold)
    return masked, rows


def confident_positions(logits: torch.Tensor, tau: float) -> list[tuple[int, int]]:
    """For masked rows (m, V): (row, argmax token) of the rows to unmask, in one host transfer.

    A row is unmasked when its top probability exceeds `tau`; if none does, the single most confident
    one is (so tau = 1 unmasks one token per step and tau = 0 all of them at once).
    """
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau must be in [0, 1], got {tau}")
    confidence, tokens = torch.softmax(logits.float(), dim=-1).max(dim=-1)
    chosen = confidence > tau
    chosen[confidence.argmax()] = True  # at least one (the most confident is chosen whenever any is)
    return [(row, token) for row, token in enumerate(torch.where(chosen, tokens, -1).tolist()) if token >= 0]
