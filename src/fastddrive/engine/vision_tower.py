"""Qwen2.5-VL's vision tower at a fixed image grid: one device program, replayed as a CUDA graph.

The tower (Qwen2.5-VL report, section 2.1) patchifies the frame, runs its blocks with 2D RoPE and
attention inside windows (full attention in a few blocks), and merges 2 x 2 patches into one token for
the language model. transformers runs every window as its own attention call and reads the window
boundaries back to the host, so the 3B tower is hundreds of small launches that no CUDA graph can hold
(on an H100 it was most of the prefill). Here everything that depends only on the image grid (the
window order, RoPE angles, the block-diagonal masks) is computed once per grid, the windows are one
attention call under a mask, and the tower is captured once per grid (every frame of a camera shares
it) and replayed. Same weights, same arithmetic; a test keeps it equal to transformers'
`get_image_features`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastddrive.engine.static_decode import capture_graph


@dataclass(frozen=True)
class GridLayout:
    """What one image grid fixes: the order of the patches (windows contiguous), where each merged token
    goes back to, the RoPE angles in that order, and who attends to whom in window and full blocks."""

    order: torch.Tensor  # (merged units,) merge units in window order
    restore: torch.Tensor  # (merged units,) inverse of order
    cos: torch.Tensor  # (patches, head_dim)
    sin: torch.Tensor
    window_mask: torch.Tensor  # (1, 1, patches, patches) bool
    full_mask: torch.Tensor | None  # None when the patches are one image


def _positions(grid: list[list[int]], merge: int) -> torch.Tensor:
    """(patches, 2) row and column of every patch, merge blocks contiguous (as the model was trained)."""
    rows = []
    for t, h, w in grid:
        hpos = torch.arange(h)[:, None].expand(h, w).reshape(h // merge, merge, w // merge, merge)
        wpos = torch.arange(w)[None, :].expand(h, w).reshape(h // merge, merge, w // merge, merge)
        pair = torch.stack([hpos.transpose(1, 2).flatten(), wpos.transpose(1, 2).flatten()], dim=-1)
        rows.append(pair.repeat(t, 1))
    return torch.cat(rows)


def _windows(grid: list[list[int]], merge: int, units_per_window_side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge units in window order (each frame's windows row by row, units row by row inside) and the
    window of each unit in that order."""
    order, window_of, offset, window = [], [], 0, 0
    for t, h, w in grid:
        gh, gw, side = h // merge, w // merge, units_per_window_side
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = -gh % side, -gw % side
        padded = F.pad(index, (0, pw, 0, ph), value=-1)
        wh, ww = (gh + ph) // side, (gw + pw) // side
        padded = padded.reshape(t, wh, side, ww, side).permute(0, 1, 3, 2, 4).reshape(t * wh * ww, side * side)
        for units in padded:
            units = units[units >= 0]
            if len(units):
                order.append(units + offset)
                window_of.append(torch.full((len(units),), window))
                window += 1
        offset += t * gh * gw
    return torch.cat(order), torch.cat(window_of)


def grid_layout(visual: torch.nn.Module, grid: torch.Tensor, device: torch.device) -> GridLayout:
    """The layout of `grid` ((images, 3) temporal, height, width in patches) for tower `visual`."""
    config = visual.config
    merge = config.spatial_merge_size
    unit = merge * merge
    cells = grid.tolist()
    order, window_of = _windows(cells, merge, config.window_size // merge // config.patch_size)
    patch_order = (order[:, None] * unit + torch.arange(unit)).flatten()
    inv_freq = visual.rotary_pos_emb.inv_freq.float().cpu()
    angles = (_positions(cells, merge)[patch_order][..., None].float() * inv_freq).flatten(1)  # [rows, cols]
    angles = torch.cat([angles, angles], dim=-1)
    window = window_of.repeat_interleave(unit)
    frame_sizes = torch.tensor([h * w for t, h, w in cells for _ in range(t)])
    segment = torch.repeat_interleave(torch.arange(len(frame_sizes)), frame_sizes)[patch_order]  # full attention
    return GridLayout(
        order=order.to(device),
        restore=torch.argsort(order).to(device),
        cos=angles.cos().to(device),
        sin=angles.sin().to(device),
        window_mask=(window[:, None] == window[None, :])[None, None].to(device),
        full_mask=None if len(frame_sizes) == 1 else (segment[:, None] == segment[None, :])[None, None].to(device),
    )


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in float32, as the tower was trained."""
    half = x.shape[-1] // 2
    x32 = x.float()
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def _block(block: torch.nn.Module, hidden: torch.Tensor, layout: GridLayout, mask: torch.Tensor | None) -> torch.Tensor:
    attention = block.attn
    patches, heads = hidden.shape[0], attention.num_heads
    qkv = attention.qkv(_rms_norm(hidden, block.norm1)).view(patches, 3, heads, -1).permute(1, 2, 0, 3)
    cos, sin = layout.cos[None], layout.sin[None]
    q, k = _rotate(qkv[0], cos, sin), _rotate(qkv[1], cos, sin)
    attended = F.scaled_dot_product_attention(q[None], k[None], qkv[2][None], attn_mask=mask)
    hidden = hidden + attention.proj(attended[0].transpose(0, 1).reshape(patches, -1))
    mlp = block.mlp
    normed = _rms_norm(hidden, block.norm2)
    return hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(normed)) * mlp.up_proj(normed))


def vision_features(visual: torch.nn.Module, pixels: torch.Tensor, layout: GridLayout) -> torch.Tensor:
    """Merged image tokens (tokens, text hidden size) of the patches `pixels` (patches, C * T * P * P)."""
    unit = visual.config.spatial_merge_size**2
    hidden = visual.patch_embed(pixels)
    hidden = hidden.view(-1, unit, hidden.shape[-1])[layout.order].flatten(0, 1)
    full = set(visual.config.fullatt_block_indexes)
    for i, block in enumerate(visual.blocks):
        hidden = _block(block, hidden, layout, layout.full_mask if i in full else layout.window_mask)
    return visual.merger(hidden)[layout.restore]


class VisionTower:
    """`vision_features` per image grid, captured as a CUDA graph on a GPU (eager elsewhere)."""

    def __init__(self, visual: torch.nn.Module, device: torch.device, graphs: bool) -> None:
        self.visual = visual
        self.device = device
        self.graphs = graphs and device.type == "cuda"
        self.layouts: dict[tuple, GridLayout] = {}
        self.captured: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.cuda.CUDAGraph]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.capture_seconds = 0.0

    @torch.no_grad()
    def __call__(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        key = (tuple(map(tuple, grid.tolist())), tuple(pixels.shape))
        if key not in self.layouts:
            self.layouts[key] = grid_layout(self.visual, grid, self.device)
        if not self.graphs:
            return vision_features(self.visual, pixels.to(self.device), self.layouts[key])
        if key not in self.captured:
            self.captured[key] = self._capture(self.layouts[key], pixels)
        static_pixels, features, graph = self.captured[key]
        static_pixels.copy_(pixels, non_blocking=True)
        graph.replay()
        return features.clone()

    def _capture(
        self, layout: GridLayout, pixels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.CUDAGraph]:
        """The static input, the static output and the graph between them."""
        began = time.perf_counter()
        static_pixels = pixels.to(self.device)
        graph, features = capture_graph(lambda: vision_features(self.visual, static_pixels, layout), self.pool)
        self.capture_seconds += time.perf_counter() - began
        return static_pixels, features, graph
