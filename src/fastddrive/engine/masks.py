"""Attention patterns: who sees whom among the tokens of one forward, and the masks handed to SDPA.

Paper 002 section 3 and Fig. 3 (Fast-dVLM): causal for the AR head, block-bidirectional for the MDM
head, N2N / N2C / C2C for dual-stream training. A decode forward feeds n new tokens after a cached
prefix; every new token sees the whole prefix, and `pattern[i, j]` says whether it sees new token j.
Plain cases take no mask at all (the kernel's own causal or full attention); the others are sliced
from a buffer kept per pattern, so a mask is built once per shape, not once per forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

CAUSAL = "causal"  # new tokens see the prefix and the new tokens up to themselves
FULL = "full"  # new tokens see the prefix and every new token (a draft block without a causal head)


@lru_cache(maxsize=256)
def block_mask(n: int, causal_head: int = 0) -> torch.Tensor:
    """Allowed attention (n, n) among n new tokens: the first `causal_head` causal (committed tokens), the
    rest one bidirectional block that also sees them. causal_head = n is plain causal attention.
    Cached: treat the result as read-only."""
    allowed = torch.ones(n, n, dtype=torch.bool)
    allowed[:causal_head] = allowed[:causal_head].tril()
    return allowed


def as_pattern(pattern: torch.Tensor | str, n: int) -> torch.Tensor:
    """The (n, n) tensor of CAUSAL, FULL or a tensor pattern."""
    if isinstance(pattern, torch.Tensor):
        return pattern
    if pattern not in (CAUSAL, FULL):
        raise ValueError(f"unknown attention pattern {pattern!r}")
    return block_mask(n, n if pattern == CAUSAL else 0)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean (B, Q, K) -> float (B, 1, Q, K): 0 where allowed, the dtype's minimum elsewhere."""
    blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    blocked.masked_fill_(~allowed, torch.finfo(dtype).min)
    return blocked[:, None]


def dual_stream_mask(
    clean_lengths: torch.Tensor, response_start: torch.Tensor, block_start: torch.Tensor
) -> torch.Tensor:
    """Allowed-attention (B, L, L) for `[noisy stream 1 ; ... ; noisy stream k ; clean]` (paper 002 Fig. 3).

    clean_lengths (B,): real clean tokens; response_start (B,): clean index of the first response
    token; block_start (B, k, R): for noisy stream r at response offset i, the response offset where its
    block starts (-1 for padding). N2N: a noisy token sees its own block in its own stream; N2C: it sees
    clean tokens strictly before its block; C2C: clean tokens are causal. Padding sees only itself.
    """
    batch, k, r = block_start.shape
    lc, ln = int(clean_lengths.max()), k * r
    clean_index = torch.arange(lc)
    real_clean = clean_index[None, :] < clean_lengths[:, None]  # (B, Lc)
    starts = block_start.reshape(batch, ln)
    valid = starts >= 0
    stream = torch.arange(k).repeat_interleave(r)
    allowed = torch.zeros(batch, ln + lc, ln + lc, dtype=torch.bool)
    allowed[:, :ln, :ln] = (
        (stream[:, None] == stream[None, :])[None]
        & (starts[:, :, None] == starts[:, None, :])
        & valid[:, :, None]
        & valid[:, None, :]
    )
    block_begins = (response_start[:, None] + starts)[:, :, None]  # clean index where each noisy block starts
    allowed[:, :ln, ln:] = (clean_index[None, None, :] < block_begins) & valid[:, :, None] & real_clean[:, None, :]
    causal = clean_index[:, None] >= clean_index[None, :]
    allowed[:, ln:, ln:] = causal[None] & real_clean[:, None, :] & real_clean[:, :, None]
    allowed |= torch.eye(ln + lc, dtype=torch.bool)[None]  # padding rows must not be empty
    return allowed


class DecodeMasks:
    """Additive SDPA masks (0 where allowed, the dtype's minimum elsewhere) for decode forwards, sliced from
    one buffer per pattern. Additive, because SDPA turns a boolean mask into one on every call.

    The buffer of an (n, n) pattern allows [ones (n, P) | pattern | zeros (n, P)]; the mask of a row whose
    cache holds L positions, over keys [0, K), is its columns [P - L, P - L + K): the prefix all visible,
    the new tokens by the pattern, anything past them hidden.
    """

    def __init__(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
        self.device = device
        self.dtype = dtype
        self.prefix = 0
        self._buffers: dict[tuple[int, bytes], torch.Tensor] = {}

    def _buffer(self, pattern: torch.Tensor, prefix: int) -> torch.Tensor:
        if prefix > self.prefix:  # longer prefixes than any before: start over with room to spare
            self.prefix = 2 * prefix
            self._buffers.clear()
        n = pattern.shape[0]
        key = (n, pattern.numpy().tobytes())
        if key not in self._buffers:
            ones = torch.ones(n, self.prefix, dtype=torch.bool)
            zeros = torch.zeros(n, self.prefix, dtype=torch.bool)
            allowed = torch.cat([ones, pattern, zeros], dim=1)
            self._buffers[key] = additive_mask(allowed[None], self.dtype)[0, 0].to(self.device)
        return self._buffers[key]

    def mask(
        self, lengths: list[int], n: int, pattern: torch.Tensor | str | Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor | None, bool]:
        """(mask, is_causal) for SDPA: n new tokens after rows holding `lengths` cached positions, seeing one
        another by `pattern` (CAUSAL, FULL, a boolean (n, n) tensor, or one such tensor per row). No mask
        where the kernel's own full or causal attention is exact: equal rows with FULL, one causal token,
        or a causal prefill."""
        same = len(set(lengths)) == 1
        if isinstance(pattern, str):
            if pattern not in (CAUSAL, FULL):
                raise ValueError(f"unknown attention pattern {pattern!r}")
            if same and (pattern == FULL or n == 1):
                return None, False
            if same and lengths[0] == 0:
                return None, True
            pattern = block_mask(n, n if pattern == CAUSAL else 0)
        if isinstance(pattern, torch.Tensor) and same:
            if pattern.shape != (n, n):
                raise ValueError(f"a pattern for {n} new tokens must be ({n}, {n}), got {tuple(pattern.shape)}")
            longest = lengths[0]
            buffer = self._buffer(pattern, longest)
            return buffer[:, self.prefix - longest : self.prefix + n], False
        return self._per_row(lengths, n, pattern), False

    def _per_row(self, lengths: list[int], n: int, pattern: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """(rows, 1, n, max length + n): each row its own prefix and pattern (rollouts at different lengths)."""
        patterns = pattern[None] if isinstance(pattern, torch.Tensor) else torch.stack(list(pattern))
        if patterns.shape[1:] != (n, n) or len(patterns) not in (1, len(lengths)):
            raise ValueError(f"need one ({n}, {n}) pattern, or one per row for {len(lengths)} rows")
        patterns = patterns.expand(len(lengths), n, n)
        allowed = rows_mask(torch.tensor(lengths), patterns, max(lengths) + n)
        return additive_mask(allowed[:, 0], self.dtype).to(self.device)


def rows_mask(lengths: torch.Tensor, patterns: torch.Tensor, keys: int) -> torch.Tensor:
    """Allowed attention (rows, 1, n, keys) of n new tokens per row written after each row's `lengths`
    cached positions: the prefix visible, new token j by patterns[row, :, j], anything later hidden.
    Device ops only, so it can run inside a CUDA graph."""
    n = patterns.shape[-1]
    new = torch.arange(keys, device=lengths.device)[None] - lengths[:, None]  # key index relative to the new tokens
    inside = (new >= 0) & (new < n)
    seen = torch.gather(patterns, 2, new.clamp(0, n - 1)[:, None].expand(-1, n, -1))
    return ((new < 0)[:, None] | (inside[:, None] & seen))[:, None]
