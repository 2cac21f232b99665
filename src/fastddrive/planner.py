"""The Python entry point: `fastddrive.load(...)` gives a Planner; `planner.plan(...)` answers one scene.

planner = fastddrive.load("default")              # or a local Qwen2.5-VL folder
result = planner.plan(sample, decoder="ss")        # or images=[...], history=..., command=...
result.response.trajectory, result.nfe, result.decode_ms
"""

from __future__ import annotations

import json
import numbers
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from fastddrive.core.inputs import MAX_IMAGE_PIXELS
from fastddrive.core.prompt import chat_text
from fastddrive.core.release_prompt import release_chat_text
from fastddrive.core.sample import (
    HISTORY_COLUMNS,
    HISTORY_STEPS,
    NAV_COMMANDS,
    DrivingSample,
    SampleError,
    check_history,
    check_image,
    check_pixel_range,
    split_cameras,
)
from fastddrive.core.scaffold import DEFAULT_EXPLANATION_BUDGET, Scaffold
from fastddrive.core.tokenizer import load_tokenizer
from fastddrive.decode.footprint import ModelSizes, check_decode_memory
from fastddrive.decode.registry import check_drafts, check_options, check_runs_on, decode, vocabulary_size
from fastddrive.decode.result import DecodeResult
from fastddrive.engine.model import BlockDiffusionModel, CheckpointInfo, PromptInputs
from fastddrive.engine.model_files import check_device, load_model, model_path, read_info

# Twice the largest camera rig of the data sets read here (8 cameras in WOD-E2E); every image adds its patches
# to the prompt, and the embedded models were trained on one.
MAX_IMAGES = 16
HISTORY_SHAPE = (
    f"{HISTORY_STEPS} rows (t = -3.0..0.0 s every 0.5 s) of {len(HISTORY_COLUMNS)} real numbers"
    f" ({', '.join(HISTORY_COLUMNS)})"
)


class PlanInputs(BaseModel):
    """What the planner reads: camera image(s), the ego history and the navigation command.

    images: up to MAX_IMAGES (H, W, 3) uint8 RGB arrays of any size, at most MAX_IMAGE_PIXELS each (the model
    folder's image processor resizes them onto its grid, `smart_resize`); history: 7 rows (t = -3.0..0.0 s
    every 0.5 s) of x, y [m], vx, vy [m/s], ax, ay [m/s^2] in the ego frame at t = 0 (+x forward, +y left),
    finite; command: one of NAV_COMMANDS. Anything else is refused by
    `checked` in one line, its size and shape first: a huge or deeply nested value is never walked whole.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    images: tuple[np.ndarray, ...]
    history: np.ndarray
    command: str

    @field_validator("images", mode="before")
    @classmethod
    def _images(cls, value: Any) -> tuple[np.ndarray, ...]:
        if isinstance(value, np.ndarray):
            value = (value,)
        if not isinstance(value, (list, tuple)):
            raise SampleError(f"images must be a list of (H, W, 3) uint8 arrays, got {type(value).__name__}")
        if len(value) > MAX_IMAGES:
            raise SampleError(f"{len(value)} images given; a scene takes at most {MAX_IMAGES}")
        for image in value:
            check_image(image)
            if image.shape[0] * image.shape[1] > MAX_IMAGE_PIXELS:
                h, w = image.shape[:2]
                raise SampleError(f"image is {w}x{h} px, more than the {MAX_IMAGE_PIXELS} px an image may have")
        return tuple(value)

    @field_validator("history", mode="before")
    @classmethod
    def _history(cls, value: Any) -> np.ndarray:
        check_history_shape(value)
        check_history(value)
        return np.asarray(value, dtype=float)

    @field_validator("command", mode="before")
    @classmethod
    def _command(cls, value: Any) -> str:
        if not isinstance(value, str) or value not in NAV_COMMANDS:
            raise SampleError(f"unknown navigation command {_cut(value)}; known: {', '.join(NAV_COMMANDS)}")
        return value

    @classmethod
    def checked(cls, **fields: Any) -> PlanInputs:
        """Validate, raising SampleError (one clear line) instead of pydantic's report."""
        try:
            return cls(**fields)
        except ValidationError as err:
            error = err.errors(include_url=False)[0]
            what = ".".join(str(part) for part in error["loc"])
            message = str(error["msg"]).removeprefix("Value error, ")
            raise SampleError(message if error["type"] == "value_error" else f"{what}: {message}") from None


def camera_images(named: dict[str, np.ndarray], cameras: Sequence[str]) -> list[np.ndarray]:
    """Images given by camera name, in the model's camera order (`CheckpointInfo.cameras`); SampleError naming
    the cameras expected for a model of one joined frame, an unknown name or a missing camera."""
    if not cameras:
        raise SampleError("this model reads one frame (its cameras joined): give --image, not --camera")
    unknown = sorted(set(named) - set(cameras))
    missing = [c for c in cameras if c not in named]
    if unknown or missing:
        wrong = f"unknown camera {unknown[0]!r}" if unknown else f"camera {missing[0]} is missing"
        raise SampleError(f"{wrong}; this model takes {len(cameras)} cameras: {', '.join(cameras)}")
    return [named[c] for c in cameras]


def check_history_shape(value: Any) -> None:
    """SampleError unless `value` is shaped as a history: an array of shape (7, 6), or 7 lists of 6 numbers.
    Only the shape and the items' types: a million rows or a list nested a thousand deep is refused at its
    first level, before anything walks or converts it (values are checked by `check_history`)."""
    if isinstance(value, np.ndarray):
        if value.shape != (HISTORY_STEPS, len(HISTORY_COLUMNS)):
            raise SampleError(f"history must be {HISTORY_SHAPE}; got an array of shape {_cut(value.shape)}")
        return
    if not isinstance(value, (list, tuple)):
        raise SampleError(f"history must be {HISTORY_SHAPE}; got {type(value).__name__}")
    if len(value) != HISTORY_STEPS:
        raise SampleError(f"history must be {HISTORY_SHAPE}; got {len(value)} rows")
    for k, row in enumerate(value):
        if isinstance(row, np.ndarray) and row.ndim != 1:
            raise SampleError(f"history must be {HISTORY_SHAPE}; row {k} is an array of shape {_cut(row.shape)}")
        if not isinstance(row, (list, tuple, np.ndarray)):
            raise SampleError(f"history must be {HISTORY_SHAPE}; row {k} is {type(row).__name__}")
        if len(row) != len(HISTORY_COLUMNS):
            raise SampleError(f"history must be {HISTORY_SHAPE}; row {k} has {len(row)} values")
        for item in row:
            if isinstance(item, (bool, np.bool_)) or not isinstance(item, numbers.Real):
                raise SampleError(f"history must be {HISTORY_SHAPE}; row {k} holds {_cut(item)}")


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 40


def _cut(value: Any) -> str:
    """A short repr of a value a caller gave (a long text or list is cut, never written out whole)."""
    try:
        return " ".join(_REPR.repr(value).split())  # one line, whatever the repr (an array's has several)
    except Exception:  # noqa: BLE001 - any object may be given; its repr is only for the message
        return f"a value of type {type(value).__name__}"


def prompt_inputs(model: BlockDiffusionModel, command: str, history: np.ndarray, images: Sequence[np.ndarray]):
    """The tokenized chat prompt, fastddrive's or the official release's (`CheckpointInfo.prompt`); a text-only
    model plans from the text alone."""
    images = list(images) if model.is_vision else []
    return model.encode_prompt(prompt_text_of(model.info, command, history, len(images)), images)


def scene_prompt(model: BlockDiffusionModel, scene: DrivingSample | PlanInputs) -> PromptInputs:
    """The tokenized prompt of a scene in the model folder's prompt mode; a data set's joined frame is cut into
    the model's separate cameras (`CheckpointInfo.cameras`)."""
    cameras = len(model.info.cameras)
    if isinstance(scene, DrivingSample):
        images = split_cameras(scene.image, cameras) if cameras > 1 else [scene.image]
    else:
        images = list(scene.images)
    return prompt_inputs(model, scene.command, scene.history, images)


def prompt_text_of(info: CheckpointInfo, command: str, history: np.ndarray, images: int) -> str:
    """The chat prompt a model folder asks for (`CheckpointInfo.prompt`), with `images` image slots."""
    if info.prompt == "release":
        return release_chat_text(command, history, images)
    return chat_text(command, history, images=images)


@dataclass(frozen=True)
class ModelFacts:
    """What a request is checked against before any costly work, without the weights at hand (a planner
    in another process sends them once): whether the model reads images, its checkpoint kind, the token ids
    it reads, its answer's length, and what a decode's memory scales with."""

    is_vision: bool
    kind: str  # CheckpointInfo.kind: "block-diffusion" or "autoregressive"
    vocab_size: int  # token ids 0..vocab_size - 1 (the rows of its input embedding): what `drafts` may hold
    answer_length: int  # positions of the scaffold's answer: an `ss` draft holds one id per position
    sizes: ModelSizes  # the text decoder's sizes (decode.footprint)
    device: str  # where it decodes: the memory budget is that device's
    cameras: tuple[str, ...] = ()  # the camera layout (CheckpointInfo.cameras): () one frame, else one image each

    def check_images(self, scene: PlanInputs) -> None:
        """SampleError if this is a vision model and `scene` has no camera image, or a text-only model and it has
        some (it could not see them: planning as if it had would be a silent wrong answer)."""
        if self.is_vision and not scene.images:
            raise SampleError("this is a vision model: give at least one camera image (images=...)")
        if self.is_vision and self.cameras and len(scene.images) != len(self.cameras):
            raise SampleError(
                f"this model takes {len(self.cameras)} cameras as separate images, in this order: "
                f"{', '.join(self.cameras)}; {len(scene.images)} image(s) given"
            )
        if not self.is_vision and scene.images:
            raise SampleError(
                f"this is a text-only model: it cannot see the {len(scene.images)} camera image(s) given; plan "
                "without images, or with a vision-language model"
            )

    def check_decoder(self, name: str) -> None:
        """DecoderError unless decoder `name` exists and runs on this model."""
        check_runs_on(self.kind, name)

    def check_options(self, name: str, options: dict[str, Any]) -> dict[str, Any]:
        """The options of decoder `name` typed and checked against their ranges and this model: the decoder runs
        on it, and `drafts` hold ids of its vocabulary and fit its answer. DecoderError, one line."""
        self.check_decoder(name)
        typed = check_options(name, options)
        check_drafts(name, typed, self.vocab_size, self.answer_length, self.kind)
        return typed

    def check_memory(self, name: str, options: dict[str, Any], prompt_tokens: int = 0) -> None:
        """MemoryBudgetError when decoder `name` with (checked) `options` would hold more than the budget of this
        model's device, for a prompt of `prompt_tokens` (by default none: the least any request holds)."""
        free = self.kind == "autoregressive"
        check_decode_memory(name, options, self.sizes, prompt_tokens, self.answer_length, self.device, free)


class Planner:
    """A loaded model with its scaffold, answering scenes through any registered decoder."""

    def __init__(self, model: BlockDiffusionModel) -> None:
        self.model = model
        budget = model.info.explanation_budget or DEFAULT_EXPLANATION_BUDGET
        self.scaffold = Scaffold(
            model.tokenizer, explanation_budget=budget, scaffold_tokenization=model.info.scaffold_tokenization
        )

    @property
    def facts(self) -> ModelFacts:
        model = self.model
        return ModelFacts(
            model.is_vision,
            model.info.kind,
            vocabulary_size(model),
            len(self.scaffold),
            ModelSizes.of_model(model),
            str(model.device),
            tuple(model.info.cameras),
        )

    def prompt(self, scene: DrivingSample | PlanInputs) -> PromptInputs:
        """The tokenized prompt of a scene; a data set's joined frame is cut into the model's separate cameras."""
        return scene_prompt(self.model, scene)

    def plan(
        self,
        scene: DrivingSample | PlanInputs | None = None,
        decoder: str = "ss",
        *,
        images: Sequence[np.ndarray] | np.ndarray | None = None,
        history: Any = None,
        command: str | None = None,
        **options: Any,
    ) -> DecodeResult:
        """Answer one scene (a DrivingSample, PlanInputs, or images/history/command) with `decoder`.

        Everything is checked before the images are processed: the scene, the options against their ranges
        and this model (DecoderError); then, with the prompt's length known and before the first forward, the
        decode's memory against the budget (MemoryBudgetError, `decode.footprint`)."""
        facts = self.facts
        if scene is None:
            scene = PlanInputs.checked(images=() if images is None else images, history=history, command=command)
        if isinstance(scene, PlanInputs):  # a data set's scene carries its frame; a text-only model reads the text
            facts.check_images(scene)
        options = facts.check_options(decoder, options)
        return decode(decoder, self.model, self.prompt(scene), self.scaffold, **options)


def check_before_loading(
    name: str | Path,
    decoder: str,
    options: dict[str, Any],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    scene: DrivingSample | PlanInputs | None = None,
) -> dict[str, Any]:
    """What `load(name, device, dtype).plan(scene, decoder, **options)` checks before decoding, checked from the
    model's small files before its weights load: the options (typed and returned), that the decoder runs on the
    checkpoint, `drafts` against its vocabulary and answer, and the decode's memory against the budget (the
    scene's images against what the model reads are checked by `plan`, once the folder has loaded: a damaged
    folder is named first).

    The memory is estimated with the prompt's text only (the scene's images add tokens that only the loaded
    image processor counts), so it never refuses what the planner would take; the planner checks again with
    the whole prompt. A folder whose files cannot be read is left to the loader, which names what is wrong."""
    typed = check_options(decoder, options)
    on = check_device(device)
    folder = model_path(str(name))
    try:
        config = json.loads((folder / "config.json").read_text())
        info = read_info(folder)
        tokenizer = load_tokenizer(folder)
        scaffold = Scaffold(
            tokenizer,
            explanation_budget=info.explanation_budget or DEFAULT_EXPLANATION_BUDGET,
            scaffold_tokenization=info.scaffold_tokenization,
        )
        dtype_bytes = dtype.itemsize if dtype is not None else 2 if on.type == "cuda" else 4
        sizes = ModelSizes.from_config(config, dtype_bytes)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return typed
    facts = ModelFacts(
        bool(config.get("vision_config")), info.kind, sizes.vocab, len(scaffold), sizes, str(on), tuple(info.cameras)
    )
    facts.check_options(decoder, typed)
    text = prompt_text_of(info, scene.command, scene.history, 0) if scene is not None else ""
    facts.check_memory(decoder, typed, len(tokenizer.encode(text, add_special_tokens=False)))
    return typed


def load(
    name: str | Path = "default",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    cuda_graphs: bool | None = None,
    image_min_pixels: int | None = None,
    image_max_pixels: int | None = None,
) -> Planner:
    """'default' (the embedded block-diffusion model), 'default-ar' (its AR baseline) or a local folder.

    Camera frames of any size are resized by the folder's image processor (Qwen2.5-VL's `smart_resize`)
    to between its min and max pixels; `image_min_pixels` / `image_max_pixels` override them for this
    planner (`BlockDiffusionModel.set_image_pixels`). The answer records the size the model saw.

    Weights are bfloat16 on a GPU and float32 on the CPU unless `dtype` says otherwise. On a GPU, decode
    forwards are replayed as CUDA graphs (`static_decode`) unless `cuda_graphs` is False; elsewhere they
    run eagerly whatever it says (the fixed shapes that graphs need only cost time without them)."""
    on_gpu = check_device(device).type == "cuda"
    if image_min_pixels is not None and image_max_pixels is not None:  # refused before the weights load
        check_pixel_range(image_min_pixels, image_max_pixels)
    model = load_model(model_path(str(name)), device=device, dtype=dtype or (torch.bfloat16 if on_gpu else None))
    if image_min_pixels is not None or image_max_pixels is not None:
        model.set_image_pixels(image_min_pixels, image_max_pixels)
    if model.device.type == "cuda" and cuda_graphs is not False:
        model.use_static_shapes(graphs=True)
    return Planner(model)


__all__ = ["NAV_COMMANDS", "ModelFacts", "PlanInputs", "Planner", "check_before_loading", "load", "prompt_inputs"]
