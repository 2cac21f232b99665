"""Real architectures with random weights, for timing only.

A preset is a config.json shipped in fastddrive/configs as `<preset>-architecture.json` (the public
Qwen/Qwen2.5-VL-3B-Instruct one for `qwen2.5-vl-3b`). The model it builds has that architecture's
shapes, so its forwards cost what the real checkpoint's do, but its answers mean nothing. It reads
the embedded tokenizer, whose ids all lie inside the real vocabulary; the config's special token
ids (image, vision start and end, bos, eos) are set to that tokenizer's, so prompts with images run as
they would on a trained model.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

from fastddrive.core.memory import check_allocation
from fastddrive.core.tokenizer import END_OF_TEXT, default_tokenizer_path, diffusion_token_ids, load_tokenizer
from fastddrive.engine.model import IMAGE_TOKEN, BlockDiffusionModel, CheckpointInfo
from fastddrive.engine.model_files import check_device, tiny_image_processor

ARCHITECTURE_SUFFIX = "-architecture.json"
IMAGE_PIXELS = 448 * 224  # one camera frame at the dataset's resolution: 16 x 8 merged image tokens


class UnknownPreset(ValueError):
    """An architecture preset that fastddrive does not ship."""


def preset_names() -> list[str]:
    return sorted(p.name.removesuffix(ARCHITECTURE_SUFFIX) for p in _configs_dir().glob(f"*{ARCHITECTURE_SUFFIX}"))


def _configs_dir() -> Path:
    return Path(str(files("fastddrive") / "configs"))


def _merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def architecture_config(preset: str = "qwen2.5-vl-3b", shrink: dict[str, Any] | None = None) -> Qwen2_5_VLConfig:
    """The preset's config with `shrink` merged into its config.json (text sizes at the top level, as in
    the public file; vision sizes under "vision_config"). Builds nothing.

    The vision merger's output size always follows the text hidden size (it feeds the decoder), and a
    shrunk head size must still fit the preset's mRoPE sections.
    """
    if preset not in preset_names():
        raise UnknownPreset(f"unknown architecture preset {preset!r}; presets: {', '.join(preset_names())}")
    raw = _merged(json.loads((_configs_dir() / f"{preset}{ARCHITECTURE_SUFFIX}").read_text()), shrink or {})
    raw["vision_config"]["out_hidden_size"] = raw["hidden_size"]
    config = Qwen2_5_VLConfig.from_dict(raw)
    text = config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    section = text.rope_parameters["mrope_section"]
    if head_dim != 2 * sum(section):
        raise ValueError(
            f"head size {head_dim} (hidden_size / num_attention_heads) does not fit mrope_section {section}: "
            f"keep it at {2 * sum(section)}"
        )
    return config


def random_init_model(
    preset: str = "qwen2.5-vl-3b",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    shrink: dict[str, Any] | None = None,
    seed: int = 0,
) -> BlockDiffusionModel:
    """The preset's architecture with random weights (transformers' init: normal, std 0.02), for timing only.

    Parameters are created on `device` in `dtype`, so the 3B model never exists in float32 on the host; their
    size is checked against the memory budget first (MemoryBudgetError).
    `info.extra["random_init"]` names the preset, marking the weights as meaningless.
    """
    device = check_device(device)
    tokenizer = load_tokenizer(default_tokenizer_path())
    vocab = tokenizer.get_vocab()
    token_ids = {
        "bos_token_id": vocab[END_OF_TEXT],
        "eos_token_id": vocab["<|im_end|>"],
        "image_token_id": vocab[IMAGE_TOKEN],
        "video_token_id": vocab[IMAGE_TOKEN],
        "vision_start_token_id": vocab["<|vision_start|>"],
        "vision_end_token_id": vocab["<|vision_end|>"],
    }
    config = architecture_config(preset, _merged(shrink or {}, token_ids))
    if config.text_config.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {config.text_config.vocab_size} is below the tokenizer's {len(tokenizer)}")
    with torch.device("meta"):  # shapes only: what the weights will take is checked before they are made
        parameters = sum(p.numel() for p in AutoModelForImageTextToText.from_config(config, dtype=dtype).parameters())
    check_allocation(
        f"the {preset} architecture with random weights ({parameters:,} in {str(dtype).removeprefix('torch.')})",
        parameters * torch.empty((), dtype=dtype).element_size(),
        device,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        core = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    ids = diffusion_token_ids(tokenizer)
    info = CheckpointInfo(
        kind="block-diffusion", mask_token_id=ids.mask_id, null_token_id=ids.null_id, extra={"random_init": preset}
    )
    return BlockDiffusionModel(core.eval(), tokenizer, tiny_image_processor(IMAGE_PIXELS), info)
