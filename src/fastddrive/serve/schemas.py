"""What the service takes and answers, and the request turned into the library's own checked types.

The shapes and ranges are the library's: images and history go through `PlanInputs`, the decoder and its
options through the registry's `check_options`. Every refusal is a 422 whose `loc` names the field.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, ValidationError

from fastddrive.data.sample import NAV_COMMANDS, SampleError
from fastddrive.decode.registry import DECODERS, DecoderError, check_options
from fastddrive.inputs import image_from_base64
from fastddrive.planner import ModelFacts, PlanInputs
from fastddrive.schema import DrivingResponse

ZERO_HISTORY = [[0.0] * 6 for _ in range(7)]


class PlanRequest(BaseModel):
    """One scene and how to decode it."""

    model_config = ConfigDict(extra="forbid")

    images: list[str] = Field(
        default_factory=list,
        description="Camera frames as base64 PNG or JPEG (a data: URL is fine), sides multiples of 28 px.",
    )
    history: list[list[StrictFloat]] = Field(
        description="7 rows (t = -3.0..0.0 s every 0.5 s) of x, y [m], vx, vy [m/s], ax, ay [m/s^2], ego frame "
        "at t = 0 (+x forward, +y left).",
        examples=[ZERO_HISTORY],
    )
    command: str = Field(description=f"Navigation command: {', '.join(NAV_COMMANDS)}.", examples=["go_straight"])
    decoder: str | None = Field(None, description=f"One of {', '.join(DECODERS)} (default: the server's).")
    options: dict[str, Any] = Field(default_factory=dict, description="The decoder's options, e.g. {'tau': 0.5}.")


class PlanAnswer(BaseModel):
    """What `fastddrive plan --json` prints."""

    decoder: str
    response: DrivingResponse | None = Field(description="The parsed answer; null when the text does not parse.")
    text: str
    token_ids: list[int]
    nfe: int = Field(description="Model forward calls, prefill included.")
    tokens: int = Field(description="Real tokens of the answer (scaffold and values, NULL padding not counted).")
    fed_tokens: int
    prefill_ms: float
    decode_ms: float
    accepted_per_step: list[int]
    error: str | None = Field(description="Why the text does not parse, or null.")


def refusal(loc: tuple[str | int, ...], message: str) -> dict[str, Any]:
    """One entry of a 422's `detail`, in FastAPI's own format."""
    return {"type": "value_error", "loc": ("body", *loc), "msg": message}


def decode_images(images: list[str]) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
    """(arrays, refusals) of base64 frames."""
    arrays, errors = [], []
    for k, image in enumerate(images):
        try:
            arrays.append(image_from_base64(image))
        except SampleError as err:
            errors.append(refusal(("images", k), str(err)))
    return arrays, errors


def checked_request(
    facts: ModelFacts,
    images: list[np.ndarray],
    history: Any,
    command: str,
    decoder: str,
    options: dict[str, Any],
    errors: list[dict[str, Any]] | None = None,
) -> tuple[PlanInputs, str, dict[str, Any]]:
    """(scene, decoder, typed options) for the library, or RequestValidationError naming every bad field
    (`errors`: refusals found before, such as frames that do not decode)."""
    errors = list(errors or [])
    scene = None
    try:
        scene = PlanInputs(images=images, history=history, command=command)
    except ValidationError as err:
        errors += [refusal(e["loc"], str(e["msg"]).removeprefix("Value error, ")) for e in err.errors()]
    if scene is not None and not any(e["loc"][1] in ("images", "frame") for e in errors):
        try:
            facts.check_images(scene)
        except SampleError as err:
            errors.append(refusal(("images",), str(err)))
    try:
        facts.check_decoder(decoder)
    except DecoderError as err:
        errors.append(refusal(("decoder",), str(err)))
    else:
        try:
            options = check_options(decoder, options)
        except DecoderError as err:
            errors.append(refusal(("options",), str(err)))
    if errors:
        raise RequestValidationError(errors)
    return scene, decoder, options
