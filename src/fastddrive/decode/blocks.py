"""How a decoder cuts the response into blocks: one description for all of them, `BlockOf`, a function
from the first undecided position to the [start, end) of the block that holds it.

Section-aligned blocks (paper 000 section 3.2) for the scaffold-aware decoders, a fixed grid for `mdm`
(paper 002 section 3.4), and Algorithm 1's sliding window for `selfspec` (paper 002).
"""

from __future__ import annotations

from collections.abc import Callable

from fastddrive.core.scaffold import Scaffold

BlockOf = Callable[[int], tuple[int, int]]  # first undecided position -> [start, end) of its block


def section_blocks(scaffold: Scaffold, block_size: int) -> BlockOf:
    """The section-aligned block holding a position: sections cut into blocks of at most `block_size`."""
    span = {}
    for block in scaffold.blocks(block_size):
        span |= dict.fromkeys(range(block.start, block.end), (block.start, block.end))
    return span.__getitem__


def grid_blocks(length: int, block_size: int) -> BlockOf:
    """Fixed-size blocks over the response, ignoring sections."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return lambda n: (n - n % block_size, min(n - n % block_size + block_size, length))


def sliding_window(length: int, block_size: int) -> BlockOf:
    """Algorithm 1's block: the last committed token and the next block_size - 1 positions."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    return lambda n: (n - 1, min(n - 1 + block_size, length))
