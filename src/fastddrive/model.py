"""BlockDiffusionModel: one set of weights, a causal (AR) mode and a block-bidirectional (MDM) mode.

Paper 002 section 3 (Fast-dVLM), DESIGN section 5. The wrapper only runs forwards: `prefill` a prompt,
`draft` a block with bidirectional attention inside it and the cached prefix visible (the cache is not
written), `verify` tokens causally (the cache is written), and the training-time dual-stream forward
`[noisy streams ; clean sequence]`. Token shift: the logits at position i predict the token at i + 1 in
both modes. Attention masks are float masks (0 or the dtype's minimum, never -inf), and Qwen2.5-VL's
mRoPE positions and image tokens are handled here and nowhere else. It knows nothing about JSON.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import (
    DynamicCache,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2ForCausalLM,
    Qwen2VLImageProcessorPil,
)

from fastddrive.tokenizer import (
    DiffusionTokenIds,
    MissingDiffusionTokens,
    add_diffusion_tokens,
    diffusion_token_ids,
    load_tokenizer,
)

INFO_FILE = "fastddrive.json"
IMAGE_TOKEN = "<|image_pad|>"


@dataclass
class CheckpointInfo:
    """What fastddrive records beside the transformers files of a checkpoint it trained."""

    kind: str = "block-diffusion"  # or "autoregressive" (the AR baseline: no diffusion training)
    mask_token_id: int | None = None
    null_token_id: int | None = None
    explanation_budget: int | None = None
    block_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptInputs:
    """A tokenized prompt: ids (1, L) with image tokens expanded, and the pixels they stand for."""

    input_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None


@dataclass
class KVCache:
    """The explicit decoding state: transformers' cache, its length, and the mRoPE offset of text.

    Text after the images of a Qwen2.5-VL prompt sits at position index + `rope_delta`.
    """

    cache: DynamicCache
    length: int
    rope_delta: int = 0

    def crop(self, length: int) -> None:
        """Keep the first `length` positions, as if the later ones had never been fed."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        if length < self.length:
            self.cache.crop(length - self.length)  # transformers 5: crop(-k) drops the last k tokens
        self.length = length

    def fork(self, k: int) -> list[KVCache]:
        """k independent copies (for rollouts that share this prefix)."""
        return [KVCache(copy.deepcopy(self.cache), self.length, self.rope_delta) for _ in range(k)]

    def keep(self, start: int, indices: Sequence[int]) -> None:
        """Keep the first `start` positions and, of the ones after them, those at `indices` (in order).

        Used after a tree-shaped forward (paper 002 Algorithm 2), whose kept tokens are not contiguous.
        """
        if not 0 <= start <= self.length or any(not 0 <= i < self.length - start for i in indices):
            raise ValueError(f"cannot keep {list(indices)} after {start} of {self.length} positions")
        for layer in self.cache.layers:
            index = torch.cat([torch.arange(start), start + torch.as_tensor(list(indices), dtype=torch.long)])
            index = index.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
        self.length = start + len(indices)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean (B, Q, K) -> float (B, 1, Q, K): 0 where allowed, the dtype's minimum elsewhere."""
    blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    blocked.masked_fill_(~allowed, torch.finfo(dtype).min)
    return blocked[:, None]


def block_mask(n: int, causal_head: int = 0) -> torch.Tensor:
    """Allowed attention (n, n) among n new tokens: the first `causal_head` causal (committed tokens), the
    rest one bidirectional block that also sees them. causal_head = n is plain causal attention."""
    allowed = torch.ones(n, n, dtype=torch.bool)
    allowed[:causal_head] = allowed[:causal_head].tril()
    return allowed


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

    # ----------------------------------------------------------------- loading and saving
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        training: bool = False,
    ) -> BlockDiffusionModel:
        """Load from a local folder (never the network).

        For training, |<MASK>| and <|NULL|> are added if the checkpoint lacks them (embeddings are
        resized); for inference a checkpoint without them is refused.
        """
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model folder: config.json is missing")
        tokenizer = load_tokenizer(path)
        info = _read_info(path)
        config = json.loads((path / "config.json").read_text())
        model_class = (
            Qwen2_5_VLForConditionalGeneration if config.get("model_type") == "qwen2_5_vl" else Qwen2ForCausalLM
        )
        model = model_class.from_pretrained(str(path), dtype=dtype or torch.float32, local_files_only=True)
        image_processor = None
        if model_class is Qwen2_5_VLForConditionalGeneration:
            image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path), local_files_only=True)
        wrapper = cls(model.to(device), tokenizer, image_processor, info)
        if training:
            wrapper.ensure_diffusion_tokens()
        elif info.kind == "block-diffusion":
            ids = diffusion_token_ids(tokenizer)
            if info.mask_token_id is None:
                raise MissingDiffusionTokens(
                    f"{path} was never trained for block diffusion ({INFO_FILE} is missing); "
                    "train it with `fastddrive train` first"
                )
            if (ids.mask_id, ids.null_id) != (info.mask_token_id, info.null_token_id):
                raise MissingDiffusionTokens(f"{path}: tokenizer and {INFO_FILE} disagree on the mask/NULL ids")
        model.eval()
        return wrapper

    def ensure_diffusion_tokens(self) -> DiffusionTokenIds:
        """Add |<MASK>| and <|NULL|> if missing, resizing the embeddings (and saying so)."""
        ids = add_diffusion_tokens(self.tokenizer)
        if len(self.tokenizer) > self.core.get_input_embeddings().num_embeddings:
            print(f"added {', '.join(ids.added)} to the tokenizer; resizing embeddings to {len(self.tokenizer)}")
            self.core.resize_token_embeddings(len(self.tokenizer))
        self.info.mask_token_id, self.info.null_token_id = ids.mask_id, ids.null_id
        return ids

    def save_pretrained(self, path: str | Path) -> None:
        """Write safetensors weights, config, tokenizer, image processor and fastddrive.json atomically."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        self.core.save_pretrained(str(tmp))
        self.tokenizer.save_pretrained(str(tmp))
        if self.image_processor is not None:
            self.image_processor.save_pretrained(str(tmp))
        (tmp / INFO_FILE).write_text(json.dumps(asdict(self.info), indent=2))
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)

    @property
    def core(self) -> PreTrainedModel:
        """The transformers model itself, unwrapped from any distributed wrapper."""
        return getattr(self.model, "module", self.model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

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

    # ----------------------------------------------------------------- decoding operations
    @torch.no_grad()
    def prefill(self, prompt: PromptInputs) -> tuple[torch.Tensor, KVCache]:
        """Run the prompt causally; return the logits of its last position (V,) and the cache."""
        ids = prompt.input_ids.to(self.device)
        positions, deltas = self._rope_positions(prompt.input_ids, prompt.image_grid_thw)
        cache = DynamicCache(config=self.core.config)
        n = ids.shape[1]
        kwargs = {}
        if prompt.pixel_values is not None:
            kwargs = {"pixel_values": prompt.pixel_values.to(self.device), "image_grid_thw": prompt.image_grid_thw}
        out = self.model(
            input_ids=ids,
            position_ids=positions.to(self.device),
            attention_mask=additive_mask(block_mask(n, causal_head=n)[None], self.dtype).to(self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        )
        return out.logits[0, -1], KVCache(cache, n, int(deltas[0]))

    @torch.no_grad()
    def draft(self, cache: KVCache, ids: torch.Tensor | Sequence[int], causal_head: int = 0) -> torch.Tensor:
        """MDM head: logits (n, V) of a block seen bidirectionally with the cached prefix; cache unchanged.

        The first `causal_head` ids are committed tokens not yet in the cache: they stay causal, as the
        clean context of training does, and the block after them sees them.
        """
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        logits = self.tree(cache, ids, torch.arange(len(ids)), block_mask(len(ids), causal_head))
        cache.crop(cache.length - len(logits))
        return logits

    @torch.no_grad()
    def verify(self, cache: KVCache, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """AR head: causal logits (n, V) of `ids` after the cached prefix; the cache now holds them too."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        return self.tree(cache, ids, torch.arange(len(ids)), block_mask(len(ids), causal_head=len(ids)))

    @torch.no_grad()
    def tree(
        self, cache: KVCache, ids: torch.Tensor | Sequence[int], offsets: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """Logits (n, V) of n new tokens after the cached prefix, each at position prefix + offsets[i],
        token i seeing every cached position and the new tokens j with allowed[i, j]. The cache now
        holds all n (see `KVCache.keep` to drop some). `draft` and `verify` are its two plain cases."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(1, -1)
        n = ids.shape[1]
        full = torch.cat([torch.ones(n, cache.length, dtype=torch.bool), allowed.to(torch.bool)], dim=1)
        positions = cache.length + cache.rope_delta + torch.as_tensor(offsets, device=self.device)[None]
        out = self.model(
            input_ids=ids,
            position_ids=positions.expand(3, 1, n) if self.is_vision else positions,
            attention_mask=additive_mask(full[None], self.dtype).to(self.device),
            past_key_values=cache.cache,
            use_cache=True,
        )
        cache.length += n
        return out.logits[0]

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
        kwargs = {}
        if prompt.pixel_values is not None:
            kwargs = {"pixel_values": prompt.pixel_values.to(self.device), "image_grid_thw": prompt.image_grid_thw}
        out = self.model(
            input_ids=ids.to(self.device),
            position_ids=positions.to(self.device),
            attention_mask=additive_mask(allowed[None], self.dtype).to(self.device),
            use_cache=False,
            logits_to_keep=n + 1,
            **kwargs,
        )
        return out.logits[0, :-1]

    # ----------------------------------------------------------------- training forward
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
        clean_positions, _ = self._rope_positions(clean_ids, image_grid_thw)
        offsets = response_start[:, None] + torch.arange(r)[None]  # (B, R) clean index of each response token
        offsets = offsets.clamp(max=clean_ids.shape[1] - 1)
        if self.is_vision:
            noisy_positions = torch.gather(clean_positions, 2, offsets[None].expand(3, -1, -1))
            positions = torch.cat([noisy_positions.repeat(1, 1, k), clean_positions], dim=2)
        else:
            positions = torch.cat([torch.gather(clean_positions, 1, offsets).repeat(1, k), clean_positions], dim=1)
        input_ids = torch.cat([noisy_ids.reshape(batch, k * r), clean_ids], dim=1)
        mask = additive_mask(dual_stream_mask(clean_lengths, response_start, block_start), self.dtype)
        kwargs = {}
        if pixel_values is not None:
            kwargs = {"pixel_values": pixel_values.to(self.device), "image_grid_thw": image_grid_thw}
        logits = self.model(
            input_ids=input_ids.to(self.device),
            position_ids=positions.to(self.device),
            attention_mask=mask.to(self.device),
            use_cache=False,
            **kwargs,
        ).logits
        return logits[:, : k * r].reshape(batch, k, r, logits.shape[-1]), logits[:, k * r :]


EMBEDDED_MODELS = {"default": "tiny-sasd", "default-ar": "tiny-ar"}


def model_path(name: str) -> Path:
    """'default' (the embedded tiny-sasd), 'default-ar' (the embedded tiny-ar), another folder under the
    package's assets, or a local folder."""
    from importlib.resources import files

    assets = Path(str(files("fastddrive") / "assets"))
    if name in EMBEDDED_MODELS:
        return assets / EMBEDDED_MODELS[name]
    return assets / name if (assets / name / "config.json").is_file() else Path(name)


def _read_info(path: Path) -> CheckpointInfo:
    file = path / INFO_FILE
    if not file.is_file():
        return CheckpointInfo(kind="block-diffusion")
    return CheckpointInfo(**json.loads(file.read_text()))


def tiny_qwen2_5_vl(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 192,
    layers: int = 4,
    heads: int = 6,
    kv_heads: int = 2,
    intermediate_size: int = 512,
    vision_hidden_size: int = 96,
    vision_depth: int = 2,
    vision_heads: int = 2,
    seed: int = 0,
) -> Qwen2_5_VLForConditionalGeneration:
    """A randomly initialised Qwen2.5-VL with the real architecture at tiny sizes (for the embedded model)."""
    head_dim = hidden_size // heads
    quarter = head_dim // 2
    section = [quarter - 2 * (quarter * 3 // 8), quarter * 3 // 8, quarter * 3 // 8]  # t, h, w as 16:24:24
    vocab = tokenizer.get_vocab()
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
            "bos_token_id": vocab["<|endoftext|>"],
            "eos_token_id": vocab["<|im_end|>"],
            "pad_token_id": vocab["<|endoftext|>"],
        },
        vision_config={
            "depth": vision_depth,
            "hidden_size": vision_hidden_size,
            "intermediate_size": 2 * vision_hidden_size,
            "num_heads": vision_heads,
            "out_hidden_size": hidden_size,
            "fullatt_block_indexes": [vision_depth - 1],
            "window_size": 112,
        },
        image_token_id=vocab[IMAGE_TOKEN],
        video_token_id=vocab[IMAGE_TOKEN],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config)


def tiny_image_processor(max_pixels: int = 224 * 112) -> Qwen2VLImageProcessorPil:
    """Qwen2.5-VL's image processor limited to `max_pixels` (the tiny model sees 224 x 112)."""
    return Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels, patch_size=14, merge_size=2)
