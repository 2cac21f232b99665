"""Model folders: load and save a BlockDiffusionModel, find the embedded checkpoints, build tiny ones.

A folder is what transformers' `save_pretrained` writes (safetensors weights, config, tokenizer, image
processor) plus `fastddrive.json` (`CheckpointInfo`). Loading never reaches the network; a real
Qwen2.5-VL-3B folder and the embedded tiny checkpoints go through the same code.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import (
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2ForCausalLM,
    Qwen2VLImageProcessorPil,
)

from fastddrive.model import IMAGE_TOKEN, BlockDiffusionModel, CheckpointInfo
from fastddrive.tokenizer import (
    DiffusionTokenIds,
    MissingDiffusionTokens,
    add_diffusion_tokens,
    diffusion_token_ids,
    load_tokenizer,
)

INFO_FILE = "fastddrive.json"
DEVICE_TYPES = ("cpu", "cuda", "mps")
EMBEDDED_MODELS = {"default": "tiny-sasd", "default-ar": "tiny-ar", "default-jf": "tiny-jf"}


class ModelFileError(ValueError):
    """A model folder that cannot be loaded: a file missing, unreadable, damaged or not safetensors."""


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


def _check_folder(path: Path) -> dict:
    """The folder's config, after checking that its files are there and readable: one line naming the file
    otherwise. Weights must be safetensors (a pickle is never loaded)."""
    if not (path / "config.json").is_file():
        raise ModelFileError(f"{path} is not a model folder: config.json is missing")
    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelFileError(f"{path / 'config.json'} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{path / 'config.json'} is not a JSON object")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" ({', '.join(pickles)} found: only safetensors are loaded, never pickles)" if pickles else ""
        raise ModelFileError(f"{path} holds no model.safetensors{hint}")
    for file in weights:
        _check_safetensors(file)
    return config


def _check_safetensors(file: Path) -> None:
    """The header parses and the tensors it lists fit inside the file (a truncated copy does not)."""
    size = file.stat().st_size
    try:
        with file.open("rb") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            if header_size <= 0 or 8 + header_size > size:
                raise ValueError("its header is cut short")
            header = json.loads(handle.read(header_size))
    except (ValueError, UnicodeDecodeError) as err:
        raise ModelFileError(f"{file} is not a readable safetensors file: {err}") from None
    end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0)
    if 8 + header_size + end > size:
        raise ModelFileError(f"{file} is truncated: {size} bytes where its header needs {8 + header_size + end}")


def load_model(
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
    device = check_device(device)
    config = _check_folder(path)
    info = read_info(path)
    model_class = Qwen2_5_VLForConditionalGeneration if config.get("model_type") == "qwen2_5_vl" else Qwen2ForCausalLM
    try:
        tokenizer = load_tokenizer(path)
        model = model_class.from_pretrained(str(path), dtype=dtype or torch.float32, local_files_only=True)
        image_processor = None
        if model_class is Qwen2_5_VLForConditionalGeneration:
            image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:  # transformers' own errors on damaged or missing files
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


def save_model(model: BlockDiffusionModel, path: str | Path) -> None:
    """Write safetensors weights, config, tokenizer, image processor and fastddrive.json atomically."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.core.save_pretrained(str(tmp))
    model.tokenizer.save_pretrained(str(tmp))
    if model.image_processor is not None:
        model.image_processor.save_pretrained(str(tmp))
    (tmp / INFO_FILE).write_text(json.dumps(asdict(model.info), indent=2))
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old)
    else:
        os.replace(tmp, path)


def model_path(name: str) -> Path:
    """'default' (the embedded tiny-sasd), 'default-ar' (the embedded tiny-ar), 'default-jf' (the embedded
    tiny-jf), another folder under the package's assets, or a local folder."""
    from importlib.resources import files

    assets = Path(str(files("fastddrive") / "assets"))
    if name in EMBEDDED_MODELS:
        return assets / EMBEDDED_MODELS[name]
    return assets / name if (assets / name / "config.json").is_file() else Path(name)


def read_info(path: Path) -> CheckpointInfo:
    file = path / INFO_FILE
    if not file.is_file():
        return CheckpointInfo(kind="block-diffusion")
    try:
        return CheckpointInfo(**json.loads(file.read_text()))
    except (json.JSONDecodeError, TypeError) as err:
        raise ModelFileError(f"{file} is not a valid {INFO_FILE}: {err}") from None


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
