"""The joint objective: alpha * section-weighted MDM loss + beta * causal LM loss (paper 000 Eq. 3-4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastddrive.train.collate import IGNORE


@dataclass
class LossParts:
    total: torch.Tensor
    noisy: torch.Tensor
    clean: torch.Tensor
    masked_tokens: int


def sasd_loss(
    noisy_logits: torch.Tensor,
    clean_logits: torch.Tensor,
    noisy_labels: torch.Tensor,
    noisy_weights: torch.Tensor,
    clean_labels: torch.Tensor,
    alpha: float,
    beta: float,
    clean_weights: torch.Tensor | None = None,
) -> LossParts:
    """Noisy CE at masked value positions scaled by section weight (mean over masked tokens), plus the
    clean stream's CE on the response's value tokens, scaled by `clean_weights` where given (mean over
    labelled tokens); for the AR recipe (no noisy copies) only the latter."""
    targets = clean_labels.flatten().to(clean_logits.device)
    per_clean = F.cross_entropy(clean_logits.flatten(0, -2).float(), targets, reduction="none", ignore_index=IGNORE)
    if clean_weights is not None:
        per_clean = per_clean * clean_weights.flatten().to(per_clean.device)
    clean = per_clean.sum() / (targets != IGNORE).sum().clamp(min=1)
    labels = noisy_labels.flatten().to(noisy_logits.device)
    masked = int((labels != IGNORE).sum())
    if masked == 0:
        zero = clean.new_zeros(())
        return LossParts(beta * clean if noisy_logits.numel() else clean, zero, clean, 0)
    per_token = F.cross_entropy(noisy_logits.flatten(0, -2).float(), labels, reduction="none", ignore_index=IGNORE)
    noisy = (per_token * noisy_weights.flatten().to(per_token.device)).sum() / masked
    return LossParts(alpha * noisy + beta * clean, noisy, clean, masked)
