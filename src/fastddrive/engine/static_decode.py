"""Fixed-shape decode forwards, replayed as CUDA graphs (gpt-fast's recipe, without torch.compile).

A decode forward of this tiny-batch regime costs what launching its kernels costs, not what reading the
weights costs. Here every decode forward is made one of a few shapes: the new tokens are padded to a
bucket size (padding sees only itself, nothing sees it, and it is never kept), attention reads the
whole preallocated cache under a mask built on the device from each row's length, and keys and values
are written with `index_copy_` at positions computed on the device. Each (rows, bucket) shape is then
captured once as a CUDA graph over a cache that lives as long as the model and replayed, so a forward
is one launch. On the CPU the same fixed-shape code runs without graphs, which is how tests compare it
with the eager path. Ids are the same either way; only summation order differs from the eager path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from fastddrive.engine.kv_cache import KVCache
from fastddrive.engine.masks import additive_mask, rows_mask

T = TypeVar("T")
BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)  # new tokens per row; a longer forward runs eagerly
CAPACITY_STEP = 512  # a static cache holds a multiple of this many positions per row (attention reads them all)


@dataclass
class Shape:
    """The static tensors of one (rows, bucket) forward: inputs written before each run, the output read
    after it, and the graph that reads and writes them (None on the CPU)."""

    ids: torch.Tensor  # (rows, bucket)
    lengths: torch.Tensor  # (rows,) cached positions per row before the forward
    positions: torch.Tensor  # (rows, bucket) rotary positions
    pattern: torch.Tensor  # (rows, bucket, bucket) who sees whom among the new tokens
    logits: torch.Tensor | None = None  # (rows, bucket, V)
    graph: torch.cuda.CUDAGraph | None = None
    # A prompt chunk's inputs instead of ids and positions: its embeddings (images in them) and mRoPE angles.
    embeds: torch.Tensor | None = None  # (rows, bucket, H)
    cos: torch.Tensor | None = None  # (rows * bucket, 1, head_dim)
    sin: torch.Tensor | None = None


def capture_graph(run: Callable[[], T], pool: tuple) -> tuple[torch.cuda.CUDAGraph, T]:
    """`run` (device ops on static tensors) warmed up on a side stream, then captured: the graph and what the
    captured call returned (the tensors each replay rewrites)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the graph (allocator, cuBLAS and cuDNN handles, compilation)
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    torch.cuda.synchronize()
    return graph, output


def _bucket(n: int) -> int:
    return next(b for b in BUCKETS if b >= n)


class StaticDecoder:
    """Runs `BlockDiffusionModel.forward` at fixed shapes over the model's persistent caches."""

    def __init__(self, model, graphs: bool) -> None:
        self.model = model
        self.graphs = graphs and model.device.type == "cuda"
        self.caches: dict[int, KVCache] = {}
        self.shapes: dict[tuple[int, int], Shape] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.capture_seconds = 0.0

    def cache(self, rows: int, rope_delta: int, needed: int) -> KVCache:
        """The persistent cache of `rows` rows, emptied, with room for `needed` positions and a bucket more.
        Graphs read its tensors, so it is replaced (and its shapes recaptured) only when too small."""
        capacity = -(-(needed + BUCKETS[-1]) // CAPACITY_STEP) * CAPACITY_STEP
        if rows not in self.caches or self.caches[rows].capacity < capacity:
            self.caches[rows] = self.model.empty_cache(capacity, rows)
            self.forget(rows)
        cache = self.caches[rows]
        cache.lengths = [0] * rows
        cache.rope_delta = rope_delta
        return cache

    def forget(self, rows: int | None = None) -> None:
        """Drop the captured shapes (of caches with `rows` rows, or all) after what they read was replaced."""
        self.shapes = {key: shape for key, shape in self.shapes.items() if rows is not None and key[0] != rows}

    def owns(self, cache: KVCache) -> bool:
        return self.caches.get(cache.rows) is cache

    def fits(self, cache: KVCache, n: int) -> bool:
        return self.owns(cache) and n <= BUCKETS[-1] and max(cache.lengths) + n <= cache.capacity - BUCKETS[-1]

    def forward(
        self, cache: KVCache, ids: torch.Tensor, patterns: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Logits (rows, n, V) of ids (rows, n) with per-row patterns (rows, n, n) and rotary positions
        (rows, n), all on the host; the cache's lengths are not moved (the caller keeps what it keeps)."""
        rows, n = ids.shape
        shape = self._shape(rows, _bucket(n), cache.capacity)
        padded_ids = torch.zeros(rows, shape.ids.shape[1], dtype=torch.long)
        padded_ids[:, :n] = ids
        padded_positions = torch.zeros(rows, shape.ids.shape[1], dtype=torch.long)
        padded_positions[:, :n] = positions
        padded_positions[:, n:] = positions[:, -1:]
        shape.ids.copy_(padded_ids, non_blocking=True)
        shape.positions.copy_(padded_positions, non_blocking=True)
        self._launch(cache, shape, patterns)
        return shape.logits[:, :n].clone()

    def prefill(self, cache: KVCache, embeds: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Feed a prompt (embeddings (L, H) on the device, images in them, and its mRoPE angles (L, 1, d))
        into a single-row cache in causal chunks of at most the largest bucket; advance the cache and
        return the logits of the prompt's last position (V,)."""
        cos, sin = rope
        for start in range(0, len(embeds), BUCKETS[-1]):
            chunk = slice(start, start + BUCKETS[-1])
            n = len(embeds[chunk])
            shape = self._shape(1, _bucket(n), cache.capacity, prompt=True)
            shape.embeds[0, :n] = embeds[chunk]
            shape.cos[:n], shape.sin[:n] = cos[chunk], sin[chunk]
            self._launch(cache, shape, torch.tril(torch.ones(1, n, n, dtype=torch.bool)))
            cache.advance(n)
        return shape.logits[0, n - 1].clone()

    def _launch(self, cache: KVCache, shape: Shape, patterns: torch.Tensor) -> None:
        """Run (or capture, then replay) `shape` after each row's cached prefix, its n real tokens seeing
        one another by `patterns` (rows, n, n); padding sees only itself."""
        rows, bucket = shape.ids.shape
        n = patterns.shape[-1]
        padded_pattern = torch.eye(bucket, dtype=torch.bool).repeat(rows, 1, 1)
        padded_pattern[:, :n, :n] = patterns
        shape.pattern.copy_(padded_pattern, non_blocking=True)
        shape.lengths.copy_(torch.tensor(cache.lengths), non_blocking=True)
        if self.graphs and shape.graph is None:
            # Captured with this forward's own inputs: the warm-up runs write the keys and values the
            # replay writes again, so capturing never leaves anything else in the cache.
            self._capture(cache, shape)
        if shape.graph is not None:
            shape.graph.replay()
        else:
            self._run(cache, shape)

    def _shape(self, rows: int, bucket: int, capacity: int, prompt: bool = False) -> Shape:
        key = (rows, bucket, prompt)
        if key not in self.shapes:
            model, device = self.model, self.model.device
            model.rope_table(2 * capacity)  # graphs index it: it must not be reallocated later
            shape = Shape(
                ids=torch.zeros(rows, bucket, dtype=torch.long, device=device),
                lengths=torch.zeros(rows, dtype=torch.long, device=device),
                positions=torch.zeros(rows, bucket, dtype=torch.long, device=device),
                pattern=torch.eye(bucket, dtype=torch.bool, device=device).repeat(rows, 1, 1),
            )
            if prompt:
                weights = model.decode_weights
                shape.embeds = torch.zeros(rows, bucket, weights.embed.shape[1], dtype=model.dtype, device=device)
                shape.cos = torch.ones(rows * bucket, 1, weights.head_dim, dtype=model.dtype, device=device)
                shape.sin = torch.zeros_like(shape.cos)
            self.shapes[key] = shape
        return self.shapes[key]

    def _capture(self, cache: KVCache, shape: Shape) -> None:
        began = time.perf_counter()
        shape.graph, _ = capture_graph(lambda: self._run(cache, shape), self.pool)
        self.capture_seconds += time.perf_counter() - began

    def _run(self, cache: KVCache, shape: Shape) -> None:
        """The forward itself, from the shape's static inputs to its static output; device ops only."""
        model = self.model
        rows, bucket = shape.ids.shape
        if shape.embeds is None:
            cos, sin = model.rope_table(2 * cache.capacity)
            flat = shape.positions.reshape(-1)
            embeds, rope = F.embedding(shape.ids.reshape(-1), model.decode_weights.embed), (cos[flat], sin[flat])
        else:
            embeds, rope = shape.embeds.view(rows * bucket, -1), (shape.cos, shape.sin)
        at = shape.lengths[:, None] + torch.arange(bucket, device=shape.ids.device)  # where the new tokens go
        # Additive once per forward: SDPA would turn a boolean mask into one in every layer (3 kernels).
        mask = additive_mask(rows_mask(shape.lengths, shape.pattern, cache.capacity)[:, 0], model.dtype)

        def store(layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return cache.write_at(layer, keys, values, at)

        hidden = model.layer_stack(embeds, rows, rope, store, mask, False)
        logits = model.head(hidden).view(rows, bucket, -1)
        if shape.logits is None:
            shape.logits = logits
        else:
            shape.logits.copy_(logits)
