"""What one decode allocates beyond the weights, estimated from the model's sizes and the options before any
work, and refused above the memory budget (issue 32: `tts rollouts=2000` held 3.7 GB, `selfspec-quad
block_size=100000` asked for 80 GB).

The terms that grow with options or lengths, each counted as the decoders allocate it:

- the KV cache: rows x positions (prompt, answer, room for the widest forward) x layers x 2 x kv heads x
  head dim;
- the widest forward: its logits (rows x tokens x vocabulary, and the copies that choosing tokens makes:
  a sampled pick works in float64), its activations (hidden, attention and MLP rows per token) and its
  additive attention mask (`masks.DecodeMasks` keeps one of tokens x (4 x context + tokens), for prefixes up
  to twice the longest seen, beside a boolean one; per row where rows stand at their own lengths); attention
  scores are not kept (SDPA's fused kernels);
- a decoder's own buffers: `selfspec-quad`'s (B^2, B^2) layout, `jacobi-mr`'s tree mask.

The prompt's prefill is counted when it is wider than the widest decode forward. The weights, the vision
tower and the tokenizer are not counted: they are resident before any decode, whatever its options. On the
embedded model the estimate was within a factor 1.2 of the peak resident memory a decode adds for `tts` (256
rollouts: 457 MiB estimated, 459 MiB measured; with `rollout_drafts`), `selfspec-quad` (block_size 64),
`jacobi` and `jacobi-mr`; for `pvf` it is the bound of the widest step its width allows (width 64: 226 MiB
estimated, 63 MiB measured, since a step verifies only as many branches as it has candidates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fastddrive.core.memory import check_allocation
from fastddrive.core.scaffold import DEFAULT_BLOCK_SIZE
from fastddrive.decode.jacobi_mr import POOL_PER_KEY
from fastddrive.decode.options import OPTIONS
from fastddrive.decode.state import FREE_SLACK
from fastddrive.engine.kv_cache import GROWTH

CANVAS_ROOM = 2 * DEFAULT_BLOCK_SIZE  # `Canvas.prefill` reserves the answer and two of its blocks after the prompt
# Options that make a decoder's allocations grow, named in a refusal (the others change what is decoded, not
# how much is held).
GROWING = {
    "fullseq": (),
    "ar": (),
    "ar-jump": (),
    "jacobi": ("block_size",),
    "jacobi-mr": ("block_size", "max_blocks", "candidates"),
    "mdm": ("block_size",),
    "pvf": ("width", "block_size", "reveal"),
    "sd": ("block_size",),
    "selfspec": ("block_size",),
    "selfspec-quad": ("block_size",),
    "ss": ("block_size",),
    "tts": ("rollouts", "rollout_window", "block_size", "rollout_drafts"),
}


@dataclass(frozen=True)
class ModelSizes:
    """The sizes of a model's text decoder that a decode's memory scales with."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int  # logits per token (the LM head's rows)
    dtype_bytes: int  # of the weights, so of the cache, activations and logits

    @classmethod
    def of_model(cls, model: Any) -> ModelSizes:
        """The sizes of a loaded `BlockDiffusionModel`."""
        config = model.text_model.config
        return cls(
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=model.text_model.layers[0].self_attn.head_dim,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            vocab=model.core.lm_head.weight.shape[0],
            dtype_bytes=model.dtype.itemsize,
        )

    @classmethod
    def from_config(cls, config: dict[str, Any], dtype_bytes: int) -> ModelSizes:
        """The sizes in a transformers `config.json` (Qwen2.5-VL's `text_config`, or a text model's own keys),
        for a check before the weights load. KeyError or TypeError when a size is missing or not a number."""
        text = config.get("text_config") or config
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        return cls(
            layers=int(text["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            hidden=hidden,
            intermediate=int(text["intermediate_size"]),
            vocab=int(text.get("vocab_size") or config["vocab_size"]),
            dtype_bytes=dtype_bytes,
        )

    @property
    def kv_bytes_per_position(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Workload:
    """What one decode holds at its widest: `rows` sequences of `positions` cached each (and `spare_rows` single
    rows alive beside them), a forward of `tokens` new tokens per row after at most `context` cached positions,
    `pick_bytes` per logit spent choosing tokens, its mask made once for all rows or (`mask_per_row`) for each,
    and `extra_bytes` of the decoder's own."""

    rows: int
    positions: int
    tokens: int
    context: int
    pick_bytes: int = 4
    spare_rows: int = 0
    mask_per_row: bool = False
    extra_bytes: int = 0


def workload(name: str, options: dict[str, Any], prompt_tokens: int, answer_tokens: int, free: bool) -> Workload:
    """The widest point of decoder `name` with `options` (all of them, typed) on a prompt of `prompt_tokens`
    and an answer of `answer_tokens` positions (`free`: an AR model writing JSON freely, up to FREE_SLACK
    more)."""
    p, a = prompt_tokens, answer_tokens
    context = p + a
    canvas = p + a + min(CANVAS_ROOM, 2 * a)
    block = min(options.get("block_size", DEFAULT_BLOCK_SIZE), a)
    if name == "fullseq":  # prompt and answer in one uncached forward, every step, with a dense mask
        return Workload(1, 0, p + a, 0, extra_bytes=6 * (p + a) ** 2)
    if name == "ar":
        return Workload(1, p + a + FREE_SLACK if free else canvas, 1, context, _pick(options))
    if name == "ar-jump":  # a value and the scaffold run after it
        return Workload(1, canvas, min(DEFAULT_BLOCK_SIZE, a), context, _pick(options))
    if name in ("mdm", "sd", "selfspec"):  # the uncached head and a block
        return Workload(1, _grown(canvas, p + a + 2 * block), 2 * block, context)
    if name == "ss":  # the head, a block and the next block drafted in the same verify
        return Workload(1, _grown(canvas, p + a + 3 * block), 3 * block, context)
    if name == "selfspec-quad":
        n = options["block_size"] ** 2
        # quadratic_layout's (B^2, B^2) pattern, the key it is cached under, and their parts while they are made
        return Workload(1, _grown(canvas, p + a + n), n, context, pick_bytes=12, extra_bytes=3 * n * n)
    if name == "tts":
        rows = options["rollouts"]
        if options["rollout_drafts"]:  # Scaffold Spec per row: a fused verify, rows at their own lengths
            tokens = 3 * block
            # each row picks from its own rows of the logits in turn: one row's sampling temporaries at a time
            return Workload(rows, _grown(canvas, p + a + tokens), tokens, context, spare_rows=1, mask_per_row=True)
        tokens = min(options["rollout_window"], a) + 2  # the head, the window and the position after it
        return Workload(rows, _grown(canvas, p + a + tokens), tokens, context, pick_bytes=28, spare_rows=1)
    if name == "pvf":
        window = 2 * block if options["reveal"] else block
        tokens = block + options["width"] * window
        return Workload(1, _grown(canvas, p + a + tokens), tokens, context, pick_bytes=16)
    template = a + FREE_SLACK if free else a
    n = min(options["block_size"], template)
    if name == "jacobi":
        return Workload(1, p + template + 2 * options["block_size"], 2 * n, p + template)
    if name == "jacobi-mr":
        candidates = min(options["candidates"], POOL_PER_KEY)  # the pool holds no more per key
        main = min(options["max_blocks"] * n, template) + n  # the head, the real-active and pseudo-active blocks
        tokens = main + candidates * n
        room = (candidates + 1) * options["block_size"]
        return Workload(1, p + template + room, tokens, p + template, extra_bytes=3 * tokens * tokens)
    raise KeyError(f"no footprint for decoder {name!r}")


def _pick(options: dict[str, Any]) -> int:
    return 28 if options.get("temperature") else 4


def _grown(reserved: int, needed: int) -> int:
    """The cache's capacity once a forward needs `needed` positions (`KVCache.reserve` grows in GROWTH steps)."""
    return reserved if needed <= reserved else math.ceil(needed / GROWTH) * GROWTH


def workload_bytes(sizes: ModelSizes, work: Workload, prompt_tokens: int = 0) -> int:
    """Bytes held at a workload's widest point (module doc)."""
    b = sizes.dtype_bytes
    cache = (work.rows + work.spare_rows) * work.positions * sizes.kv_bytes_per_position
    per_token = (4 * sizes.hidden + 3 * sizes.intermediate + (sizes.heads + 2 * sizes.kv_heads) * sizes.head_dim) * b
    tokens = work.rows * work.tokens
    logits = tokens * sizes.vocab * (b + work.pick_bytes)
    if work.mask_per_row:  # each row's own (tokens, keys) mask and the booleans it is made from
        mask = tokens * (work.context + work.tokens) * (b + 3)
    else:  # one buffer for all rows, kept for prefixes up to twice the longest seen (`DecodeMasks`)
        mask = work.tokens * (4 * work.context + work.tokens) * (b + 1)
    forward = logits + tokens * per_token + mask
    return cache + max(forward, prompt_tokens * per_token) + work.extra_bytes


def complete_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` with the decoder's defaults for those not given (all typed: they were checked)."""
    defaults = {key: field.default for key, field in OPTIONS[name].model_fields.items()}
    return defaults | options


def estimate_decode_bytes(
    name: str,
    options: dict[str, Any],
    sizes: ModelSizes,
    prompt_tokens: int,
    answer_tokens: int,
    free: bool = False,
) -> int:
    """Bytes decoder `name` with (checked) `options` holds beyond the weights, at its widest (module doc)."""
    work = workload(name, complete_options(name, options), prompt_tokens, answer_tokens, free)
    return workload_bytes(sizes, work, prompt_tokens)


def check_decode_memory(
    name: str,
    options: dict[str, Any],
    sizes: ModelSizes,
    prompt_tokens: int,
    answer_tokens: int,
    device: object = "cpu",
    free: bool = False,
) -> None:
    """MemoryBudgetError (one line: the decoder and the options that make it grow, the estimate, the budget)
    when the decode would hold more than the budget for `device`."""
    estimate = estimate_decode_bytes(name, options, sizes, prompt_tokens, answer_tokens, free)
    check_allocation(_what(name, options), estimate, device)


def _what(name: str, options: dict[str, Any]) -> str:
    """'decoder 'tts' with rollouts=256, rollout_window=24': the growing options as given, else the defaults."""
    given = [key for key in GROWING[name] if key in options]
    if not given:
        return f"decoder {name!r} (its default options)" if GROWING[name] else f"decoder {name!r}"
    return f"decoder {name!r} with " + ", ".join(f"{key}={options[key]}" for key in given)
