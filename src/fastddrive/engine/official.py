"""Import an official Fast-dDrive (or Fast-dVLM) release folder as a fastddrive model folder (issue 34).

The release is a Qwen2.5-VL-3B whose config names remote code (`model_type` `fast_dllm_qwen2_5_vl` or
`fast_dvlm`, an `auto_map`); that code is not published and is never run here. What the release holds is a
plain Qwen2.5-VL: the same tensors under either the legacy names (`model.layers.N.*`, `model.embed_tokens`,
`model.norm`, `visual.*`, `lm_head`) or the current ones (`model.language_model.*`, `model.visual.*`, the head
tied), and the block-diffusion settings (`bd_size`, `use_block_causal_mask`, `complementary_mask`) in its text
config. The import:

1. rewrites the config to plain `qwen2_5_vl` (the release's own keys go to `fastddrive.json`'s `extra`), and
   refuses a key it cannot map, naming it;
2. renames the weights to the current names (values untouched, safetensors only: a pickle is refused, never
   opened), checks every tensor against the model the config describes, and keeps a tied head tied;
3. checks `|<MASK>|` and `<|NULL|>` in the tokenizer (adding them where their embedding rows exist, at the
   release's ids 151665 and 151666);
4. sets the image processor to the release's pixels (min = max = 200,704 per camera) and writes
   `fastddrive.json` (block-diffusion, block size 32, the release's 192-token explanation budget, and its
   three separate cameras FRONT_LEFT, FRONT, FRONT_RIGHT, and its prompt: `core/release_prompt.py`).

Choices where the release is silent are written in docs/data.md ("The official checkpoint").
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen2_5_VLConfig, Qwen2VLImageProcessorPil

from fastddrive.core.outputs import check_folder_destination, staged_folder
from fastddrive.core.tokenizer import MASK_TOKEN, NULL_TOKEN, add_diffusion_tokens, load_tokenizer
from fastddrive.engine.model import CheckpointInfo
from fastddrive.engine.model_check import (
    ModelFileError,
    check_tensors,
    meta_model,
    read_json_object,
    safetensors_tensors,
    weight_files,
)
from fastddrive.engine.model_files import INFO_FILE, sync_files

OFFICIAL_MODEL_TYPES = ("fast_dllm_qwen2_5_vl", "fast_dvlm")
RELEASE_MASK_ID, RELEASE_NULL_ID = 151_665, 151_666
RELEASE_BLOCK_SIZE = 32
RELEASE_EXPLANATION_BUDGET = 192  # 6 blocks of 32
RELEASE_PIXELS = 200_704  # per camera: min_pixels = max_pixels (448 x 448 px for a square frame: 256 image tokens)
RELEASE_CAMERAS = ["FRONT_LEFT", "FRONT", "FRONT_RIGHT"]  # three separate images in one user turn
# The release's own settings: kept in fastddrive.json, not in the plain Qwen2.5-VL config.
RELEASE_KEYS = ("bd_size", "use_block_causal_mask", "complementary_mask")
DROPPED_KEYS = ("auto_map",)  # remote code: never run
# Legacy tensor names -> current ones (transformers' own renaming of Qwen2.5-VL checkpoints).
RENAMES = (
    (re.compile(r"^model\.(?!language_model\.|visual\.)"), "model.language_model."),
    (re.compile(r"^visual\."), "model.visual."),
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


class OfficialImportError(ModelFileError):
    """Something of a release folder that the import cannot map; the message names it (exit status 2)."""


@dataclass
class ImportReport:
    """What `import_official` mapped: the source type, tensors renamed and kept, tokens added, keys moved."""

    source_type: str
    tensors: int
    renamed: int
    head: str  # "tied" (the head is the embedding) or "separate"
    tokens_added: list[str] = field(default_factory=list)
    release_settings: dict[str, Any] = field(default_factory=dict)
    out: Path | None = None


def rename(name: str) -> str:
    """The current Qwen2.5-VL name of a release tensor name (legacy or current)."""
    for pattern, target in RENAMES:
        name = pattern.sub(target, name)
    return name


def plain_config(config: dict[str, Any], file: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the config as plain `qwen2_5_vl`, the release's own settings); OfficialImportError naming a key it
    cannot map."""
    model_type = config.get("model_type")
    if model_type not in OFFICIAL_MODEL_TYPES:
        raise OfficialImportError(
            f"{file}: model_type {model_type!r} is not an official release's ({', '.join(OFFICIAL_MODEL_TYPES)})"
        )
    known_top = set(Qwen2_5_VLConfig().to_dict()) | {"torch_dtype", "use_cache", "rope_scaling", "rope_theta"}
    known_text = set(Qwen2_5_VLConfig().text_config.to_dict()) | {"torch_dtype", "rope_scaling", "rope_theta"}
    known_top |= known_text  # a legacy config keeps the text sizes at the top level
    plain = {k: v for k, v in config.items() if k not in DROPPED_KEYS}
    release = {k: plain.pop(k) for k in RELEASE_KEYS if k in plain}
    text = dict(plain.get("text_config") or {})
    release |= {k: text.pop(k) for k in RELEASE_KEYS if k in text}
    for key in plain:
        if key not in known_top:
            raise OfficialImportError(f"{file}: key {key!r} is not a Qwen2.5-VL setting and not one the import knows")
    for key in text:
        if key not in known_text:
            raise OfficialImportError(
                f"{file}: text_config.{key} is not a Qwen2.5-VL setting and not one the import knows"
            )
    if text:
        text["model_type"] = "qwen2_5_vl_text"
        plain["text_config"] = text
    plain["model_type"] = "qwen2_5_vl"
    plain["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    block = release.get("bd_size", RELEASE_BLOCK_SIZE)
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise OfficialImportError(f"{file}: bd_size {block!r} is not a block size")
    return plain, release


def _read_weights(src: Path) -> dict[str, tuple[Path, str, list[int], str]]:
    """Every release tensor: current name -> (file, release name, shape, dtype); pickles are refused unread."""
    files = weight_files(src)
    weights: dict[str, tuple[Path, str, list[int], str]] = {}
    for file in files:
        for name, (dtype, shape) in safetensors_tensors(file).items():
            current = rename(name)
            if current in weights:
                raise OfficialImportError(
                    f"{file}: tensor {name!r} and {weights[current][1]!r} both map to {current!r}"
                )
            weights[current] = (file, name, shape, dtype)
    return weights


def _head(config: dict[str, Any], weights: dict[str, tuple[Path, str, list[int], str]]) -> str:
    """'tied' or 'separate'; a release whose config ties the head but whose head differs is refused."""
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False))
    if not tied or "lm_head.weight" not in weights:
        return "tied" if tied else "separate"
    embed = weights.get("model.language_model.embed_tokens.weight")
    head = weights["lm_head.weight"]
    if embed is None or not torch.equal(_tensor(*embed[:2]), _tensor(*head[:2])):
        raise OfficialImportError(f"{head[0]}: lm_head.weight differs from the embedding, but the config ties them")
    del weights["lm_head.weight"]  # the tied head is the embedding: saved once, as transformers saves it
    return "tied"


def _tensor(file: Path, name: str) -> torch.Tensor:
    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(name)


def _tokenizer(src: Path, tokenizer_dir: Path | None, vocab_rows: int, file: Path) -> tuple[Any, list[str]]:
    """The release's tokenizer with |<MASK>| and <|NULL|> at the release's ids (added when missing, if their
    embedding rows exist)."""
    folder = tokenizer_dir or src
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise OfficialImportError(
            f"{folder}: no tokenizer files; give --tokenizer with Qwen2.5-VL-3B-Instruct's tokenizer"
        )
    tokenizer = load_tokenizer(folder)
    ids = add_diffusion_tokens(tokenizer)
    got = (ids.mask_id, ids.null_id)
    if got != (RELEASE_MASK_ID, RELEASE_NULL_ID):
        raise OfficialImportError(
            f"{folder}: {MASK_TOKEN} and {NULL_TOKEN} are ids {got}, not the release's "
            f"({RELEASE_MASK_ID}, {RELEASE_NULL_ID}); this tokenizer is not the release's"
        )
    if max(got) >= vocab_rows:
        raise OfficialImportError(
            f"{file}: vocab_size {vocab_rows} has no rows for {MASK_TOKEN} and {NULL_TOKEN} {got}"
        )
    return tokenizer, list(ids.added)


def import_official(
    src: str | Path, out: str | Path, tokenizer: str | Path | None = None, say: Callable[[str], None] = print
) -> ImportReport:
    """Convert the release folder `src` into the fastddrive model folder `out` (module doc); every check runs
    before anything is written, and `out` appears whole or not at all."""
    src, out = Path(src), Path(out)
    if not (src / "config.json").is_file():
        raise OfficialImportError(f"{src} is not a model folder: config.json is missing")
    check_folder_destination(out, "OUT", inputs=(src, tokenizer))
    config_file = src / "config.json"
    config, release = plain_config(read_json_object(config_file), config_file)
    weights = _read_weights(src)
    renamed = sum(name != original for name, (_, original, _, _) in weights.items())
    head = _head(config, weights)
    model = meta_model(config, config_file)
    check_tensors(model, {k: (dtype, shape) for k, (_, _, shape, dtype) in weights.items()}, src)
    vocab_rows = model.config.get_text_config().vocab_size
    text_tokenizer, added = _tokenizer(src, Path(tokenizer) if tokenizer else None, vocab_rows, config_file)
    source_type = read_json_object(config_file)["model_type"]
    info = CheckpointInfo(
        kind="block-diffusion",
        mask_token_id=RELEASE_MASK_ID,
        null_token_id=RELEASE_NULL_ID,
        explanation_budget=RELEASE_EXPLANATION_BUDGET,
        block_size=int(release.get("bd_size", RELEASE_BLOCK_SIZE)),
        scaffold_tokenization="release",
        extra={"imported_from": source_type, "release_settings": release, "camera_pixels": RELEASE_PIXELS},
        cameras=list(RELEASE_CAMERAS),
        prompt="release",
    )
    with staged_folder(out) as stage:
        _write_weights(weights, stage)
        (stage / "config.json").write_text(json.dumps(config, indent=2))
        text_tokenizer.save_pretrained(str(stage))
        processor = Qwen2VLImageProcessorPil(min_pixels=RELEASE_PIXELS, max_pixels=RELEASE_PIXELS)
        processor.save_pretrained(str(stage))
        (stage / INFO_FILE).write_text(json.dumps(asdict(info), indent=2))
        sync_files(stage)
    report = ImportReport(source_type, len(weights), renamed, head, added, release, out)
    say(
        f"imported {source_type} from {src}: {report.tensors} tensors ({renamed} renamed to the current names), "
        f"head {head}, {', '.join(added) or 'no tokens'} added, release settings {release or 'none'} kept in "
        f"{INFO_FILE}; wrote {out}"
    )
    return report


def _write_weights(weights: dict[str, tuple[Path, str, list[int], str]], folder: Path) -> None:
    """The tensors under their current names, one output file per source file (the values as they are)."""
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for current, (file, original, _, _) in weights.items():
        by_file.setdefault(file, []).append((current, original))
    names = sorted(by_file)
    index: dict[str, str] = {}
    for k, file in enumerate(names):
        target = "model.safetensors" if len(names) == 1 else f"model-{k + 1:05d}-of-{len(names):05d}.safetensors"
        with safe_open(str(file), framework="pt") as handle:
            tensors = {current: handle.get_tensor(original).contiguous() for current, original in by_file[file]}
        save_file(tensors, str(folder / target), metadata={"format": "pt"})
        index |= dict.fromkeys(tensors, target)
    if len(names) > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
