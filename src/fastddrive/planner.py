"""The Python entry point: `fastddrive.load(...)` gives a Planner; `planner.plan(...)` answers one scene.

planner = fastddrive.load("default")              # or a local Qwen2.5-VL folder
result = planner.plan(sample, decoder="ss")        # or images=[...], history=..., command=...
result.response.trajectory, result.nfe, result.decode_ms
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from fastddrive.data.sample import NAV_COMMANDS, DrivingSample, SampleError, check_command, check_history, check_image
from fastddrive.decode.registry import check_runs_on, decode
from fastddrive.decode.result import DecodeResult
from fastddrive.model import BlockDiffusionModel, PromptInputs
from fastddrive.model_files import check_device, load_model, model_path
from fastddrive.prompt import chat_text
from fastddrive.scaffold import DEFAULT_EXPLANATION_BUDGET, Scaffold


class PlanInputs(BaseModel):
    """What the planner reads: camera image(s), the ego history and the navigation command.

    images: (H, W, 3) uint8 RGB arrays, sides multiples of 28 px; history: 7 rows (t = -3.0..0.0 s every
    0.5 s) of x, y [m], vx, vy [m/s], ax, ay [m/s^2] in the ego frame at t = 0 (+x forward, +y left);
    command: one of NAV_COMMANDS.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    images: tuple[np.ndarray, ...]
    history: np.ndarray
    command: str

    @field_validator("images", mode="before")
    @classmethod
    def _images(cls, value: Any) -> tuple[np.ndarray, ...]:
        images = (value,) if isinstance(value, np.ndarray) else tuple(value)
        for image in images:
            check_image(image)
        return images

    @field_validator("history", mode="before")
    @classmethod
    def _history(cls, value: Any) -> np.ndarray:
        check_history(value)
        return np.asarray(value, dtype=float)

    @field_validator("command")
    @classmethod
    def _command(cls, value: str) -> str:
        check_command(value)
        return value

    @classmethod
    def checked(cls, **fields: Any) -> PlanInputs:
        """Validate, raising SampleError (one clear line) instead of pydantic's report."""
        try:
            return cls(**fields)
        except ValidationError as err:
            raise SampleError(str(err.errors()[0]["msg"]).removeprefix("Value error, ")) from None


def prompt_inputs(model: BlockDiffusionModel, command: str, history: np.ndarray, images: Sequence[np.ndarray]):
    """The tokenized chat prompt; a text-only model plans from the text alone."""
    images = list(images) if model.is_vision else []
    return model.encode_prompt(chat_text(command, history, images=len(images)), images)


@dataclass(frozen=True)
class ModelFacts:
    """What a request is checked against before any costly work, without the weights at hand (a planner
    in another process sends them once): whether the model reads images, and its checkpoint kind."""

    is_vision: bool
    kind: str  # CheckpointInfo.kind: "block-diffusion" or "autoregressive"

    def check_images(self, scene: PlanInputs) -> None:
        """SampleError if this is a vision model and `scene` has no camera image."""
        if self.is_vision and not scene.images:
            raise SampleError("this is a vision model: give at least one camera image (images=...)")

    def check_decoder(self, name: str) -> None:
        """DecoderError unless decoder `name` exists and runs on this model."""
        check_runs_on(self.kind, name)


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
        return ModelFacts(self.model.is_vision, self.model.info.kind)

    def prompt(self, scene: DrivingSample | PlanInputs) -> PromptInputs:
        images = [scene.image] if isinstance(scene, DrivingSample) else scene.images
        return prompt_inputs(self.model, scene.command, scene.history, images)

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
        """Answer one scene (a DrivingSample, PlanInputs, or images/history/command) with `decoder`."""
        if scene is None:
            scene = PlanInputs.checked(images=() if images is None else images, history=history, command=command)
            self.facts.check_images(scene)
        return decode(decoder, self.model, self.prompt(scene), self.scaffold, **options)


def load(
    name: str | Path = "default",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    cuda_graphs: bool | None = None,
) -> Planner:
    """'default' (the embedded block-diffusion model), 'default-ar' (its AR baseline) or a local folder.

    Weights are bfloat16 on a GPU and float32 on the CPU unless `dtype` says otherwise. On a GPU, decode
    forwards are replayed as CUDA graphs (`static_decode`) unless `cuda_graphs` is False; elsewhere they
    run eagerly whatever it says (the fixed shapes that graphs need only cost time without them)."""
    on_gpu = check_device(device).type == "cuda"
    model = load_model(model_path(str(name)), device=device, dtype=dtype or (torch.bfloat16 if on_gpu else None))
    if model.device.type == "cuda" and cuda_graphs is not False:
        model.use_static_shapes(graphs=True)
    return Planner(model)


__all__ = ["NAV_COMMANDS", "ModelFacts", "PlanInputs", "Planner", "load", "prompt_inputs"]
