"""Training configuration: small YAML presets validated by pydantic (an unknown key is an error)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from fastddrive.core.sample import check_pixel_range
from fastddrive.core.scaffold import ScaffoldTokenization
from fastddrive.core.schema import SECTIONS


class ConfigError(ValueError):
    """A training configuration that cannot be used, with the reason."""


MAX_STEPS = 100_000_000
# Every number of the config has a range, checked before anything is written (issue 32): floats are finite, a
# loss weight lies in [0, 1000] (a NaN one would train NaN), a Beta parameter of the masking rates in (0, 1000].
LossWeight = Annotated[float, Field(ge=0, le=1000, allow_inf_nan=False)]
BetaParameter = Annotated[float, Field(gt=0, le=1000, allow_inf_nan=False)]


class TinyArchitecture(BaseModel):
    """Sizes of a Qwen2.5-VL built from scratch (the embedded default). The text head size (hidden_size /
    heads) is even (its mRoPE sections halve it) and the vision head size a multiple of 4 (its 2D rotary)."""

    model_config = ConfigDict(extra="forbid")

    hidden_size: int = Field(default=192, ge=8, le=16384)
    layers: int = Field(default=4, ge=1, le=256)
    heads: int = Field(default=6, ge=1, le=256)
    kv_heads: int = Field(default=2, ge=1, le=256)
    intermediate_size: int = Field(default=512, ge=1, le=65536)
    vision_hidden_size: int = Field(default=96, ge=8, le=16384)
    vision_depth: int = Field(default=2, ge=1, le=256)
    vision_heads: int = Field(default=2, ge=1, le=256)

    @model_validator(mode="after")
    def _heads_divide_the_widths(self) -> TinyArchitecture:
        if self.hidden_size % self.heads or (self.hidden_size // self.heads) % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must be heads ({self.heads}) times an even head size")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads}")
        if self.vision_hidden_size % self.vision_heads or (self.vision_hidden_size // self.vision_heads) % 4:
            raise ValueError(
                f"vision_hidden_size {self.vision_hidden_size} must be vision_heads ({self.vision_heads}) "
                "times a head size that is a multiple of 4"
            )
        return self


class TrainConfig(BaseModel):
    """One training run. `recipe`: `ar` (causal LM loss only, the AR baseline), `sasd` (paper 000 section
    3.2 on the dual-stream objective of paper 002 section 3.3) or `jf` (Jacobi Forcing, paper 003 section
    3.1: an AR model trained on its own Jacobi trajectories; it stays an AR model)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    recipe: Literal["ar", "sasd", "jf"]
    init_from: str = Field(
        description="'scratch', 'embedded:NAME', 'random:PRESET' (a shipped architecture with random weights, cut by "
        "`random_shrink`), or a local checkpoint folder"
    )
    # For init_from random:PRESET: config.json keys overriding the architecture's (vision keys under
    # "vision_config"), e.g. {"num_hidden_layers": 2, "vision_config": {"depth": 2}}.
    random_shrink: dict[str, Any] = {}
    data: str = "runs/sim"
    out: str = "runs/model"
    architecture: TinyArchitecture = TinyArchitecture()
    image_max_pixels: int = Field(default=224 * 112, ge=56 * 56, le=4096 * 4096)
    image_min_pixels: int = Field(default=56 * 56, ge=28 * 28, le=4096 * 4096)
    steps: int = Field(default=2000, ge=1, le=MAX_STEPS)
    batch_size: int = Field(default=8, ge=1, le=4096)
    lr: float = Field(default=1e-3, gt=0, le=1, allow_inf_nan=False)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, allow_inf_nan=False)
    warmup_steps: int = Field(default=100, ge=0, le=MAX_STEPS)
    weight_decay: float = Field(default=0.01, ge=0, le=1, allow_inf_nan=False)
    grad_clip: float = Field(default=1.0, gt=0, le=1e6, allow_inf_nan=False)
    # Precision and memory (issue 36): bf16 compute over float32 master weights and optimizer states (accelerate's
    # mixed precision); transformers' own non-reentrant gradient checkpointing of the language model and the
    # vision tower; the vision tower frozen; the final model's dtype (default: bf16 for a bf16 run). Checkpoints
    # keep the float32 master weights, so that a resumed run is exact. `weights_dtype: bfloat16` holds the weights
    # and gradients themselves in bf16 (no master copy: 12 bytes per trained parameter instead of 16), updated by
    # AdamW with float32 moments and stochastic rounding (train/bf16_adamw.py); it needs `mixed_precision: bf16`.
    # `sharding: fsdp` shards weights, gradients and optimizer states over the processes (train/sharding.py).
    mixed_precision: Literal["no", "bf16"] = "no"
    weights_dtype: Literal["float32", "bfloat16"] = "float32"
    gradient_checkpointing: bool = False
    freeze_vision: bool = False
    save_dtype: Literal["float32", "bfloat16"] | None = None
    sharding: Literal["none", "fsdp"] = "none"
    block_size: int = Field(default=32, ge=2, le=1024)
    anneal_block_size: bool = True
    alpha: LossWeight = 0.5
    beta: LossWeight = 0.5
    section_weights: dict[str, LossWeight] = {
        "critical_objects": 1.5,
        "explanation": 1.0,
        "future_meta_behavior": 2.0,
        "trajectory": 3.0,
    }
    # Weights of the causal LM (clean stream) loss per response section; all 1 is the plain mean. The
    # embedded presets raise the trajectory's, whose digit tokens carry the driving error.
    ar_section_weights: dict[str, LossWeight] = dict.fromkeys(SECTIONS, 1.0)
    # Per section, the (a, b) of the Beta distribution its masking rate is drawn from.
    section_noise: dict[str, tuple[BetaParameter, BetaParameter]] = {
        "critical_objects": (1.0, 2.0),
        "explanation": (1.0, 1.0),
        "future_meta_behavior": (1.0, 1.5),
        "trajectory": (2.0, 1.0),
    }
    # Jacobi Forcing: the trajectories folder (`fastddrive trajectories`), the block size it was collected
    # at, the window w of the progressive noise schedule (Eq. 7) and the AR loss weight w of Eq. 9.
    trajectories: str | None = Field(default=None, validate_default=True)
    jacobi_block_size: int = Field(default=16, ge=1, le=1024)
    noise_window: int = Field(default=16, ge=1, le=1024)
    ar_weight: LossWeight = 1.0
    # Jacobi Forcing: weight of a causal LM loss on a batch of the data's own labelled answers (its train split),
    # added at every step; 0 leaves it out. Eq. 9's AR loss reads only the teacher's answers, on which a small
    # student drifts (its greedy answers stop parsing); the labels keep its clean predictions on the task.
    labelled_ar_weight: LossWeight = 0.0
    # Leave out trajectories whose fixed point does not parse as a driving answer (tests of random
    # teachers, whose answers never parse, keep them).
    skip_unparsed: bool = True
    explanation_budget: int = Field(default=32, ge=1, le=4096)
    # "runs" for real BPE vocabularies, "release" for the official checkpoint's layout (scaffold.py); a model
    # folder's own layout (fastddrive.json) is what init_from continues with
    scaffold_tokenization: ScaffoldTokenization = "pieces"
    checkpoint_every: int = Field(default=200, ge=1, le=MAX_STEPS)
    keep_checkpoints: int = Field(default=2, ge=1, le=1000)
    validate_every: int = Field(default=200, ge=1, le=MAX_STEPS)
    validation_samples: int = Field(default=16, ge=0, le=100_000)  # 0: no validation (weights that mean nothing)
    log_every: int = Field(default=10, ge=1, le=MAX_STEPS)
    seed: int = Field(default=0, ge=0, le=2**32 - 1)

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

    @field_validator("image_min_pixels")
    @classmethod
    def _pixel_range(cls, value: int, info: ValidationInfo) -> int:
        high = info.data.get("image_max_pixels")
        if high is not None:
            check_pixel_range(value, high, ("image_min_pixels", "image_max_pixels"))
        return value

    @model_validator(mode="before")
    @classmethod
    def _dtype_is_mixed_precision(cls, data: Any) -> Any:
        """The key of earlier releases: `dtype: bfloat16` is `mixed_precision: bf16`."""
        if isinstance(data, dict) and "dtype" in data and "mixed_precision" not in data:
            data = dict(data)
            dtype = data.pop("dtype")
            data["mixed_precision"] = {"bfloat16": "bf16", "float32": "no"}.get(dtype, dtype)
        return data

    @model_validator(mode="after")
    def _bf16_weights_in_a_bf16_run(self) -> TrainConfig:
        if self.weights_dtype == "bfloat16" and self.mixed_precision != "bf16":
            raise ValueError("weights_dtype: bfloat16 needs mixed_precision: bf16 (a float32 run has float32 weights)")
        return self

    @property
    def final_dtype(self) -> str:
        """The dtype the final model is saved in: `save_dtype`, else bfloat16 for a bf16 run."""
        return self.save_dtype or ("bfloat16" if self.mixed_precision == "bf16" else "float32")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"block_size must be a power of two in [2, 1024], got {value}")
        return value


def presets_dir() -> Path:
    """The folder of the packaged training presets (`fastddrive/configs`)."""
    return Path(str(files("fastddrive") / "configs"))


def preset_names() -> list[str]:
    """The names of the packaged presets (`tiny-ar`, `tiny-sasd`, ...), sorted."""
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def _constraints(annotation: Any, metadata: list[Any]) -> tuple[Any, list[Any]]:
    """The type under `Annotated[...]` and the constraints (annotated_types bounds) on it."""
    if get_origin(annotation) is Annotated:
        inner, *extras = get_args(annotation)
        return inner, metadata + [c for extra in extras for c in getattr(extra, "metadata", [extra])]
    return annotation, metadata


def _setting_range(loc: tuple[int | str, ...]) -> str | None:
    """The documented range of the numeric setting at `loc` ("an integer in [0, 4294967295]"), from its
    Field bounds; None for a setting that is not a bounded number."""
    annotation: Any = TrainConfig
    metadata: list[Any] = []
    for part in loc:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return None
            annotation, metadata = _constraints(field.annotation, list(field.metadata))
        elif get_origin(annotation) is dict:
            annotation, metadata = _constraints(get_args(annotation)[1], [])
        elif get_origin(annotation) is tuple and isinstance(part, int) and part < len(get_args(annotation)):
            annotation, metadata = _constraints(get_args(annotation)[part], [])
        else:
            return None
    bounds = {name: getattr(c, name) for c in metadata for name in ("ge", "gt", "le", "lt") if hasattr(c, name)}
    if annotation not in (int, float) or not bounds.keys() & {"ge", "gt"}:
        return None
    kind = "an integer" if annotation is int else "a finite number"
    low = f"[{bounds['ge']}" if "ge" in bounds else f"({bounds['gt']}"
    high = f"{bounds['le']}]" if "le" in bounds else f"{bounds['lt']})" if "lt" in bounds else None
    return f"{kind} in {low}, {high}" if high else f"{kind} {'>=' if 'ge' in bounds else '>'} {low[1:]}"


def _config_error(source: Path, err: ValidationError) -> ConfigError:
    """One line naming the first bad key: its range and the value given for a number out of range."""
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        return ConfigError(f"{source}: {where}: unknown key")
    expected = _setting_range(first["loc"]) if first["type"] not in ("missing", "value_error") else None
    if expected is not None:
        return ConfigError(f"{source}: {where} must be {expected}, got {first['input']!r}")
    return ConfigError(f"{source}: {where}: {first['msg'].removeprefix('Value error, ')}")


def load_config(preset: str | None = None, path: str | Path | None = None, **overrides: object) -> TrainConfig:
    """A preset by name or a YAML file, with overrides (None values ignored); errors name the bad key and, for
    a number, its range."""
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
        raw = yaml.safe_load(path.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text; a config is a YAML file") from None
    except (yaml.YAMLError, RecursionError) as err:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of settings")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as err:
        raise _config_error(path, err) from None
