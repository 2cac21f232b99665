"""A decoder layer as its two halves around attention: few tensor ops on the CPU, few kernels on a GPU.

In the decode regime a forward of the embedded model on a CPU, or of a 3B model on a GPU, costs its
op dispatches (kernel launches), not its arithmetic. The halves therefore read weights laid out for
them (`model.DecodeWeights`): each RMSNorm weight folded into the matrix after it, every matrix stored
(in, out) so that a product is one `addmm`/`mm`, and on the CPU RoPE's rotate-half folded into extra q/k
columns of the qkv matrix. On a GPU `torch.compile` (inductor, no CUDA graphs of its own: `static_decode` captures
its own) turns each half into its cuBLAS products plus one or two fused kernels, as gpt-fast's compiled
forward does; attention and the cache write stay outside, where SDPA picks its own kernel. On the CPU
the same functions run eagerly, which is how the tests compare paths.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import rotate_half


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without its weight (folded into the next matrix). For one row on the CPU as the LayerNorm of
    [x, -x] (zero mean, variance mean(x^2)): one reduction kernel where torch's CPU RMSNorm runs several
    (one row: 20 against 26-30 us on a 2-core AMD machine, 8.7 against 9.9 on a 2-core Intel one); from
    a few rows on, the concatenation costs more than it saves (Intel: 12.3 against 10.4 us at 4 rows,
    22.4 against 11.7 at 33, 93.5 against 23.5 at 264)."""
    size = x.shape[-1]
    if x.device.type != "cpu" or x.numel() > size:
        return F.rms_norm(x, (size,), None, eps)
    return F.layer_norm(torch.cat([x, -x], dim=-1), (2 * size,), None, None, eps)[..., :size]


def attention_inputs(
    hidden: torch.Tensor,
    qkv: torch.Tensor,
    qkv_bias: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: int,
    heads: int,
    kv_heads: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries (rows, heads, n, d) and keys (rows, kv_heads, n, d) after RoPE, and values, of the hidden
    states (rows * n, H). `qkv` is (H, [q k v]) with the norm weight folded in, RoPE q cos +
    rotate_half(q) sin with cos and sin (rows, n, 1, d), or (n, 1, d) when the rows share positions; on
    the CPU `qkv` is (H, [q k v rot-q rot-k]) and the one product gives rotate_half(q) and rotate_half(k)
    too. Keys and values come contiguous, as the cache stores them (a strided source would cost the
    write a copy)."""
    n = hidden.shape[0] // rows
    projected = torch.addmm(qkv_bias, rms_norm(hidden, eps), qkv)
    dim = cos.shape[-1]
    width = (heads + kv_heads) * dim
    qk = projected[:, :width].view(rows, n, heads + kv_heads, dim)
    if projected.shape[1] > width + kv_heads * dim:
        rotated = projected[:, width + kv_heads * dim :].view(rows, n, heads + kv_heads, dim)
    else:
        rotated = rotate_half(qk)
    qk = torch.addcmul(qk * cos, rotated, sin)
    q = qk[:, :, :heads].transpose(1, 2)
    k = qk[:, :, heads:].transpose(1, 2).contiguous()
    v = projected[:, width : width + kv_heads * dim].view(rows, n, kv_heads, dim).transpose(1, 2).contiguous()
    return q, k, v


def attention_output_and_mlp(
    hidden: torch.Tensor,
    attended: torch.Tensor,
    out: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    eps: float,
) -> torch.Tensor:
    """The rest of the layer: the output projection of attention (T, heads * d) added to the residual
    stream, then the gated MLP (`gate_up` (H, [gate up]) with the norm weight folded in) added to it."""
    hidden = torch.addmm(hidden, attended, out)
    gate_up = torch.mm(rms_norm(hidden, eps), gate_up)
    width = gate_up.shape[-1] // 2
    return torch.addmm(hidden, act(gate_up[:, :width]) * gate_up[:, width:], down)


@cache
def _compiled(function: Callable) -> Callable:
    # Shapes specialise at first and turn dynamic in the token dimension when it changes (dynamo's
    # automatic dynamic shapes), so the buckets of the static path share one compilation.
    return torch.compile(function, fullgraph=True)


def layer_halves(device: torch.device) -> tuple[Callable, Callable]:
    """(attention_inputs, attention_output_and_mlp): compiled on a GPU, eager elsewhere."""
    if device.type != "cuda":
        return attention_inputs, attention_output_and_mlp
    return _compiled(attention_inputs), _compiled(attention_output_and_mlp)
