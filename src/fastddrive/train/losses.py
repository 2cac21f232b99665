"""Training objectives: SASD's alpha * section-weighted MDM loss + beta * causal LM loss (paper 000 Eq. 3-4),
and Jacobi Forcing's progressive consistency loss + w * causal LM loss (paper 003 Eq. 8-9)."""

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
    labelled: torch.Tensor | None = None  # the jf recipe's loss on the data's labelled answers, when it has one
    tokens: int = 0  # the positions the forward ran over (throughput)


def weighted_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None, count: int | None = None
) -> torch.Tensor:
    """Cross-entropy at labelled positions, scaled by `weights` where given, over the labelled count (or over
    `count`: a data-parallel step's labelled count over every process, `TokenCounts`)."""
    targets = labels.flatten().to(logits.device)
    per_token = F.cross_entropy(logits.flatten(0, -2).float(), targets, reduction="none", ignore_index=IGNORE)
    if weights is not None:
        per_token = per_token * weights.flatten().to(per_token.device)
    return per_token.sum() / (max(count, 1) if count is not None else (targets != IGNORE).sum().clamp(min=1))


@dataclass(frozen=True)
class TokenCounts:
    """The labelled tokens of a step's whole batch over every process: the clean stream's and the masked noisy
    ones. Each process divides its loss sums by these, so that the gradients its peers average are those of one
    process over the whole batch (each process's own mean would weigh a token by its process's share)."""

    clean: int
    masked: int


def sasd_loss(
    noisy_logits: torch.Tensor,
    clean_logits: torch.Tensor,
    noisy_labels: torch.Tensor,
    noisy_weights: torch.Tensor,
    clean_labels: torch.Tensor,
    alpha: float,
    beta: float,
    clean_weights: torch.Tensor | None = None,
    counts: TokenCounts | None = None,
) -> LossParts:
    """Noisy CE at masked value positions scaled by section weight (mean over masked tokens), plus the
    clean stream's CE on the response's value tokens, scaled by `clean_weights` where given (mean over
    labelled tokens); for the AR recipe (no noisy copies) only the latter. With `counts` the means are over the
    whole data-parallel batch's tokens (this process's part of them)."""
    clean = weighted_cross_entropy(clean_logits, clean_labels, clean_weights, counts.clean if counts else None)
    labels = noisy_labels.flatten().to(noisy_logits.device)
    masked = int((labels != IGNORE).sum())
    if (counts.masked if counts else masked) == 0:
        zero = clean.new_zeros(())
        return LossParts(beta * clean if noisy_logits.numel() else clean, zero, clean, 0)
    per_token = F.cross_entropy(noisy_logits.flatten(0, -2).float(), labels, reduction="none", ignore_index=IGNORE)
    noisy = (per_token * noisy_weights.flatten().to(per_token.device)).sum() / (counts.masked if counts else masked)
    return LossParts(alpha * noisy + beta * clean, noisy, clean, masked)


def consistency_loss(
    teacher_logits: torch.Tensor, student_logits: torch.Tensor, weights: torch.Tensor, blocks: int
) -> torch.Tensor:
    """Paper 003 Eq. 8: KL(p_teacher || p_student) per token pair, the teacher's side under stop-grad, averaged
    within each block by `weights` (1 / the block's pairs) and over the `blocks` blocks."""
    teacher = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    student = F.log_softmax(student_logits.float(), dim=-1)
    per_token = F.kl_div(student, teacher, reduction="none", log_target=True).sum(-1)
    return (per_token * weights.to(per_token.device)).sum() / max(blocks, 1)


def jacobi_forcing_loss(
    logits: torch.Tensor,
    teacher: torch.Tensor,
    student: torch.Tensor,
    pair_weights: torch.Tensor,
    blocks: int,
    labels: torch.Tensor,
    label_weights: torch.Tensor,
    ar_weight: float,
) -> LossParts:
    """Paper 003 Eq. 9 on packed logits (B, L, V): the progressive consistency loss between the clean
    (teacher) and noisy (student) positions given as flat indices into (B * L), plus `ar_weight` times the
    section-weighted causal LM loss of the clean stream. `noisy` holds the former, `clean` the latter."""
    flat = logits.flatten(0, 1)
    device = flat.device
    consistency = consistency_loss(flat[teacher.to(device)], flat[student.to(device)], pair_weights, blocks)
    ar = weighted_cross_entropy(logits, labels, label_weights)
    return LossParts(consistency + ar_weight * ar, consistency, ar, len(teacher))
