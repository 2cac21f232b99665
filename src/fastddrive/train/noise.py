"""Noise for block-diffusion training: block-size annealing, per-section Beta rates, complementary masks.

Paper 002 section 3.3 (annealing over {2, 4, ..., B}); paper 000 section 3.2 (section-adaptive Beta noise);
Fast-dLLM v2 complementary masking (every maskable token is masked in exactly one of two copies).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fastddrive.core.schema import SECTIONS


def annealed_block_size(progress: float, block_size: int, anneal: bool = True) -> int:
    """Active block size at training progress u in [0, 1]: S[min(floor(u |S|), |S| - 1)], S = {2, 4, ..., B}."""
    if not anneal:
        return block_size
    sizes = [2**i for i in range(1, int(np.log2(block_size)) + 1)]
    return sizes[min(int(progress * len(sizes)), len(sizes) - 1)]


def section_rates(rng: np.random.Generator, noise: Mapping[str, Sequence[float]]) -> np.ndarray:
    """One masking rate per section, t ~ Beta(a, b) of that section, in SECTIONS order."""
    return np.array([rng.beta(*noise[name]) for name in SECTIONS])


def complementary_masks(
    maskable: np.ndarray, rate: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Two masks over `maskable` positions: each masked with its position's `rate`, and the complement."""
    first = maskable & (rng.random(maskable.shape) < rate)
    return first, maskable & ~first
