"""Model folders: load and save a BlockDiffusionModel, find the embedded checkpoints, build tiny ones.

A folder is what transformers' `save_pretrained` writes (safetensors weights, config, tokenizer, image
processor) plus `fastddrive.json` (`CheckpointInfo`). Loading never reaches the network; a real
Qwen2.5-VL-3B folder and the embedded tiny checkpoints go through the same code, after `model_check` has
checked the folder. Saving is atomic.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path

import torch
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)

from fastddrive.core.memory import check_allocation
from fastddrive.core.outputs import fsync_folder, staged_folder
from fastddrive.core.scaffold import SCAFFOLD_TOKENIZATIONS
from fastddrive.core.tokenizer import (
    DiffusionTokenIds,
    MissingDiffusionTokens,
    TokenizerError,
    add_diffusion_tokens,
    diffusion_token_ids,
    load_tokenizer,
)
from fastddrive.core.training_episodes import record_problem
from fastddrive.engine.model import IMAGE_TOKEN, BlockDiffusionModel, CheckpointInfo
from fastddrive.engine.model_check import ModelFileError, check_model_folder, check_tokenizer_fits, read_json_object

INFO_FILE = "fastddrive.json"
DEVICE_TYPES = ("cpu", "cuda", "mps")
EMBEDDED_MODELS = {"default": "tiny-sasd", "default-ar": "tiny-ar", "default-jf": "tiny-jf"}


class DeviceError(ValueError):
    """A device name that torch does not know or this machine does not have."""


def check_device(device: str | torch.device) -> torch.device:
    """The device, refused in one line if it is unknown or absent here (before any model loads)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise DeviceError(f"unknown device {str(device)!r}; use one of {', '.join(DEVICE_TYPES)} (cuda:N)") from None
    if parsed.type not in DEVICE_TYPES:
        raise DeviceError(f"unsupported device {str(device)!r}; use one of {', '.join(DEVICE_TYPES)}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {str(device)!r}: CUDA is not available on this machine")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise DeviceError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device {str(device)!r}: MPS is not available on this machine")
    return parsed


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    training: bool = False,
) -> BlockDiffusionModel:
    """Load from a local folder (never the network), after `check_model_folder` and a memory budget check.

    For training, |<MASK>| and <|NULL|> are added if the checkpoint lacks them (embeddings are
    resized); for inference a checkpoint without them is refused.
    """
    path = Path(path)
    device = check_device(device)
    folder = check_model_folder(path)
    info = read_info(path)
    dtype = dtype or torch.float32
    size = folder.elements * torch.empty((), dtype=dtype).element_size()
    check_allocation(
        f"the model {path} ({folder.elements:,} weights in {str(dtype).removeprefix('torch.')})", size, device
    )
    try:
        tokenizer = load_tokenizer(path)
    except (TokenizerError, FileNotFoundError) as err:
        raise ModelFileError(str(err)) from None
    check_tokenizer_fits(folder, tokenizer, path, training)
    model_class = folder.model_class
    try:
        model = model_class.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        image_processor = None
        if model_class is Qwen2_5_VLForConditionalGeneration:
            image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as err:  # transformers' own, on damaged files
        raise ModelFileError(f"{path} could not be loaded: {str(err).splitlines()[0]}") from None
    wrapper = BlockDiffusionModel(model.to(device), tokenizer, image_processor, info)
    wrapper.source = path
    if training:
        ensure_diffusion_tokens(wrapper)
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


def ensure_diffusion_tokens(model: BlockDiffusionModel) -> DiffusionTokenIds:
    """Add |<MASK>| and <|NULL|> if missing, resizing the embeddings (and saying so)."""
    ids = add_diffusion_tokens(model.tokenizer)
    if len(model.tokenizer) > model.core.get_input_embeddings().num_embeddings:
        print(f"added {', '.join(ids.added)} to the tokenizer; resizing embeddings to {len(model.tokenizer)}")
        model.core.resize_token_embeddings(len(model.tokenizer))
    model.info.mask_token_id, model.info.null_token_id = ids.mask_id, ids.null_id
    return ids


def write_model_files(model: BlockDiffusionModel, folder: Path, core: PreTrainedModel | None = None) -> None:
    """Write safetensors weights, config, tokenizer, image processor and fastddrive.json into `folder`, each
    file flushed to disk (`folder` is a staging folder, renamed into place by the caller). `core` stands for the
    model's transformers model (a sharded model's, gathered whole)."""
    (core or model.core).save_pretrained(str(folder))
    model.tokenizer.save_pretrained(str(folder))
    if model.image_processor is not None:
        model.image_processor.save_pretrained(str(folder))
    (folder / INFO_FILE).write_text(json.dumps(asdict(model.info), indent=2))
    sync_files(folder)


def sync_files(folder: Path) -> None:
    """fsync every file under `folder` and the folder itself, before it is renamed into place."""
    for file in sorted(folder.rglob("*")):
        if file.is_file():
            with file.open("rb") as handle:
                os.fsync(handle.fileno())
    fsync_folder(folder)


def save_model(model: BlockDiffusionModel, path: str | Path, core: PreTrainedModel | None = None) -> None:
    """Write the model folder atomically: built beside `path`, swapped in whole (`outputs.staged_folder`)."""
    with staged_folder(path) as staging:
        write_model_files(model, staging, core)


def model_path(name: str) -> Path:
    """'default' (the embedded tiny-sasd), 'default-ar' (the embedded tiny-ar), 'default-jf' (the embedded
    tiny-jf), another folder under the package's assets, or a local folder."""
    from importlib.resources import files

    assets = Path(str(files("fastddrive") / "assets"))
    if name in EMBEDDED_MODELS:
        return assets / EMBEDDED_MODELS[name]
    return assets / name if (assets / name / "config.json").is_file() else Path(name)


def weights_bytes(folder: Path) -> int:
    """The size on disk of a model folder's weights (its *.safetensors files): what each process holding a copy
    of the model loads."""
    return sum(file.stat().st_size for file in folder.glob("*.safetensors"))


def read_info(path: Path) -> CheckpointInfo:
    """The folder's fastddrive.json (defaults without one), each key checked: one line naming a bad one."""
    file = path / INFO_FILE
    if not file.is_file():
        return CheckpointInfo(kind="block-diffusion")
    raw = read_json_object(file)
    known = {f.name for f in fields(CheckpointInfo)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ModelFileError(f"{file} is not a valid {INFO_FILE}: unknown key {unknown[0]!r}")
    checks = {
        "kind": (lambda v: v in ("block-diffusion", "autoregressive"), "'block-diffusion' or 'autoregressive'"),
        "mask_token_id": (_id_or_none, "a token id or null"),
        "null_token_id": (_id_or_none, "a token id or null"),
        "explanation_budget": (_size_or_none, "a positive integer or null"),
        "block_size": (_size_or_none, "a positive integer or null"),
        "scaffold_tokenization": (lambda v: v in SCAFFOLD_TOKENIZATIONS, "'pieces', 'runs' or 'release'"),
        "extra": (lambda v: isinstance(v, dict), "a JSON object"),
        "prompt": (lambda v: v in ("fastddrive", "release"), "'fastddrive' or 'release'"),
        "cameras": (
            lambda v: isinstance(v, list) and all(isinstance(c, str) and c for c in v) and len(set(v)) == len(v),
            "a list of distinct camera names ([] for one joined frame)",
        ),
    }
    for key, value in raw.items():
        valid, expected = checks.get(key, (lambda _: True, ""))
        if not valid(value):
            raise ModelFileError(f"{file}: {key} must be {expected}, got {value!r}")
    problem = record_problem(raw.get("extra", {}))
    if problem is not None:
        raise ModelFileError(f"{file}: {problem}")
    return CheckpointInfo(**raw)


def _id_or_none(value: object) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def _size_or_none(value: object) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


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
