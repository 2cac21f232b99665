"""A decoder layer as its two halves around attention, compiled on a GPU so that each is a few kernels.

In the decode regime a forward of a 3B model is about 20 kernels a layer, and besides the four matrix
products most are tiny (the norms, the pieces of RoPE, a bias, SiLU and the gating product, copies);
each costs a launch and a tail even inside a CUDA graph (on an H100 they took about a quarter of a
one-token forward of the Qwen2.5-VL-3B shape). `torch.compile` (inductor, no CUDA graphs of its own:
`static_decode` captures its own) turns each half into its cuBLAS products plus one or two fused
kernels, as gpt-fast's compiled forward does. Attention and the cache write stay outside, where SDPA
picks its own kernel. On the CPU the same functions run eagerly, which is how the tests compare paths.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, doubled: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with weight w, given [w, w]. On the CPU as the LayerNorm of [x, -x] (zero mean, variance
    mean(x^2)): torch's CPU RMSNorm is several kernels (measured 34 against 16 us per call on a 2-core
    machine)."""
    size = x.shape[-1]
    if x.device.type != "cpu":
        return F.rms_norm(x, (size,), doubled[:size], eps)
    return F.layer_norm(torch.cat([x, -x], dim=-1), (2 * size,), doubled, None, eps)[..., :size]


def attention_inputs(
    hidden: torch.Tensor,
    norm: torch.Tensor,
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
    states (rows * n, H). Keys and values come contiguous, as the cache stores them (a strided source
    would cost the cache write a copy). RoPE as x cos + roll(x) sin' with the rotate-half sign folded
    into sin'."""
    tokens = hidden.shape[0]
    projected = F.linear(rms_norm(hidden, norm, eps), qkv, qkv_bias).view(tokens, heads + 2 * kv_heads, -1)
    qk = projected[:, : heads + kv_heads]
    qk = torch.addcmul(qk * cos, qk.roll(qk.shape[-1] // 2, -1), sin)
    dim = qk.shape[-1]
    q = qk[:, :heads].view(rows, tokens // rows, heads, dim).transpose(1, 2)
    k, v = qk[:, heads:], projected[:, heads + kv_heads :]
    k, v = (x.reshape(rows, tokens // rows, kv_heads, dim).transpose(1, 2).contiguous() for x in (k, v))
    return q, k, v


def attention_output_and_mlp(
    hidden: torch.Tensor,
    attended: torch.Tensor,
    out: torch.Tensor,
    mlp_norm: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    eps: float,
) -> torch.Tensor:
    """The rest of the layer: the output projection of attention (T, heads * d) added to the residual
    stream, then the gated MLP added to it."""
    hidden = torch.addmm(hidden, attended, out.t())
    gate, up = F.linear(rms_norm(hidden, mlp_norm, eps), gate_up).chunk(2, dim=-1)
    return torch.addmm(hidden, act(gate) * up, down.t())


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
