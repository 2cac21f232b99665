"""Model folders: load and save a BlockDiffusionModel, find the embedded checkpoints, build tiny ones.

A folder is what transformers' `save_pretrained` writes (safetensors weights, config, tokenizer, image
processor) plus `fastddrive.json` (`CheckpointInfo`). Loading never reaches the network; a real
Qwen2.5-VL-3B folder and the embedded tiny checkpoints go through the same code. Before transformers reads
a folder, `check_model_folder` compares the tensors its safetensors headers list with the parameters of the
model its config.json describes (built on the meta device, without storage): a config and weights that
disagree are named in one line instead of loading with layers silently dropped (issue 32). Saving is atomic.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, fields
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
    Qwen2VLImageProcessorPil,
)

from fastddrive.memory import check_allocation
from fastddrive.model import IMAGE_TOKEN, BlockDiffusionModel, CheckpointInfo
from fastddrive.outputs import fsync_folder, staged_folder
from fastddrive.tokenizer import (
    DiffusionTokenIds,
    MissingDiffusionTokens,
    TokenizerError,
    add_diffusion_tokens,
    diffusion_token_ids,
    load_tokenizer,
)

INFO_FILE = "fastddrive.json"
DEVICE_TYPES = ("cpu", "cuda", "mps")
EMBEDDED_MODELS = {"default": "tiny-sasd", "default-ar": "tiny-ar", "default-jf": "tiny-jf"}
MODEL_CLASSES = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen2": Qwen2ForCausalLM}
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


def _read_json_object(file: Path) -> dict:
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


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of the model's weights: model.safetensors, or the shards its index names."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json_object(index).get("weight_map")
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


def _check_safetensors(file: Path) -> dict[str, tuple[str, list[int]]]:
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


def _meta_model(config: dict, file: Path) -> torch.nn.Module:
    """The model `config` describes, built on the meta device: its parameters have shapes and no storage."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_CLASSES:
        known = ", ".join(MODEL_CLASSES)
        raise ModelFileError(f"{file}: model_type {model_type!r} is not a model fastddrive loads ({known})")
    _positive_sizes(config, file)
    model_class = MODEL_CLASSES[model_type]
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


def _check_tensors(model: torch.nn.Module, tensors: dict[str, tuple[str, list[int]]], path: Path) -> None:
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
    config = _read_json_object(path / "config.json")
    tensors: dict[str, tuple[str, list[int]]] = {}
    for file in _weight_files(path):
        tensors |= _check_safetensors(file)
    model = _meta_model(config, path / "config.json")
    _check_tensors(model, tensors, path)
    _check_runnable(model.config, path / "config.json")
    text = model.config.get_text_config()
    elements = sum(math.prod(shape) for _, shape in tensors.values())
    return ModelFolder(config, type(model), elements, text.vocab_size, text.hidden_size, text.num_hidden_layers)


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
    _check_tokenizer_fits(folder, tokenizer, path, training)
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


def _check_tokenizer_fits(folder: ModelFolder, tokenizer: PreTrainedTokenizerBase, path: Path, training: bool) -> None:
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


def ensure_diffusion_tokens(model: BlockDiffusionModel) -> DiffusionTokenIds:
    """Add |<MASK>| and <|NULL|> if missing, resizing the embeddings (and saying so)."""
    ids = add_diffusion_tokens(model.tokenizer)
    if len(model.tokenizer) > model.core.get_input_embeddings().num_embeddings:
        print(f"added {', '.join(ids.added)} to the tokenizer; resizing embeddings to {len(model.tokenizer)}")
        model.core.resize_token_embeddings(len(model.tokenizer))
    model.info.mask_token_id, model.info.null_token_id = ids.mask_id, ids.null_id
    return ids


def write_model_files(model: BlockDiffusionModel, folder: Path) -> None:
    """Write safetensors weights, config, tokenizer, image processor and fastddrive.json into `folder`, each
    file flushed to disk (`folder` is a staging folder, renamed into place by the caller)."""
    model.core.save_pretrained(str(folder))
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


def save_model(model: BlockDiffusionModel, path: str | Path) -> None:
    """Write the model folder atomically: built beside `path`, swapped in whole (`outputs.staged_folder`)."""
    with staged_folder(path) as staging:
        write_model_files(model, staging)


def model_path(name: str) -> Path:
    """'default' (the embedded tiny-sasd), 'default-ar' (the embedded tiny-ar), 'default-jf' (the embedded
    tiny-jf), another folder under the package's assets, or a local folder."""
    from importlib.resources import files

    assets = Path(str(files("fastddrive") / "assets"))
    if name in EMBEDDED_MODELS:
        return assets / EMBEDDED_MODELS[name]
    return assets / name if (assets / name / "config.json").is_file() else Path(name)


def read_info(path: Path) -> CheckpointInfo:
    """The folder's fastddrive.json (defaults without one), each key checked: one line naming a bad one."""
    file = path / INFO_FILE
    if not file.is_file():
        return CheckpointInfo(kind="block-diffusion")
    raw = _read_json_object(file)
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
        "scaffold_tokenization": (lambda v: v in ("pieces", "runs"), "'pieces' or 'runs'"),
        "extra": (lambda v: isinstance(v, dict), "a JSON object"),
    }
    for key, value in raw.items():
        valid, expected = checks.get(key, (lambda _: True, ""))
        if not valid(value):
            raise ModelFileError(f"{file}: {key} must be {expected}, got {value!r}")
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
