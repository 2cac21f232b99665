"""The progressive noise schedule of Jacobi Forcing (paper 003 section 3.1, Eq. 7; Appendix C).

Block i of an answer (counted from 0, so that every window starts clean) gets the noise ratio
t_i = W[i mod w], W = {0, 1/w, ..., (w - 1)/w}; its noisy state is the iterate of its Jacobi trajectory
whose fraction of unconverged tokens (positions that differ from the fixed point) is closest to t_i.
Noise then grows within a window and every block keeps a partly clean context. Ratios are exact
fractions, so ties are ties: the earlier (noisier) iterate wins them.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction


def noise_ratios(blocks: int, window: int) -> list[Fraction]:
    """t_i of Eq. 7 for blocks i = 0 .. blocks - 1."""
    if window < 1:
        raise ValueError(f"the noise window must be >= 1, got {window}")
    return [Fraction(i % window, window) for i in range(blocks)]


def unconverged_fraction(iterate: Sequence[int], fixed: Sequence[int]) -> Fraction:
    """The share of positions where an iterate differs from its block's fixed point."""
    return Fraction(sum(a != b for a, b in zip(iterate, fixed, strict=True)), len(fixed))


def noisy_state(iterates: Sequence[Sequence[int]], ratio: Fraction) -> list[int]:
    """The iterate (first guess .. fixed point, the last) whose unconverged fraction is closest to `ratio`."""
    fixed = iterates[-1]
    return list(min(iterates, key=lambda iterate: abs(unconverged_fraction(iterate, fixed) - ratio)))


def noisy_blocks(blocks: Sequence[Sequence[Sequence[int]]], window: int) -> list[list[int]]:
    """The noisy state of every block of one trajectory under the schedule with window `window`."""
    return [noisy_state(states, t) for states, t in zip(blocks, noise_ratios(len(blocks), window), strict=True)]
