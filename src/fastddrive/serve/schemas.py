"""What the service takes and answers, and the request turned into the library's own checked types.

The shapes and ranges are the library's: images and history go through `PlanInputs`, the decoder and its
options through the registry's `check_options`. On top of them sit the service's own rules (issue 32): its
limits (`limits.ServiceLimits`: images, pixels read from the headers before decoding, option caps), no
option that names a server-side file (`vocabulary`: the server hands `pvf` its own), and draft ids inside
the model's vocabulary. Every refusal is a 422 whose `loc` names the field; nothing a client sent is echoed
whole. `plan_from_json` and `plan_from_form` do all of it, and are run on a thread, off the event loop.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, ValidationError

from fastddrive.core.inputs import image_from_bytes, image_size
from fastddrive.core.memory import MemoryBudgetError
from fastddrive.core.sample import HISTORY_COLUMNS, HISTORY_STEPS, NAV_COMMANDS, SampleError, split_cameras
from fastddrive.core.schema import DrivingResponse
from fastddrive.decode.registry import DECODERS, DecoderError, decoder_options
from fastddrive.planner import ModelFacts, PlanInputs
from fastddrive.serve.limits import LimitError, ServiceLimits

ZERO_HISTORY = [[0.0] * 6 for _ in range(7)]
SERVER_OPTIONS = ("vocabulary",)  # options naming a file on the server: the server sets them, never a request
HISTORY_SHAPE = f"{HISTORY_STEPS} rows (t = -3.0..0.0 s every 0.5 s) of {', '.join(HISTORY_COLUMNS)}"
# Lengths bounded in the model, so that a long list is refused as it is validated (and the schema says so).
HistoryRow = Annotated[list[StrictFloat], Field(min_length=len(HISTORY_COLUMNS), max_length=len(HISTORY_COLUMNS))]


class PlanRequest(BaseModel):
    """One scene and how to decode it."""

    model_config = ConfigDict(extra="forbid")

    images: list[str] = Field(
        default_factory=list,
        description="Camera frames as base64 PNG or JPEG (a data: URL is fine), of any size.",
    )
    history: list[HistoryRow] = Field(
        min_length=HISTORY_STEPS,
        max_length=HISTORY_STEPS,
        description="7 rows (t = -3.0..0.0 s every 0.5 s) of x, y [m], vx, vy [m/s], ax, ay [m/s^2], ego frame "
        "at t = 0 (+x forward, +y left).",
        examples=[ZERO_HISTORY],
    )
    # The schema lists the names; the library checks them, in its own words.
    command: str = Field(
        description=f"Navigation command: {', '.join(NAV_COMMANDS)}.",
        examples=["go_straight"],
        json_schema_extra={"enum": list(NAV_COMMANDS)},
    )
    decoder: str | None = Field(
        None,
        description=f"One of {', '.join(DECODERS)} (default: the server's).",
        json_schema_extra={"enum": [*DECODERS, None]},
    )
    options: dict[str, Any] = Field(default_factory=dict, description="The decoder's options, e.g. {'tau': 0.5}.")


def plan_request_model(limits: ServiceLimits) -> type[PlanRequest]:
    """PlanRequest with this server's limits in its fields (and so in the OpenAPI schema)."""

    class Limited(PlanRequest):
        model_config = ConfigDict(title="PlanRequest")

        images: list[str] = Field(
            default_factory=list,
            max_length=limits.max_images,
            description=f"Camera frames as base64 PNG or JPEG (a data: URL is fine), of any size; at"
            f" most {limits.max_images}, of at most {limits.max_image_pixels} px each and"
            f" {limits.max_request_pixels} px together.",
        )
        options: dict[str, Any] = Field(
            default_factory=dict,
            description="The decoder's options, e.g. {'tau': 0.5}; integer options at most: "
            + ", ".join(f"{key} {cap}" for key, cap in sorted(limits.option_caps.items()))
            + ". The planning vocabulary of `pvf` is the server's own: no `vocabulary` option.",
        )

    return Limited


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


@dataclass(frozen=True)
class ServiceRules:
    """What a request is checked against besides the library: the server's limits, the planning vocabulary it
    hands `pvf` (None: it has none)."""

    limits: ServiceLimits
    vocabulary: Path | None = None


def refusal(loc: tuple[str | int, ...], message: str) -> dict[str, Any]:
    """One entry of a 422's `detail`, in FastAPI's own format."""
    return {"type": "value_error", "loc": ("body", *loc), "msg": message}


def plan_from_json(
    body: bytes, facts: ModelFacts, default_decoder: str, rules: ServiceRules, model: type[PlanRequest]
) -> tuple[PlanInputs, str, dict[str, Any]]:
    """(scene, decoder, options) of a POST /v1/plan body, or RequestValidationError naming every bad field."""
    try:
        rules.limits.check_shape(body)
    except LimitError as err:
        raise RequestValidationError([refusal((), str(err))]) from None
    try:
        request = model.model_validate_json(body)
    except ValidationError as err:
        raise RequestValidationError([_refusal_of(e, rules.limits) for e in err.errors(include_url=False)]) from None
    images, errors = decode_images([_base64(k, text) for k, text in enumerate(request.images)], rules.limits)
    decoder = request.decoder or default_decoder
    return checked_request(facts, images, request.history, request.command, decoder, request.options, rules, errors)


def plan_from_form(
    facts: ModelFacts,
    rules: ServiceRules,
    frames: list[tuple[str, bytes]],
    scene: tuple[np.ndarray, list[list[float]]] | None,
    history: str,
    command: str,
    decoder: str,
    options: str,
    errors: list[dict[str, Any]],
) -> tuple[PlanInputs, str, dict[str, Any]]:
    """(scene, decoder, options) of the page's form: (field, bytes) of its frames, one per camera of the model, or
    a data-folder scene (image, history; its joined frame cut into the model's cameras), history and options as
    JSON text; RequestValidationError naming every bad field (`errors`: found before)."""
    errors = list(errors)
    images, rows = [], None
    if scene is not None:
        cameras, rows = len(facts.cameras), scene[1]
        try:
            images = split_cameras(scene[0], cameras) if cameras > 1 else [scene[0]]
        except SampleError as err:
            errors.append(refusal(("scene",), str(err)))
    if frames:
        images, frame_errors = decode_images(list(frames), rules.limits)
        errors += frame_errors
    try:
        rows = json.loads(history) if history.strip() else rows
    except (ValueError, RecursionError):
        errors.append(refusal(("history",), "history is not valid JSON; give 7 rows of [x, y, vx, vy, ax, ay]"))
    try:
        options_given = json.loads(options or "{}")
        if not isinstance(options_given, dict):
            raise ValueError
    except (ValueError, RecursionError):
        errors.append(refusal(("options",), 'options must be a JSON object, e.g. {"tau": 0.5}'))
        options_given = {}
    return checked_request(facts, images, rows, command, decoder, options_given, rules, errors)


def decode_images(
    images: list[tuple[str | int, bytes | SampleError]], limits: ServiceLimits
) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
    """(arrays, refusals) of (field, bytes) images: every image's size is read from its header and checked
    against the limits before any is decoded."""
    errors, sizes = [], []
    for field, data in images:
        try:
            if isinstance(data, SampleError):
                raise data
            size = image_size(data)
        except SampleError as err:
            errors.append(refusal(_image_loc(field), str(err)))
            continue
        if size is not None:  # else not a PNG or JPEG: the decoder refuses it from its first bytes
            sizes.append((field if isinstance(field, str) else f"image {field}", *size))
    try:
        limits.check_pixels(sizes)
    except LimitError as err:
        errors.append(refusal(("images",), str(err)))
    if errors:
        return [], errors
    arrays = []
    for field, data in images:
        try:
            arrays.append(image_from_bytes(data))
        except SampleError as err:
            errors.append(refusal(_image_loc(field), str(err)))
    return arrays, errors


def checked_request(
    facts: ModelFacts,
    images: list[np.ndarray],
    history: Any,
    command: str,
    decoder: str,
    options: dict[str, Any],
    rules: ServiceRules,
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
        options = service_options(facts, decoder, options, rules)
    except DecoderError as err:  # an unknown decoder, or one that does not run on this model
        errors.append(refusal(("decoder",), str(err)))
    except OptionRefused as err:
        errors.append(refusal(err.loc, str(err)))
    if errors:
        raise RequestValidationError(errors)
    return scene, decoder, options


class OptionRefused(ValueError):
    """A decoder option this service does not take; `loc` names it."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.loc = ("options",) if option is None else ("options", option)


def service_options(facts: ModelFacts, decoder: str, options: dict[str, Any], rules: ServiceRules) -> dict[str, Any]:
    """The options typed and checked by the library against their ranges and the model (`drafts` inside its
    vocabulary, the decode's memory within the budget), then by this service's caps, with the server's own
    resources set (the planning vocabulary of `pvf`). OptionRefused names the option."""
    for option in SERVER_OPTIONS:
        if option in options:
            raise OptionRefused(
                f"option {option!r} names a file on the server, which a request may not: this service plans"
                " with its own planning vocabulary (set when it starts)",
                option,
            )
    try:
        typed = facts.check_options(decoder, options)
    except DecoderError as err:
        raise OptionRefused(str(err)) from None
    for option, value in typed.items():
        cap = rules.limits.cap(decoder, option)
        if cap is not None and isinstance(value, int) and value > cap:
            raise OptionRefused(
                f"decoder {decoder!r} option {option}: got {value}, this service takes at most {cap}", option
            )
    try:
        facts.check_memory(decoder, typed)  # the prompt's length is only known to the model: checked again there
    except MemoryBudgetError as err:
        raise OptionRefused(str(err)) from None
    if decoder == "pvf":
        return _with_vocabulary(typed, rules.vocabulary)
    return typed


def _with_vocabulary(options: dict[str, Any], vocabulary: Path | None) -> dict[str, Any]:
    if vocabulary is not None:
        return {**options, "vocabulary": str(vocabulary)}
    chosen = {**decoder_options("pvf"), **options}
    if chosen["planning"] and chosen["width"] > 1:
        raise OptionRefused(
            "this server has no planning vocabulary, so `pvf` runs here only with planning=false or width=1"
        )
    return options


def _base64(k: int, text: str) -> tuple[int, bytes | SampleError]:
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        return k, base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return k, SampleError("image is not valid base64")


def _image_loc(field: str | int) -> tuple[str | int, ...]:
    return (field,) if isinstance(field, str) else ("images", field)


def _refusal_of(error: dict[str, Any], limits: ServiceLimits) -> dict[str, Any]:
    """A pydantic error of the request model as a refusal, in the library's words where it has them."""
    loc, kind, ctx = tuple(error["loc"]), error["type"], error.get("ctx", {})
    if loc[:1] == ("history",) and kind in ("too_short", "too_long"):
        got = f"{ctx['actual_length']} rows" if len(loc) == 1 else f"{ctx['actual_length']} numbers in row {loc[1]}"
        return refusal(loc, f"history must be {HISTORY_SHAPE}; got {got}")
    if loc == ("images",) and kind == "too_long":
        return refusal(loc, f"at most {limits.max_images} images a request here, got {ctx['actual_length']}")
    return refusal(loc, error["msg"])
