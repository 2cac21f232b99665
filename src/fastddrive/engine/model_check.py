"""A model folder checked before anything loads it (issue 32): its config.json, its safetensors headers, and
the two against each other.

`check_model_folder` compares the tensors the safetensors headers list with the parameters of the model its
config.json describes (built on the meta device, without storage): a config and weights that disagree are
named in one line (the first missing, unexpected or mis-shaped tensor) instead of loading with layers silently
dropped or failing inside transformers. A pickle is never opened.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import (
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2ForCausalLM,
)

from fastddrive.engine.model import IMAGE_TOKEN

MODEL_CLASSES = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen2": Qwen2ForCausalLM}
# Model types users bring that fastddrive does not load as they are, and what to do instead (issue 34).
OTHER_MODEL_TYPES = {
    "qwen2_vl": "a Qwen2-VL model, which fastddrive does not run (its vision tower differs from Qwen2.5-VL's: no "
    "window attention, LayerNorm instead of RMSNorm); use a Qwen2.5-VL checkpoint",
    "fast_dllm_qwen2_5_vl": "an official Fast-dDrive release folder, whose remote code is never run; convert it "
    "with `fastddrive import-official SRC OUT` and load OUT",
    "fast_dvlm": "an official Fast-dVLM release folder, whose remote code is never run; convert it with "
    "`fastddrive import-official SRC OUT` and load OUT",
}
# The config.json sizes that shape the weights, at the top level or in text_config, and in vision_config.
TEXT_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "head_dim",
)
VISION_SIZES = (
    "depth",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "out_hidden_size",
    "patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "in_channels",
    "window_size",
)
# config.json's ids of the tokens that place an image in a prompt, and those tokens.
VISION_TOKENS = {
    "image_token_id": IMAGE_TOKEN,
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
# Bounds on sizes checked before the model is built: layer counts (the meta-device model is built one module a
# layer) and settings that shape no weight but a forward's buffers, so that a damaged value cannot run or
# allocate without end.
SIZE_LIMITS = {"num_hidden_layers": 1024, "depth": 1024, "window_size": 16384, "max_position_embeddings": 1 << 24}


class ModelFileError(ValueError):
    """A model folder that cannot be loaded: a file missing, unreadable, damaged or not safetensors."""


def read_json_object(file: Path) -> dict:
    """A JSON file that must hold an object: one line naming the file otherwise."""
    try:
        value = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ModelFileError(f"{file} is not UTF-8 text; it must be a JSON object") from None
    except (ValueError, RecursionError) as err:  # also numbers of thousands of digits, arrays nested thousands deep
        raise ModelFileError(f"{file} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ModelFileError(f"{file} is not a JSON object")
    return value


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of the model's weights: model.safetensors, or the shards its index names."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ModelFileError(f"{index}: weight_map must map tensor names to file names")
        files = [path / name for name in sorted(set(weight_map.values()))]
        if any(Path(name).name != name for name in weight_map.values()):
            raise ModelFileError(f"{index}: weight_map names a file outside {path}")
        for file in files:
            if not file.is_file():
                raise ModelFileError(f"{file} is missing (named by {index.name})")
        return files
    if not (path / "model.safetensors").is_file():
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" ({', '.join(pickles)} found: only safetensors are loaded, never pickles)" if pickles else ""
        raise ModelFileError(f"{path} holds no model.safetensors{hint}")
    return [path / "model.safetensors"]


def safetensors_tensors(file: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of a safetensors file, name -> (dtype, shape), read from its header alone, after checking
    that the header parses and the tensors it lists fit inside the file (a truncated copy does not)."""
    size = file.stat().st_size
    try:
        with file.open("rb") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            if header_size <= 0 or 8 + header_size > size:
                raise ValueError("its header is cut short")
            header = json.loads(handle.read(header_size))
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
        end = max(ends, default=0)
        if not isinstance(end, int):
            raise ValueError("its header's data offsets are not integers")
    except (ValueError, RecursionError, KeyError, TypeError, IndexError, AttributeError) as err:
        raise ModelFileError(f"{file} is not a readable safetensors file: {err}") from None
    if 8 + header_size + end > size:
        raise ModelFileError(f"{file} is truncated: {size} bytes where its header needs {8 + header_size + end}")
    try:
        with safe_open(str(file), framework="pt") as handle:
            names = list(handle.keys())
            return {name: (handle.get_slice(name).get_dtype(), handle.get_slice(name).get_shape()) for name in names}
    except (SafetensorError, ValueError, OSError) as err:
        raise ModelFileError(f"{file} is not a readable safetensors file: {str(err).splitlines()[0]}") from None


def _positive_sizes(config: dict, file: Path) -> None:
    """The sizes that shape the weights are positive integers (a negative one is a torch traceback later)."""
    sections = [("", config, TEXT_SIZES)]
    for key, sizes in (("text_config", TEXT_SIZES), ("vision_config", VISION_SIZES)):
        if key in config:
            if not isinstance(config[key], dict):
                raise ModelFileError(f"{file}: {key} must be a JSON object, got {type(config[key]).__name__}")
            sections.append((f"{key}.", config[key], sizes))
    for prefix, section, sizes in sections:
        for key in sizes:
            value = section.get(key)
            if key in section and (value is None and key == "head_dim"):
                continue
            if key in section and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ModelFileError(f"{file}: {prefix}{key} must be a positive integer, got {value!r}")
            if key in section and value > SIZE_LIMITS.get(key, value):
                raise ModelFileError(f"{file}: {prefix}{key} must be at most {SIZE_LIMITS[key]}, got {value}")


def _model_class(config: dict, file: Path) -> type[torch.nn.Module]:
    """The transformers class of config.json's `model_type`; one line naming the type when fastddrive does not
    load it (and what to do for the types users bring: OTHER_MODEL_TYPES)."""
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in OTHER_MODEL_TYPES:
        raise ModelFileError(f"{file}: model_type {model_type!r} is {OTHER_MODEL_TYPES[model_type]}")
    if not isinstance(model_type, str) or model_type not in MODEL_CLASSES:
        known = ", ".join(MODEL_CLASSES)
        raise ModelFileError(f"{file}: model_type {model_type!r} is not a model fastddrive loads ({known})")
    return MODEL_CLASSES[model_type]


def meta_model(config: dict, file: Path) -> torch.nn.Module:
    """The model `config` describes, built on the meta device: its parameters have shapes and no storage."""
    model_class = _model_class(config, file)
    _positive_sizes(config, file)
    try:
        built = model_class.config_class.from_dict(config)
    except StrictDataclassError as err:  # transformers' own type checks, which name the key
        raise ModelFileError(f"{file}: {err.__cause__ or str(err).splitlines()[0]}") from None
    except Exception as err:  # noqa: BLE001 - any failure to read a user's config is that config's fault
        raise ModelFileError(f"{file} does not describe a model: {str(err).splitlines()[0]}") from None
    try:
        with torch.device("meta"):
            return model_class(built)
    except Exception as err:  # noqa: BLE001 - as above: sizes transformers cannot build a model with
        raise ModelFileError(f"{file} does not describe a model: {str(err).splitlines()[0]}") from None


def _check_runnable(config: PretrainedConfig, file: Path) -> None:
    """Settings a model can be built with but not run: Qwen2.5-VL's rotary sections must fill the text head,
    its vision heads must split into 2D rotary quarters, its special tokens must be in the vocabulary."""
    if not isinstance(config, Qwen2_5_VLConfig):
        return
    text, vision = config.text_config, config.vision_config
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    section = (text.rope_parameters or {}).get("mrope_section")
    if section is not None and (
        not isinstance(section, list) or not all(isinstance(s, int) for s in section) or 2 * sum(section) != head
    ):
        raise ModelFileError(f"{file}: text_config.rope_parameters.mrope_section {section!r} must sum to {head // 2}")
    if vision.hidden_size % vision.num_heads or (vision.hidden_size // vision.num_heads) % 4:
        raise ModelFileError(
            f"{file}: vision_config.hidden_size {vision.hidden_size} must be num_heads ({vision.num_heads}) times a "
            "multiple of 4"
        )
    if vision.out_hidden_size != text.hidden_size:
        raise ModelFileError(
            f"{file}: vision_config.out_hidden_size {vision.out_hidden_size} must equal the text hidden_size "
            f"{text.hidden_size}"
        )
    if not all(isinstance(i, int) and 0 <= i < vision.depth for i in vision.fullatt_block_indexes or []):
        raise ModelFileError(
            f"{file}: vision_config.fullatt_block_indexes {vision.fullatt_block_indexes!r} must be block numbers "
            f"below depth {vision.depth}"
        )
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        value = getattr(config, key, None)
        if value is not None and not 0 <= value < text.vocab_size:
            raise ModelFileError(f"{file}: {key} {value} is outside the vocabulary (vocab_size {text.vocab_size})")


def _loaded_names(model: torch.nn.Module, names: list[str]) -> dict[str, str] | None:
    """The model parameter each weight file tensor loads into, renamed as transformers renames them (older
    layouts such as Qwen2.5-VL's `model.layers.*`); None where this transformers renames otherwise."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        expected = model.state_dict()
        loaded = {}
        for name in names:
            renamed, converted = rename_source_key(name, renamings, converters, model.base_model_prefix, expected)
            if renamed not in expected and name in expected:
                renamed, converted = rename_source_key(name, [], [], model.base_model_prefix, expected)
            if converted is not None:  # merged or split on loading: its shape is not the parameter's
                return None
            loaded[name] = renamed
    except (ImportError, TypeError, AttributeError):
        return None
    return loaded


def check_tensors(model: torch.nn.Module, tensors: dict[str, tuple[str, list[int]]], path: Path) -> None:
    """Every tensor of the weights has a parameter of the same shape in the model config.json describes, and
    every parameter is in the weights (or tied to one that is): the first mismatch is named."""
    loaded = _loaded_names(model, sorted(tensors))
    if loaded is None:
        return
    state = model.state_dict()
    expected = {name: list(value.shape) for name, value in state.items()}
    ignored_unexpected = [
        r"rotary_emb\.inv_freq",
        r"(^|\.)position_ids$",
        *(model._keys_to_ignore_on_load_unexpected or []),
    ]
    where = f"{path}: config.json and the weights disagree"
    described = "the model described by config.json"
    for name in sorted(tensors, key=_natural):
        dtype, found = tensors[name][0], list(tensors[name][1])
        target = loaded[name]
        if target not in expected:
            if not any(re.search(pattern, name) for pattern in ignored_unexpected):
                raise ModelFileError(
                    f"{where}: the weights hold {name}, a tensor {described} does not have{_hint(name, model)}"
                )
        elif expected[target] != found:
            raise ModelFileError(f"{where}: {name} is {found} in the weights but {expected[target]} in {described}")
        elif state[target].is_floating_point() and not dtype.startswith(("F", "BF")):
            raise ModelFileError(f"{path}: {name} holds {dtype} numbers where the model has floating-point weights")
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    buffers = {name for name, _ in model.named_buffers()}
    ignored_missing = list(model._keys_to_ignore_on_load_missing or [])
    present = set(loaded.values())
    for name in sorted(expected, key=_natural):
        if name in present or name in tied or name in buffers or any(re.search(p, name) for p in ignored_missing):
            continue
        raise ModelFileError(f"{where}: the weights lack {name}, which {described} has{_hint(name, model)}")


def _natural(name: str) -> list[int | str]:
    """Sort key that puts layers.2 before layers.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _hint(name: str, model: torch.nn.Module) -> str:
    """The config.json setting a layer's tensor depends on, for a layer the config and the weights disagree on."""
    config = model.config
    if re.search(r"\.layers\.\d+\.", name):
        return f" (config.json: num_hidden_layers {config.get_text_config().num_hidden_layers})"
    if re.search(r"\.blocks\.\d+\.", name) and getattr(config, "vision_config", None) is not None:
        return f" (config.json: vision_config.depth {config.vision_config.depth})"
    return ""


@dataclass(frozen=True)
class ModelFolder:
    """A model folder checked without reading its weights: its config, the transformers class that loads it,
    the number of weight elements and the text model's sizes."""

    config: dict
    model_class: type
    elements: int
    vocab_size: int
    hidden_size: int
    layers: int


def check_model_folder(path: str | Path) -> ModelFolder:
    """Check a model folder before anything loads it: config.json is a JSON object whose sizes build a model,
    the weights are safetensors whose headers fit their files, and every tensor the weights hold is one of
    that model's parameters with its shape (and every parameter is there). One line names the first problem;
    a pickle is never opened."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelFileError(f"{path} is not a model folder: config.json is missing")
    config = read_json_object(path / "config.json")
    _model_class(config, path / "config.json")  # a foreign model type is named before any weight is read
    tensors: dict[str, tuple[str, list[int]]] = {}
    for file in weight_files(path):
        tensors |= safetensors_tensors(file)
    model = meta_model(config, path / "config.json")
    check_tensors(model, tensors, path)
    _check_runnable(model.config, path / "config.json")
    text = model.config.get_text_config()
    elements = sum(math.prod(shape) for _, shape in tensors.values())
    return ModelFolder(config, type(model), elements, text.vocab_size, text.hidden_size, text.num_hidden_layers)


def check_tokenizer_fits(folder: ModelFolder, tokenizer: PreTrainedTokenizerBase, path: Path, training: bool) -> None:
    """config.json's image and vision tokens are the tokenizer's (else images are placed wrongly, silently), and
    the tokenizer's ids index the embeddings (training resizes them instead)."""
    vocab = tokenizer.get_vocab()
    if folder.model_class is Qwen2_5_VLForConditionalGeneration:
        for key, token in VISION_TOKENS.items():
            if key in folder.config and folder.config[key] != vocab.get(token):
                raise ModelFileError(
                    f"{path / 'config.json'}: {key} is {folder.config[key]!r} but the tokenizer's {token} is "
                    f"{vocab.get(token)!r}; config and tokenizer are of different models"
                )
    if not training and len(tokenizer) > folder.vocab_size:
        raise ModelFileError(
            f"{path}: the tokenizer has {len(tokenizer)} tokens, more than the model's vocab_size {folder.vocab_size}"
        )
