"""The decoding KV cache: preallocated per-layer keys and values, written in place (gpt-fast style).

Every layer owns two tensors (rows, kv_heads, capacity, head_dim). A forward of n new tokens writes
their keys and values at each row's length and attends over the views [0, length + n): no
concatenation, no copy of what is already cached. `crop` only moves a length, so a draft that is
written and dropped costs nothing beyond its own n positions. Rows are independent sequences that
share the cache's layout (the rollouts of test-time scaling); `fork` makes them from one row's prefix.

Invariant: positions [0, lengths[r]) of row r hold the keys and values of the tokens fed to row r, in
order; everything after them is scratch that the next write overwrites.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

GROWTH = 256  # capacity is added in these steps when a write would overflow


class KVCache:
    """Keys and values of `rows` sequences for every layer, and each sequence's length.

    `rope_delta` is Qwen2.5-VL's mRoPE offset of text after the images: the token at cache index i sits
    at rotary position i + rope_delta.
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
        rows: int = 1,
        rope_delta: int = 0,
    ) -> None:
        shape = (rows, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.lengths = [0] * rows
        self.rope_delta = rope_delta

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def length(self) -> int:
        """The common length of all rows (the usual single-sequence case)."""
        if len(set(self.lengths)) != 1:
            raise ValueError(f"the rows of this cache have different lengths {self.lengths}")
        return self.lengths[0]

    def reserve(self, n: int) -> None:
        """Make room for n more positions in every row (reallocating only when full)."""
        needed = max(self.lengths) + n
        if needed <= self.capacity:
            return
        capacity = -(-needed // GROWTH) * GROWTH
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = old.new_zeros(old.shape[:2] + (capacity,) + old.shape[3:])
                new[:, :, : old.shape[2]] = old
                store[i] = new

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store (rows, kv_heads, n, head_dim) new keys and values after each row's length; return the
        layer's keys and values [0, max length + n) to attend over. Lengths move in `advance`."""
        n = keys.shape[2]
        k, v = self.keys[layer], self.values[layer]
        start = self.lengths[0]
        if all(length == start for length in self.lengths):
            k.narrow(2, start, n).copy_(keys)  # one view op where slicing [:, :, a:b] takes three
            v.narrow(2, start, n).copy_(values)
        else:  # rows at different lengths: one indexed write, row r at [lengths[r], lengths[r] + n)
            rows = torch.arange(self.rows, device=k.device)[:, None]
            at = torch.tensor(self.lengths, device=k.device)[:, None] + torch.arange(n, device=k.device)
            k[rows, :, at] = keys.transpose(1, 2)
            v[rows, :, at] = values.transpose(1, 2)
        end = max(self.lengths) + n
        return k.narrow(2, 0, end), v.narrow(2, 0, end)

    def write_at(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, at: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys and values of row r at positions at[r] (a device tensor, so that the write can be
        replayed in a CUDA graph); return the layer's whole buffers to attend over under a mask."""
        k, v = self.keys[layer], self.values[layer]
        for r in range(self.rows):
            k[r].index_copy_(1, at[r], keys[r])
            v[r].index_copy_(1, at[r], values[r])
        return k, v

    def advance(self, n: int | Sequence[int]) -> None:
        """Count n (or per row, n[r]) freshly written positions as cached."""
        steps = [n] * self.rows if isinstance(n, int) else list(n)
        self.lengths = [length + s for length, s in zip(self.lengths, steps, strict=True)]

    def crop(self, length: int, row: int | None = None) -> None:
        """Keep the first `length` positions of a row (all rows by default), as if the rest had never been
        fed. Nothing is copied."""
        for r in range(self.rows) if row is None else [row]:
            if not 0 <= length <= self.lengths[r]:
                raise ValueError(f"cannot crop a row of {self.lengths[r]} positions to {length}")
            self.lengths[r] = length

    def keep(self, start: int, indices: Sequence[int]) -> None:
        """Keep the first `start` positions and, of the ones after them, those at `indices` (in order).

        Used after a tree-shaped forward (paper 002 Algorithm 2), whose kept tokens are not contiguous.
        Single-row caches only.
        """
        length = self.length
        if not 0 <= start <= length or any(not 0 <= i < length - start for i in indices):
            raise ValueError(f"cannot keep {list(indices)} after {start} of {length} positions")
        index = torch.as_tensor(list(indices), dtype=torch.long, device=self.keys[0].device) + start
        for store in (self.keys, self.values):
            for tensor in store:
                tensor[:, :, start : start + len(indices)] = tensor.index_select(2, index)
        self.lengths = [start + len(indices)]

    def fork(self, rows: int, into: KVCache | None = None) -> KVCache:
        """A cache of `rows` sequences that each start with this single-row cache's content (written into
        `into` if given, a cache of `rows` rows whose capacity is at least this one's length).

        One batched cache, not `rows` deep copies: the prefix is broadcast into the rows once, and every
        later forward serves all rows at once.
        """
        if self.rows != 1:
            raise ValueError("only a single-row cache can be forked")
        length = self.length
        layers, (_, heads, _, dim) = len(self.keys), self.keys[0].shape
        forked = into or KVCache(
            layers, heads, dim, self.capacity, self.keys[0].dtype, self.keys[0].device, rows, self.rope_delta
        )
        forked.rope_delta = self.rope_delta
        for mine, theirs in ((self.keys, forked.keys), (self.values, forked.values)):
            for source, target in zip(mine, theirs, strict=True):
                target[:, :, :length] = source[:, :, :length]
        forked.lengths = [length] * rows
        return forked
