"""BlockDiffusionModel: one set of weights, a causal (AR) mode and a block-bidirectional (MDM) mode.

Paper 002 section 3 (Fast-dVLM), DESIGN section 5. The wrapper only runs forwards: `prefill` a prompt,
`forward` new tokens after the cached prefix under an attention pattern (`verify`: causal, the cache
keeps them; `draft`: a bidirectional block, the cache does not), and the training-time dual-stream
forward `[noisy streams ; clean sequence]`. Token shift: the logits at position i predict the token at
i + 1 in both modes. It knows nothing about JSON.

Decode forwards run the transformers model's own weights through a short loop written here, as
gpt-fast does: embeddings, then per layer RMSNorm, q/k/v, RoPE, the in-place cache write, SDPA, MLP;
then the head. That keeps Python and allocation overhead to a few tensor ops per layer, lets the
cache be preallocated (`kv_cache.KVCache`) and hands SDPA no mask where its own causal or full
attention is exact (`masks.DecodeMasks`). Training and the no-cache full-sequence forward use the
transformers forward itself; a test keeps the two equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)
from transformers.image_utils import SizeDict
from transformers.models.qwen2.modeling_qwen2 import rotate_half

from fastddrive.core.sample import check_pixel_range
from fastddrive.engine.kv_cache import KVCache
from fastddrive.engine.layer_halves import layer_halves, rms_norm
from fastddrive.engine.masks import CAUSAL, FULL, DecodeMasks, additive_mask, as_pattern, block_mask, dual_stream_mask
from fastddrive.engine.static_decode import BUCKETS, StaticDecoder
from fastddrive.engine.vision_tower import VisionTower

IMAGE_TOKEN = "<|image_pad|>"
RESPONSE_ROOM = 512  # cache positions reserved after the prompt at prefill (more are added when needed)

Pattern = torch.Tensor | str  # masks.CAUSAL, masks.FULL or an (n, n) boolean tensor


@dataclass
class CheckpointInfo:
    """What fastddrive records beside the transformers files of a checkpoint it trained."""

    kind: str = "block-diffusion"  # or "autoregressive" (the AR baseline: no diffusion training)
    mask_token_id: int | None = None
    null_token_id: int | None = None
    explanation_budget: int | None = None
    block_size: int | None = None
    scaffold_tokenization: str = "pieces"  # its scaffold layout: "pieces", "runs" or "release" (core/scaffold.py)
    extra: dict[str, Any] = field(default_factory=dict)
    # The camera layout: [] = "joined" (the cameras side by side in one frame, or one camera); names = "separate"
    # (one image per camera, in this order: the official release's FRONT_LEFT, FRONT, FRONT_RIGHT).
    cameras: list[str] = field(default_factory=list)
    # The prompt: "fastddrive" (core/prompt.py) or "release" (the official release's, core/release_prompt.py).
    prompt: str = "fastddrive"


# What a frame may be resized to (`set_image_pixels`): one merged patch at least; at most 16 MP, 20,000 image tokens.
MIN_IMAGE_PIXELS = 28 * 28
MAX_RESIZED_PIXELS = 4096 * 4096


@dataclass
class PromptInputs:
    """A tokenized prompt: ids (1, L) with image tokens expanded, and the pixels they stand for."""

    input_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights laid out for `layer_halves` (copies: the transformers parameters stay
    as they are). Matrices are (in, out); the RMSNorm weights are folded into the matrices after them; on
    the CPU qkv also carries rotate_half of the q and k projections as extra columns (RoPE without the
    ops of a rotation; on a GPU the compiled half fuses the rotation, and the extra columns would be
    bytes read per forward)."""

    qkv: torch.Tensor  # (H, [q k v]), on the CPU (H, [q k v rot-q rot-k])
    qkv_bias: torch.Tensor
    out: torch.Tensor  # (heads * d, H)
    gate_up: torch.Tensor  # (H, [gate up])
    down: torch.Tensor  # (I, H)
    act: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DecodeWeights:
    """The text decoder's weights for the decode forward, with the parameter versions they were read at."""

    layers: tuple[LayerWeights, ...]
    embed: torch.Tensor
    head: torch.Tensor  # (H, V), the final norm's weight folded in
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    version: tuple[tuple[int, int], ...]

    @classmethod
    def of(
        cls, text_model: torch.nn.Module, lm_head: torch.nn.Module, version: tuple, rotation_columns: bool | None = None
    ) -> DecodeWeights:
        """The layout of `text_model`'s weights; `rotation_columns` defaults to whether they are on the CPU."""
        config = text_model.config
        first = text_model.layers[0].self_attn
        heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, first.head_dim
        if rotation_columns is None:
            rotation_columns = text_model.embed_tokens.weight.device.type == "cpu"
        layers = []
        for layer in text_model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            q, k, v = (p.weight.detach() for p in (attention.q_proj, attention.k_proj, attention.v_proj))
            qb, kb, vb = (p.bias.detach() for p in (attention.q_proj, attention.k_proj, attention.v_proj))
            qkv, qkv_bias = torch.cat([q, k, v]), torch.cat([qb, kb, vb])
            if rotation_columns:
                qkv = torch.cat([qkv, _rotated(q, heads), _rotated(k, kv_heads)])
                qkv_bias = torch.cat([qkv_bias, _rotated(qb, heads), _rotated(kb, kv_heads)])
            gate_up = torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()])
            layers.append(
                LayerWeights(
                    qkv=_folded(qkv, layer.input_layernorm),
                    qkv_bias=qkv_bias,
                    out=attention.o_proj.weight.detach().t().contiguous(),
                    gate_up=_folded(gate_up, layer.post_attention_layernorm),
                    down=mlp.down_proj.weight.detach().t().contiguous(),
                    act=F.silu if config.hidden_act == "silu" else mlp.act_fn,  # no Module call
                )
            )
        return cls(
            layers=tuple(layers),
            embed=text_model.embed_tokens.weight.detach(),
            head=_folded(lm_head.weight.detach(), text_model.norm),
            eps=text_model.norm.variance_epsilon,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=dim,
            scaling=first.scaling,
            version=version,
        )


def _folded(weight: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """(in, out) matrix of the (out, in) `weight` applied after RMSNorm `norm`: norm(x) @ W.T is
    rms(x) @ (W * norm.weight).T."""
    return (weight * norm.weight.detach()).t().contiguous()


def _rotated(projection: torch.Tensor, heads: int) -> torch.Tensor:
    """The rows (or bias) of a q or k projection that give rotate_half of its output, head by head. Exact
    (a signed permutation of the rows)."""
    rows = projection.reshape(heads, projection.shape[0] // heads, -1).transpose(1, 2)  # (heads, in, d)
    return rotate_half(rows).transpose(1, 2).reshape(projection.shape)


class BlockDiffusionModel:
    """A transformers Qwen2.5-VL (or text-only Qwen2) with the operations the decoders and trainer use."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        image_processor: Qwen2VLImageProcessorPil | None = None,
        info: CheckpointInfo | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.info = info or CheckpointInfo()
        self.is_vision = isinstance(model, Qwen2_5_VLForConditionalGeneration)
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) if self.is_vision else None
        # Called after every forward with the tokens it carried (NFE and tokens-per-forward counting).
        self.forward_hooks: list[Callable[[int], None]] = []
        self._masks: DecodeMasks | None = None
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.decode_weights: DecodeWeights | None = None
        self.static: StaticDecoder | None = None  # fixed-shape forwards (CUDA graphs on a GPU), or eager
        self.vision: VisionTower | None = None  # the vision tower at fixed grids (CUDA graphs on a GPU)
        self.source: Path | None = None  # the folder it was loaded from (files kept beside the weights)

    @property
    def core(self) -> PreTrainedModel:
        """The transformers model itself, unwrapped from any distributed wrapper."""
        return getattr(self.model, "module", self.model)

    @property
    def text_model(self) -> torch.nn.Module:
        """The decoder stack (embeddings, layers, final norm, rotary embedding) without the head."""
        return self.core.model.language_model if self.is_vision else self.core.model

    @property
    def device(self) -> torch.device:
        # The embedding table, not next(parameters()): that walks every module on each call.
        return self.text_model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.text_model.embed_tokens.weight.dtype

    def use_static_shapes(self, graphs: bool = True) -> None:
        """Run decode forwards at fixed shapes over persistent caches, replayed as CUDA graphs on a GPU
        (`static_decode`), and the vision tower one image grid at a time (`vision_tower`); prompts or
        forwards that do not fit run eagerly."""
        self.static = StaticDecoder(self, graphs)
        if self.is_vision:
            self.vision = VisionTower(self.core.model.visual, self.device, graphs)

    def on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every tensor the model reads passes through here, onto the model's device."""
        return tensor.to(self.device, non_blocking=True)

    # ----------------------------------------------------------------- prompts and positions
    def encode_prompt(self, text: str, images: Sequence[np.ndarray] = ()) -> PromptInputs:
        """Tokenize a chat prompt; each <|image_pad|> becomes as many tokens as its image has merged patches."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        pixel_values = grid = None
        if images:
            if not self.is_vision:
                raise ValueError("this is a text-only model; it cannot take images")
            processed = self.image_processor(images=[Image.fromarray(im) for im in images], return_tensors="pt")
            pixel_values, grid = processed["pixel_values"], processed["image_grid_thw"]
            counts = (grid.prod(-1) // self.image_processor.merge_size**2).tolist()
            if ids.count(self.image_token_id) != len(counts):
                raise ValueError(
                    f"the prompt has {ids.count(self.image_token_id)} image slots for {len(counts)} images"
                )
            expanded: list[int] = []
            for token in ids:
                expanded += [token] * counts.pop(0) if token == self.image_token_id else [token]
            ids = expanded
        return PromptInputs(torch.tensor([ids], dtype=torch.long), pixel_values, grid)

    def set_image_pixels(self, min_pixels: int | None = None, max_pixels: int | None = None) -> None:
        """Resize camera frames to between `min_pixels` and `max_pixels` (Qwen2.5-VL's `smart_resize`, sides
        multiples of 28 px) instead of the model folder's processor settings; None keeps the folder's. Saved
        with the model. ValueError for a range that is empty or outside [MIN_IMAGE_PIXELS, MAX_RESIZED_PIXELS]."""
        if self.image_processor is None:
            raise ValueError("this is a text-only model: it has no image processor to set")
        low = self.image_processor.size["shortest_edge"] if min_pixels is None else min_pixels
        high = self.image_processor.size["longest_edge"] if max_pixels is None else max_pixels
        for name, value in (("min_pixels", low), ("max_pixels", high)):
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not MIN_IMAGE_PIXELS <= value <= MAX_RESIZED_PIXELS
            ):
                raise ValueError(
                    f"image {name} must be an integer in [{MIN_IMAGE_PIXELS}, {MAX_RESIZED_PIXELS}], got {value!r}"
                )
        check_pixel_range(low, high)
        self.image_processor.size = SizeDict(shortest_edge=low, longest_edge=high)

    def image_sizes_px(self, prompt: PromptInputs) -> list[tuple[int, int]]:
        """The (width, height) in px each image of `prompt` was resized to (its patch grid times the patch)."""
        if prompt.image_grid_thw is None:
            return []
        patch = self.image_processor.patch_size
        return [(int(w) * patch, int(h) * patch) for _, h, w in prompt.image_grid_thw.tolist()]

    def _rope_positions(self, input_ids: torch.Tensor, grid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of a whole sequence (3, B, L) for Qwen2.5-VL, (B, L) for Qwen2; and the text offsets (B,)."""
        batch, length = input_ids.shape
        if not self.is_vision:
            return torch.arange(length).expand(batch, -1), torch.zeros(batch, dtype=torch.long)
        token_type = (input_ids == self.image_token_id).int()
        if grid is None or not token_type.any():
            positions = torch.arange(length).expand(3, batch, -1)
            return positions, torch.zeros(batch, dtype=torch.long)
        positions, deltas = self.core.model.get_rope_index(input_ids, mm_token_type_ids=token_type, image_grid_thw=grid)
        return positions, deltas.reshape(-1)

    def _vision_kwargs(self, prompt: PromptInputs) -> dict[str, torch.Tensor]:
        if prompt.pixel_values is None:
            return {}
        return {
            "pixel_values": self.on_device(prompt.pixel_values),
            "image_grid_thw": self.on_device(prompt.image_grid_thw),
        }

    # ----------------------------------------------------------------- the decode forward
    def _refresh_weights(self) -> DecodeWeights:
        """The decode forward's view of the weights, rebuilt (at each prefill) when a parameter was changed
        or replaced since it was made, as training does between validations; the decode masks are made
        again with it, in the weights' dtype and on their device."""
        version = tuple((p.data_ptr(), p._version) for p in self.text_model.parameters())
        if self.decode_weights is None or self.decode_weights.version != version:
            self.decode_weights = DecodeWeights.of(self.text_model, self.core.lm_head, version)
            self._masks = DecodeMasks(self.device, self.dtype)
        return self.decode_weights

    def rope_table(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (P, 1, head_dim) of text positions 0..P-1, P >= size: made once by the
        model's own rotary embedding (text positions are equal on mRoPE's three axes) and grown by
        doubling."""
        if self._rope_table is None or self._rope_table[0].shape[0] < size:
            size = max(size, 2 * RESPONSE_ROOM, 2 * (self._rope_table[0].shape[0] if self._rope_table else 0))
            table = torch.arange(size, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = self.text_model.rotary_emb(probe, table.expand(3, 1, -1) if self.is_vision else table)
            self._rope_table = (cos[0][:, None], sin[0][:, None])
            if self.static is not None:
                self.static.forget()  # captured graphs read the old table
        return self._rope_table

    def _rope(self, first: int, last: int, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the rope table: positions [first, last) when `positions` is None, else `positions` (T,)."""
        cos, sin = self.rope_table(last)
        if positions is None:
            return cos[first:last], sin[first:last]
        return cos[positions], sin[positions]

    def layer_stack(
        self,
        hidden: torch.Tensor,
        rows: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        store: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        mask: Any,
        is_causal: bool,
    ) -> torch.Tensor:
        """The decoder layers over the new tokens' hidden states (rows * n, H) at rotary angles `rope` (cos
        and sin, (rows * n, 1, d), or (n, 1, d) shared by the rows); `store(layer, keys, values)` writes
        their keys and values into the cache and returns what to attend over; the halves around attention
        are `layer_halves` (compiled on a GPU)."""
        weights = self.decode_weights
        attention_inputs, attention_output_and_mlp = layer_halves(hidden.device)
        cos, sin = rope
        tokens = hidden.shape[0]
        n = tokens // rows
        heads, kv_heads, dim, eps = weights.heads, weights.kv_heads, weights.head_dim, weights.eps
        if rows > 1 and cos.shape[0] == tokens:  # a position per token: (rows, n, 1, d)
            cos, sin = cos.view(rows, n, 1, dim), sin.view(rows, n, 1, dim)
        # Where every query sees every key (no mask, not causal), the queries sharing a key head are one
        # (rows, kv_heads, group * n, d) attention: no GQA expansion in the kernel (half its time on the CPU).
        group = heads // kv_heads if mask is None and not is_causal else 1
        for i, layer in enumerate(weights.layers):
            q, k, v = attention_inputs(hidden, layer.qkv, layer.qkv_bias, cos, sin, rows, heads, kv_heads, eps)
            keys, values = store(i, k, v)
            if group > 1:
                attended = F.scaled_dot_product_attention(
                    q.reshape(rows, kv_heads, group * n, dim), keys, values, scale=weights.scaling
                ).reshape(rows, heads, n, dim)  # CUDA's kernels may return it laid out (rows, group * n, kv_heads, d)
            else:
                attended = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, is_causal=is_causal, scale=weights.scaling, enable_gqa=True
                )
            hidden = attention_output_and_mlp(
                hidden,
                attended.transpose(1, 2).reshape(tokens, heads * dim),
                layer.out,
                layer.gate_up,
                layer.down,
                layer.act,
                eps,
            )
        return hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: logits of hidden states."""
        weights = self.decode_weights
        return torch.mm(rms_norm(hidden, weights.eps), weights.head)

    def _forwarded(self, tokens: int) -> None:
        for hook in self.forward_hooks:
            hook(tokens)

    @torch.no_grad()
    def prefill(self, prompt: PromptInputs, room: int = RESPONSE_ROOM) -> tuple[torch.Tensor, KVCache]:
        """Run the prompt causally; return the logits of its last position (V,) and a cache holding it, with
        `room` more positions preallocated."""
        self._refresh_weights()
        ids = self.on_device(prompt.input_ids)
        positions, deltas = self._rope_positions(prompt.input_ids, prompt.image_grid_thw)
        embeds = self.text_model.embed_tokens(ids)
        if prompt.pixel_values is not None:
            if self.vision is not None:
                image = self.vision(prompt.pixel_values, prompt.image_grid_thw).to(embeds.dtype)
            else:
                vision = self._vision_kwargs(prompt)
                features = self.core.model.get_image_features(vision["pixel_values"], vision["image_grid_thw"])
                image = torch.cat(list(features.pooler_output)).to(embeds.dtype)
            embeds = embeds.masked_scatter((ids == self.image_token_id)[..., None], image)
        n = ids.shape[1]
        if self.static is not None:
            cache = self.static.cache(1, int(deltas[0]), n + room)
        else:
            cache = self.empty_cache(n + room, rope_delta=int(deltas[0]))
        cos, sin = self.text_model.rotary_emb(embeds, self.on_device(positions))
        rope = (cos[0][:, None], sin[0][:, None])
        if self.static is not None:  # its cache, made above
            logits = self.static.prefill(cache, embeds[0], rope)
        else:
            hidden = self.layer_stack(embeds[0], 1, rope, cache.write, None, is_causal=True)
            cache.advance(n)
            logits = self.head(hidden[-1:])[0]
        self._forwarded(n)
        return logits, cache

    @torch.no_grad()
    def forward(
        self,
        cache: KVCache,
        ids: torch.Tensor | Sequence[int],
        pattern: Pattern | Sequence[torch.Tensor] = CAUSAL,
        offsets: torch.Tensor | None = None,
        keep: int | Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Logits (rows, n, V) of n new tokens per cache row (ids (rows, n), or (n,) for one row) after each
        row's cached prefix. Token j of row r sits at rotary position lengths[r] + offsets[.., j] (offsets
        (n,) or (rows, n), default 0..n-1) and sees the row's whole prefix and the new tokens its pattern
        allows (one for all rows, or one (n, n) tensor per row). The cache then holds the first `keep`
        new tokens of each row (all by default; 0 for a draft, or one count per row)."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(cache.rows, -1)
        n = ids.shape[1]
        if self.static is not None and self.static.fits(cache, n):
            return self._static_forward(cache, ids.cpu(), pattern, offsets, keep)
        ids = self.on_device(ids)
        mask, is_causal = self._masks.mask(cache.lengths, n, pattern)
        capacity = cache.capacity
        cache.reserve(n)
        if self.static is not None and cache.capacity != capacity:
            self.static.forget(cache.rows)  # captured graphs read the old cache tensors
        lengths = cache.lengths
        if offsets is None and lengths.count(lengths[0]) == cache.rows:  # rows at the same positions: one slice
            first = lengths[0] + cache.rope_delta
            rope = self._rope(first, first + n, None)
        else:
            steps = torch.arange(n) if offsets is None else torch.as_tensor(offsets)
            positions = (torch.tensor(lengths) + cache.rope_delta)[:, None] + steps
            rope = self._rope(0, int(positions.max()) + 1, self.on_device(positions.reshape(-1)))
        hidden = self.layer_stack(
            F.embedding(ids.reshape(-1), self.decode_weights.embed), cache.rows, rope, cache.write, mask, is_causal
        )
        cache.advance(n if keep is None else keep)
        self._forwarded(cache.rows * n)
        return self.head(hidden).view(cache.rows, n, -1)

    def _static_forward(
        self,
        cache: KVCache,
        ids: torch.Tensor,
        pattern: Pattern | Sequence[torch.Tensor],
        offsets: torch.Tensor | None,
        keep: int | Sequence[int] | None,
    ) -> torch.Tensor:
        rows, n = ids.shape
        if isinstance(pattern, (torch.Tensor, str)):
            patterns = as_pattern(pattern, n).expand(rows, n, n)
        else:
            patterns = torch.stack(list(pattern))
        steps = torch.arange(n) if offsets is None else torch.as_tensor(offsets)
        positions = (torch.tensor(cache.lengths) + cache.rope_delta)[:, None] + steps
        logits = self.static.forward(cache, ids, patterns, positions.expand(rows, n))
        cache.advance(n if keep is None else keep)
        self._forwarded(rows * n)
        return logits

    def empty_cache(self, capacity: int, rows: int = 1, rope_delta: int = 0) -> KVCache:
        """A decode cache shaped for this model's text decoder."""
        config = self.text_model.config
        head_dim = self.text_model.layers[0].self_attn.head_dim
        return KVCache(
            config.num_hidden_layers,
            config.num_key_value_heads,
            head_dim,
            capacity,
            self.dtype,
            self.device,
            rows,
            rope_delta,
        )

    def fork(self, cache: KVCache, rows: int) -> KVCache:
        """`rows` rows of one batched cache, each continuing the single-row `cache` (`KVCache.fork`)."""
        if self.static is not None and self.static.owns(cache):
            return cache.fork(rows, into=self.static.cache(rows, cache.rope_delta, cache.capacity - BUCKETS[-1]))
        return cache.fork(rows)

    def verify(self, cache: KVCache, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """AR head: causal logits (n, V) of `ids` after the cached prefix; the cache now holds them too."""
        return self.forward(cache, ids, CAUSAL)[0]

    def draft(self, cache: KVCache, ids: torch.Tensor | Sequence[int], causal_head: int = 0) -> torch.Tensor:
        """MDM head: logits (n, V) of a block seen bidirectionally with the cached prefix; cache unchanged.

        The first `causal_head` ids are committed tokens not yet in the cache: they stay causal, as the
        clean context of training does, and the block after them sees them.
        """
        n = len(ids)
        pattern = block_mask(n, causal_head) if causal_head else FULL
        return self.forward(cache, ids, pattern, keep=0)[0]

    # ----------------------------------------------------------------- forwards without the decode cache
    @torch.no_grad()
    def full_sequence_logits(self, prompt: PromptInputs, canvas: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """One forward of [prompt ; canvas] that reuses no cache: the prompt causal, the canvas bidirectional
        and seeing the whole prompt (the dVLM-AD-style full-sequence mode). Returns (len(canvas), V): row i
        predicts canvas position i (token shift: row 0 comes from the prompt's last position)."""
        canvas = torch.as_tensor(canvas, dtype=torch.long).reshape(1, -1)
        p, n = prompt.input_ids.shape[1], canvas.shape[1]
        ids = torch.cat([prompt.input_ids, canvas], dim=1)
        positions, _ = self._rope_positions(ids, prompt.image_grid_thw)
        allowed = block_mask(p + n, causal_head=p)
        logits = self._masked_logits(ids, positions, allowed[None], prompt, logits_to_keep=n + 1)
        self._forwarded(p + n)
        return logits[0, :-1]

    def dual_stream_logits(
        self,
        clean_ids: torch.Tensor,
        clean_lengths: torch.Tensor,
        response_start: torch.Tensor,
        noisy_ids: torch.Tensor,
        block_start: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of `[noisy streams ; clean]`; returns noisy logits (B, k, R, V) and clean (B, Lc, V).

        clean_ids (B, Lc) right-padded; noisy_ids (B, k, R): k noisy copies of the response (k may be 0,
        the plain AR case); block_start (B, k, R) as in `dual_stream_mask`. The noisy streams reuse the
        clean stream's positions (mRoPE included); image tokens appear only in the clean stream.
        """
        batch, k, r = noisy_ids.shape
        offsets = response_start[:, None] + torch.arange(r)[None]  # (B, R) clean index of each response token
        offsets = offsets.clamp(max=clean_ids.shape[1] - 1)
        clean_index = torch.cat([offsets.repeat(1, k), torch.arange(clean_ids.shape[1]).expand(batch, -1)], dim=1)
        input_ids = torch.cat([noisy_ids.reshape(batch, k * r), clean_ids], dim=1)
        allowed = dual_stream_mask(clean_lengths, response_start, block_start)
        logits = self.packed_logits(input_ids, clean_ids, clean_index, allowed, pixel_values, image_grid_thw)
        return logits[:, : k * r].reshape(batch, k, r, logits.shape[-1]), logits[:, k * r :]

    def packed_logits(
        self,
        input_ids: torch.Tensor,
        clean_ids: torch.Tensor,
        clean_index: torch.Tensor,
        allowed: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One forward of packed sequences (B, L) under an allowed-attention pattern (B, L, L); logits (B, L, V).

        Packed token j of row b sits at the rotary position of clean token clean_index[b, j] of the row's
        clean sequence clean_ids (B, Lc) (mRoPE included), so a copy of a clean token is placed where it
        stands; the Jacobi Forcing sequence of paper 003 section 3.1 packs noisy blocks this way. Image
        tokens appear once, in the packed prompt.
        """
        clean_positions, _ = self._rope_positions(clean_ids, image_grid_thw)
        if self.is_vision:
            positions = torch.gather(clean_positions, 2, clean_index[None].expand(3, -1, -1))
        else:
            positions = torch.gather(clean_positions, 1, clean_index)
        return self._masked_logits(input_ids, positions, allowed, PromptInputs(input_ids, pixel_values, image_grid_thw))

    def _masked_logits(
        self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, prompt: PromptInputs, **kwargs: Any
    ) -> torch.Tensor:
        """Logits of one uncached transformers forward of `ids` at rotary `positions` under the allowed-attention
        pattern (B, L, L), with the images of `prompt`; `kwargs` go to the transformers forward."""
        return self.model(
            input_ids=self.on_device(ids),
            position_ids=self.on_device(positions),
            attention_mask=self.on_device(additive_mask(allowed, self.dtype)),
            use_cache=False,
            **self._vision_kwargs(prompt),
            **kwargs,
        ).logits
