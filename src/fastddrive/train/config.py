"""Training configuration: small YAML presets validated by pydantic (an unknown key is an error)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from fastddrive.schema import SECTIONS


class ConfigError(ValueError):
    """A training configuration that cannot be used, with the reason."""


class TinyArchitecture(BaseModel):
    """Sizes of a Qwen2.5-VL built from scratch (the embedded default)."""

    model_config = ConfigDict(extra="forbid")

    hidden_size: int = 192
    layers: int = 4
    heads: int = 6
    kv_heads: int = 2
    intermediate_size: int = 512
    vision_hidden_size: int = 96
    vision_depth: int = 2
    vision_heads: int = 2


class TrainConfig(BaseModel):
    """One training run. `recipe`: `ar` (causal LM loss only, the AR baseline), `sasd` (paper 000 section
    3.2 on the dual-stream objective of paper 002 section 3.3) or `jf` (Jacobi Forcing, paper 003 section
    3.1: an AR model trained on its own Jacobi trajectories; it stays an AR model)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    recipe: Literal["ar", "sasd", "jf"]
    init_from: str = Field(description="'scratch', 'embedded:NAME', or a local checkpoint folder")
    data: str = "runs/sim"
    out: str = "runs/model"
    architecture: TinyArchitecture = TinyArchitecture()
    image_max_pixels: int = Field(default=224 * 112, gt=0)
    steps: int = Field(default=2000, ge=1)
    batch_size: int = Field(default=8, ge=1)
    lr: float = Field(default=1e-3, gt=0, allow_inf_nan=False)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=100, ge=0)
    weight_decay: float = Field(default=0.01, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)
    dtype: Literal["float32", "bfloat16"] = "float32"
    block_size: int = Field(default=32, ge=1)
    anneal_block_size: bool = True
    alpha: float = 0.5
    beta: float = 0.5
    section_weights: dict[str, float] = {
        "critical_objects": 1.5,
        "explanation": 1.0,
        "future_meta_behavior": 2.0,
        "trajectory": 3.0,
    }
    # Weights of the causal LM (clean stream) loss per response section; all 1 is the plain mean. The
    # embedded presets raise the trajectory's, whose digit tokens carry the driving error.
    ar_section_weights: dict[str, float] = dict.fromkeys(SECTIONS, 1.0)
    section_noise: dict[str, tuple[float, float]] = {
        "critical_objects": (1.0, 2.0),
        "explanation": (1.0, 1.0),
        "future_meta_behavior": (1.0, 1.5),
        "trajectory": (2.0, 1.0),
    }
    # Jacobi Forcing: the trajectories folder (`fastddrive trajectories`), the block size it was collected
    # at, the window w of the progressive noise schedule (Eq. 7) and the AR loss weight w of Eq. 9.
    trajectories: str | None = Field(default=None, validate_default=True)
    jacobi_block_size: int = Field(default=16, ge=1)
    noise_window: int = Field(default=16, ge=1)
    ar_weight: float = Field(default=1.0, ge=0)
    # Jacobi Forcing: weight of a causal LM loss on a batch of the data's own labelled answers (its train split),
    # added at every step; 0 leaves it out. Eq. 9's AR loss reads only the teacher's answers, on which a small
    # student drifts (its greedy answers stop parsing); the labels keep its clean predictions on the task.
    labelled_ar_weight: float = Field(default=0.0, ge=0)
    # Leave out trajectories whose fixed point does not parse as a driving answer (tests of random
    # teachers, whose answers never parse, keep them).
    skip_unparsed: bool = True
    explanation_budget: int = Field(default=32, ge=1)
    scaffold_tokenization: Literal["pieces", "runs"] = "pieces"  # "runs" for real BPE vocabularies (scaffold.py)
    checkpoint_every: int = Field(default=200, ge=1)
    keep_checkpoints: int = Field(default=2, ge=1)
    validate_every: int = Field(default=200, ge=1)
    validation_samples: int = Field(default=16, ge=1)
    log_every: int = Field(default=10, ge=1)
    seed: int = 0

    @field_validator("section_weights", "ar_section_weights", "section_noise")
    @classmethod
    def _every_section(cls, value: dict) -> dict:
        unknown = set(value) - set(SECTIONS)
        if unknown:
            raise ValueError(f"unknown section {sorted(unknown)[0]!r}; sections: {', '.join(SECTIONS)}")
        missing = set(SECTIONS) - set(value)
        if missing:
            raise ValueError(f"missing sections: {', '.join(sorted(missing))}")
        return value

    @field_validator("trajectories")
    @classmethod
    def _jf_reads_trajectories(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("recipe") == "jf" and value is None:
            raise ValueError("the jf recipe needs a trajectories folder (collect one with `fastddrive trajectories`)")
        return value

    @field_validator("labelled_ar_weight")
    @classmethod
    def _labelled_only_for_jf(cls, value: float, info: ValidationInfo) -> float:
        if value and info.data.get("recipe") != "jf":
            raise ValueError("labelled_ar_weight is a weight of the jf recipe; the other recipes train on labels")
        return value

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value < 2 or value & (value - 1):
            raise ValueError(f"block_size must be a power of two >= 2, got {value}")
        return value


def presets_dir() -> Path:
    return Path(str(files("fastddrive") / "configs"))


def preset_names() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def load_config(preset: str | None = None, path: str | Path | None = None, **overrides: object) -> TrainConfig:
    """A preset by name or a YAML file, with overrides (None values ignored); errors name the bad key."""
    if (preset is None) == (path is None):
        raise ConfigError("give exactly one of a preset name or a config path")
    if preset is not None:
        if preset not in preset_names():
            raise ConfigError(f"unknown preset {preset!r}; presets: {', '.join(preset_names())}")
        path = presets_dir() / f"{preset}.yaml"
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of settings")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = "unknown key" if first["type"] == "extra_forbidden" else first["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{path}: {where}: {message}") from None
