"""The decode roofline: latency of one forward against the tokens it carries, and the weight-read floor.

A decode forward of k tokens after a cached driving prompt reads every decoder weight once whatever
k is, so at small k its latency is bounded below by weight bytes / memory bandwidth (the floor), and
extra tokens are nearly free until compute takes over. That flat stretch is the budget a block
decoder spends on drafting several tokens per forward. Bandwidth is measured here with a
device-to-device copy, not taken from a data sheet.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from fastddrive.model import BlockDiffusionModel, PromptInputs
from fastddrive.model_files import load_model, model_path
from fastddrive.prompt import chat_text
from fastddrive.random_init import random_init_model

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 33, 64, 128, 256, 512)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
IMAGE_SHAPE = (224, 448, 3)  # one camera frame at the dataset's resolution


class RooflineError(ValueError):
    """Bad roofline settings (dtype, token counts, device)."""


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise RooflineError(f"unknown dtype {name!r}; dtypes: {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_tokens(text: str) -> list[int]:
    """'1,8,33' -> [1, 8, 33]; every count a positive integer."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise RooflineError(f"--tokens must be comma-separated positive integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise RooflineError(f"--tokens must be comma-separated positive integers, got {text!r}")
    return counts


@dataclass(frozen=True)
class SweepRow:
    """Latency of one forward of `tokens` new tokens over the timed repeats (ms)."""

    tokens: int
    median_ms: float
    p10_ms: float
    p90_ms: float

    @property
    def ms_per_token(self) -> float:
        return self.median_ms / self.tokens


@dataclass(frozen=True)
class Roofline:
    """A sweep with the floor it is compared against."""

    device: str
    dtype: str
    prompt_tokens: int
    weight_bytes: int
    bandwidth_bytes_per_s: float
    rows: list[SweepRow]
    setup_s: float  # the prompt's prefill and every warm-up forward: compilation and graph capture included

    @property
    def floor_ms(self) -> float:
        return 1e3 * self.weight_bytes / self.bandwidth_bytes_per_s

    def to_json(self) -> dict[str, object]:
        return asdict(self) | {
            "floor_ms": self.floor_ms,
            "rows": [
                asdict(r) | {"ms_per_token": r.ms_per_token, "x_floor": r.median_ms / self.floor_ms} for r in self.rows
            ],
        }


def sweep_prompt(model: BlockDiffusionModel, seed: int = 0) -> PromptInputs:
    """A fixed driving prompt: one random 448 x 224 frame (vision models only) and a steady 10 m/s history."""
    history = np.zeros((7, 6))
    history[:, 0] = -10.0 * 0.5 * np.arange(6, -1, -1)  # x every 0.5 s, ego at the origin now
    history[:, 2] = 10.0
    images = [np.random.default_rng(seed).integers(0, 256, IMAGE_SHAPE, dtype=np.uint8)] if model.is_vision else []
    return model.encode_prompt(chat_text("go_straight", history, images=len(images)), images)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_sweep(
    model: BlockDiffusionModel,
    tokens: Sequence[int] = DEFAULT_TOKENS,
    repeats: int = 20,
    warmup: int = 3,
    prompt: PromptInputs | None = None,
    on_forward: Callable[[], None] | None = None,
) -> tuple[list[SweepRow], float]:
    """Time `model.verify` of k new tokens after a prefilled prompt (then cropped back off), per k.

    Each k warms up `warmup` times first; the timed repeats then go round all k in turn, so that drifts
    of a shared machine hit every k alike. CUDA is synchronised before and after every forward. Also
    returns the seconds of setup: the prefill and the warm-ups (first compilations and captures).
    """
    prompt = prompt or sweep_prompt(model)
    setup_began = time.perf_counter()
    _, cache = model.prefill(prompt, room=max(tokens))
    start = cache.length
    generator = torch.Generator().manual_seed(0)
    ids = {k: model.on_device(torch.randint(len(model.tokenizer), (k,), generator=generator)) for k in tokens}
    device = model.device

    def timed(k: int) -> float:
        _sync(device)
        begin = time.perf_counter()
        model.verify(cache, ids[k])
        cache.crop(start)
        _sync(device)
        if on_forward:
            on_forward()
        return 1e3 * (time.perf_counter() - begin)

    for k in tokens:
        for _ in range(warmup):
            timed(k)
    setup_s = time.perf_counter() - setup_began
    times: dict[int, list[float]] = {k: [] for k in tokens}
    for _ in range(repeats):
        for k in tokens:
            times[k].append(timed(k))
    return [SweepRow(k, *(float(np.percentile(times[k], q)) for q in (50, 10, 90))) for k in tokens], setup_s


def weight_bytes(model: BlockDiffusionModel) -> int:
    """Bytes of weights one decode forward reads: every text decoder parameter and the LM head, each
    tensor once (a head tied to the embedding table, as in Qwen2.5-VL-3B, counts once). An untied input
    embedding table is left out: a forward reads only its k rows. The vision tower (prefill only), the
    KV cache and activations (a few MB at driving prompt lengths) are not counted."""
    params = {id(p): p for p in (*model.text_model.parameters(), *model.core.lm_head.parameters())}
    embed = model.text_model.embed_tokens.weight
    if embed is not model.core.lm_head.weight:
        del params[id(embed)]
    return sum(p.numel() * p.element_size() for p in params.values())


def copy_bandwidth(device: str | torch.device, size_bytes: int | None = None, repeats: int = 5) -> float:
    """Memory bandwidth (bytes/s) of the fastest of `repeats` copies of one buffer into another on
    `device`, counting the bytes read and written. 2 GB on CUDA, 256 MB elsewhere by default: large
    enough that caches do not flatter it."""
    device = torch.device(device)
    size = size_bytes or (2 * 1024**3 if device.type == "cuda" else 256 * 1024**2)
    source = torch.ones(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch: page faults and lazy allocation are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        begin = time.perf_counter()
        target.copy_(source)
        _sync(device)
        best = min(best, time.perf_counter() - begin)
    return 2 * size / best


def measure_roofline(
    model: BlockDiffusionModel,
    tokens: Sequence[int] = DEFAULT_TOKENS,
    repeats: int = 20,
    warmup: int = 3,
    on_forward: Callable[[], None] | None = None,
) -> Roofline:
    """The sweep on the standard prompt, the model's weight bytes and the device's copy bandwidth."""
    prompt = sweep_prompt(model)
    bandwidth = copy_bandwidth(model.device)
    rows, setup_s = forward_sweep(model, tokens, repeats, warmup, prompt, on_forward)
    return Roofline(
        device=str(model.device),
        dtype=str(model.dtype).removeprefix("torch."),
        prompt_tokens=prompt.input_ids.shape[1],
        weight_bytes=weight_bytes(model),
        bandwidth_bytes_per_s=bandwidth,
        rows=rows,
        setup_s=setup_s,
    )


def roofline_model(
    model: str | None, random_init: str | None, device: str, dtype: str | None, cuda_graphs: bool
) -> tuple[BlockDiffusionModel, str]:
    """The model to sweep and its name: a model folder (or an embedded name), or an architecture preset with
    random weights (timing only); float32 on the CPU and bfloat16 elsewhere unless `dtype` says; CUDA graphs
    on a GPU unless `cuda_graphs` is False. Settings are checked before anything loads."""
    if model is not None and random_init is not None:
        raise RooflineError("give --model or --random-init, not both")
    chosen = parse_dtype(dtype or ("float32" if device == "cpu" else "bfloat16"))
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RooflineError(f"--device {device}: CUDA is not available here")
    if random_init is not None:
        loaded = random_init_model(random_init, device, chosen)
        name = f"{random_init} (random weights, for timing only)"
    else:
        loaded = load_model(model_path(model or "default"), device, chosen)
        name = model or "default"
    if cuda_graphs and loaded.device.type == "cuda":
        loaded.use_static_shapes(graphs=True)
        name += ", CUDA graphs"
    return loaded, name
