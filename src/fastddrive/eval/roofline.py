"""The decode roofline: latency of one forward against the tokens it carries, and the weight-read floor.

A decode forward of k tokens after a cached driving prompt reads every decoder weight once whatever
k is, so at small k its latency is bounded below by weight bytes / memory bandwidth (the floor), and
extra tokens are nearly free until compute takes over. That flat stretch is the budget a block
decoder spends on drafting several tokens per forward. Bandwidth is measured here with a
device-to-device copy, not taken from a data sheet.

The settings are bounded (issue 32: `--tokens 100000000` allocated 26 GB): at most MAX_SWEEP_TOKENS new
tokens per forward, MAX_REPEATS timed and MAX_WARMUP untimed forwards per count; and what a sweep holds
(the copy's buffers, the cache, the widest forward's logits and activations) is estimated from the model's
config and checked against the memory budget before the model loads (`check_sweep_memory`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from fastddrive.core.memory import check_allocation
from fastddrive.core.prompt import chat_text
from fastddrive.decode.footprint import ModelSizes, Workload, workload_bytes
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs
from fastddrive.engine.model_files import load_model, model_path
from fastddrive.engine.random_init import architecture_config, random_init_model

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 33, 64, 128, 256, 512)
# 16 times the default sweep's widest forward: past a few hundred tokens a forward is compute-bound on any
# device, and the roofline's point (the flat stretch under the floor) is made long before.
MAX_SWEEP_TOKENS = 8192
MAX_COUNTS = 64  # token counts in one sweep
MAX_REPEATS = 10_000  # a median of a few hundred forwards is settled
MAX_WARMUP = 1_000  # compilation and graph capture take a few forwards
CPU_COPY_BYTES = 256 * 1024**2
CUDA_COPY_BYTES = 2 * 1024**3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
IMAGE_SHAPE = (224, 448, 3)  # one camera frame at the dataset's resolution


class RooflineError(ValueError):
    """Bad roofline settings (dtype, token counts, device)."""


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise RooflineError(f"unknown dtype {name!r}; dtypes: {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_tokens(text: str) -> list[int]:
    """'1,8,33' -> [1, 8, 33]: up to MAX_COUNTS distinct integers in [1, MAX_SWEEP_TOKENS]."""
    shown = text if len(text) <= 60 else text[:57] + "..."
    takes = f"up to {MAX_COUNTS} distinct comma-separated integers in [1, {MAX_SWEEP_TOKENS}]"
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or len(parts) > MAX_COUNTS or not all(part.isascii() and part.isdigit() for part in parts):
        raise RooflineError(f"--tokens must be {takes}, got {shown!r}")
    counts = [int(part) if len(part) <= 9 else MAX_SWEEP_TOKENS + 1 for part in parts]  # no 4000-digit ints
    twice = sorted({k for k in counts if counts.count(k) > 1})
    if min(counts) < 1 or max(counts) > MAX_SWEEP_TOKENS or twice:
        raise RooflineError(f"--tokens must be {takes}, got {shown!r}")
    return counts


def check_sweep(tokens: Sequence[int], repeats: int, warmup: int) -> None:
    """RooflineError (one line) unless the counts are as `parse_tokens` gives them, repeats in [1, MAX_REPEATS]
    and warmup in [0, MAX_WARMUP]."""
    parse_tokens(",".join(str(k) for k in tokens))
    if not 1 <= repeats <= MAX_REPEATS:
        raise RooflineError(f"--repeats must be an integer in [1, {MAX_REPEATS}], got {repeats}")
    if not 0 <= warmup <= MAX_WARMUP:
        raise RooflineError(f"--warmup must be an integer in [0, {MAX_WARMUP}], got {warmup}")


def sweep_bytes(sizes: ModelSizes, tokens: Sequence[int], device: str | torch.device, prompt_tokens: int = 0) -> int:
    """Bytes a sweep holds beyond the weights: the bandwidth copy's two buffers, then (once they are freed) the
    prompt's cache with room for the widest forward and that forward (`decode.footprint`)."""
    widest = max(tokens)
    forward = Workload(1, prompt_tokens + widest, widest, prompt_tokens)
    copy = 2 * (CUDA_COPY_BYTES if torch.device(device).type == "cuda" else CPU_COPY_BYTES)
    return max(copy, workload_bytes(sizes, forward, prompt_tokens))


def check_sweep_memory(
    sizes: ModelSizes, tokens: Sequence[int], device: str | torch.device, prompt_tokens: int = 0
) -> None:
    """MemoryBudgetError (one line: the widest --tokens, the estimate, the budget) when a sweep would hold more
    than the budget for `device`."""
    what = f"the roofline sweep (--tokens up to {max(tokens)})"
    check_allocation(what, sweep_bytes(sizes, tokens, device, prompt_tokens), device)


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
    size = size_bytes or (CUDA_COPY_BYTES if device.type == "cuda" else CPU_COPY_BYTES)
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
    """The sweep on the standard prompt, the model's weight bytes and the device's copy bandwidth. The settings
    and the sweep's memory are checked first (RooflineError, MemoryBudgetError)."""
    check_sweep(tokens, repeats, warmup)
    prompt = sweep_prompt(model)
    check_sweep_memory(ModelSizes.of_model(model), tokens, model.device, prompt.input_ids.shape[1])
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
    model: str | None,
    random_init: str | None,
    device: str,
    dtype: str | None,
    cuda_graphs: bool,
    tokens: Sequence[int] | None = None,
) -> tuple[BlockDiffusionModel, str]:
    """The model to sweep and its name: a model folder (or an embedded name), or an architecture preset with
    random weights (timing only); float32 on the CPU and bfloat16 elsewhere unless `dtype` says; CUDA graphs
    on a GPU unless `cuda_graphs` is False. Settings are checked before anything loads, and with `tokens` the
    sweep's memory too, from the model's config (`check_sweep_memory`)."""
    if model is not None and random_init is not None:
        raise RooflineError("give --model or --random-init, not both")
    chosen = parse_dtype(dtype or ("float32" if device == "cpu" else "bfloat16"))
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RooflineError(f"--device {device}: CUDA is not available here")
    if tokens is not None:
        sizes = _config_sizes(model, random_init, chosen.itemsize)
        if sizes is not None:
            check_sweep_memory(sizes, tokens, device)
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


def _config_sizes(model: str | None, random_init: str | None, dtype_bytes: int) -> ModelSizes | None:
    """The sizes in the preset's or the model folder's config; None when the folder's config cannot be read
    (the loader then names what is wrong)."""
    if random_init is not None:
        return ModelSizes.from_config(architecture_config(random_init).to_dict(), dtype_bytes)
    try:
        config = json.loads((model_path(model or "default") / "config.json").read_text())
        return ModelSizes.from_config(config, dtype_bytes)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
