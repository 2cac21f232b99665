"""The structured driving response the planner writes (paper 000 section 3.2; DESIGN section 3).

One answer has four sections, always in this order: `critical_objects` (12 yes/no detections),
`explanation` (free text), `future_meta_behavior` (longitudinal + lateral decision) and `trajectory`
(5 waypoints at t = 1..5 s, metres, ego frame at t = 0: +x forward, +y left).

The text form is JSON in which every coordinate is written fixed-width with an explicit sign
(`+014.70`), so that every coordinate has the same token layout. The trajectory is a quoted string,
as in the official release, because JSON numbers may not carry a `+` or leading zeros.

`render_pieces` is the single definition of that text: it yields the fixed scaffold text and the
value slots in order. `render`, the token scaffold (`scaffold.py`) and `from_slot_values` are all
built on it, so the text a scaffold rebuilds is, by construction, text that `parse` accepts.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

SECTIONS: tuple[str, ...] = ("critical_objects", "explanation", "future_meta_behavior", "trajectory")

CRITICAL_OBJECT_CLASSES: tuple[str, ...] = (
    "nearby_vehicle",
    "pedestrian",
    "cyclist",
    "construction",
    "traffic_element",
    "weather_condition",
    "road_hazard",
    "emergency_vehicle",
    "animal",
    "special_vehicle",
    "conflicting_vehicle",
    "door_opening_vehicle",
)
LONGITUDINAL_BEHAVIORS: tuple[str, ...] = ("keep", "accelerate", "decelerate", "stop", "other")
LATERAL_BEHAVIORS: tuple[str, ...] = (
    "straight",
    "yield",
    "left_turn",
    "right_turn",
    "lane_follow",
    "lane_change_left",
    "lane_change_right",
    "reverse",
    "overtake",
    "other",
)

NUM_WAYPOINTS = 5
WAYPOINT_INTERVAL_S = 1.0
COORD_INT_DIGITS = 3
COORD_FRAC_DIGITS = 2
COORD_LIMIT_M = 10**COORD_INT_DIGITS - 10**-COORD_FRAC_DIGITS  # 999.99 m

_YES_NO = {"yes": True, "no": False}
_NUMBER = r"[+-]?\d+(?:\.\d+)?"
_PAIR = rf"\[\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\]"
_TRAJECTORY_TEXT = re.compile(rf"^\s*\[\s*{_PAIR}(?:\s*,\s*{_PAIR})*\s*\]\s*$")
_INT_PART = re.compile(rf"^[+-]\d{{{COORD_INT_DIGITS}}}$")
_FRAC_PART = re.compile(rf"^\d{{{COORD_FRAC_DIGITS}}}$")
# The text of a control token: Qwen's `<|im_end|>`, `<|vision_start|>`, ... and fastddrive's `<|NULL|>`, `|<MASK>|`.
SPECIAL_TOKEN_TEXT = re.compile(r"<\|[^<>|\s]+\|>|\|<[^<>|\s]+>\|")
_SPECIAL_TOKEN_ERROR = "special_token_text"
META_TEXT_LIMIT = 64  # characters of a verbatim meta-behaviour phrase (the release's are at most 3 tokens)


class ResponseError(ValueError):
    """A driving response that is malformed or outside the schema."""


class SpecialTokenText(ResponseError):
    """An explanation holding a special token's text, which a token scaffold would turn into that control
    token or lose (<|NULL|> is padding, |<MASK>| an undecided position; paper 000 section 3.2)."""


class MetaBehavior(BaseModel):
    """The decision for the next 5 s, from the release's two vocabularies.

    A release answer's phrase that names none of them is kept verbatim (`core.release_answer`): validated with
    the context `{"free_meta_text": True}`, a value outside the vocabulary is accepted as one line of at most
    `META_TEXT_LIMIT` characters without a special token's text.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    longitudinal: str
    lateral: str

    @field_validator("longitudinal")
    @classmethod
    def _known_longitudinal(cls, value: str, info: ValidationInfo) -> str:
        return _meta_value("longitudinal", value, LONGITUDINAL_BEHAVIORS, info)

    @field_validator("lateral")
    @classmethod
    def _known_lateral(cls, value: str, info: ValidationInfo) -> str:
        return _meta_value("lateral", value, LATERAL_BEHAVIORS, info)


def _meta_value(what: str, value: str, known: tuple[str, ...], info: ValidationInfo) -> str:
    if value in known:
        return value
    if not (info.context or {}).get("free_meta_text"):
        raise ValueError(f"unknown {what} behaviour {value!r}; known: {', '.join(known)}")
    if not value.strip() or len(value) > META_TEXT_LIMIT or "\n" in value or SPECIAL_TOKEN_TEXT.search(value):
        raise ValueError(
            f"{what} behaviour {value[:META_TEXT_LIMIT]!r} is not a phrase: one line of 1 to {META_TEXT_LIMIT} "
            "characters without a special token's text"
        )
    return value


class DrivingResponse(BaseModel):
    """A validated driving answer. Coordinates are metres in the ego frame, rounded to 1 cm."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    critical_objects: dict[str, bool]
    explanation: str
    future_meta_behavior: MetaBehavior
    trajectory: tuple[tuple[float, float], ...]

    @field_validator("critical_objects", mode="before")
    @classmethod
    def _twelve_classes(cls, value: Any) -> dict[str, bool]:
        if not isinstance(value, Mapping):
            raise ValueError(f"critical_objects must be a mapping of class -> yes/no, got {type(value).__name__}")
        unknown = [k for k in value if k not in CRITICAL_OBJECT_CLASSES]
        if unknown:
            raise ValueError(
                f"unknown critical-object class {unknown[0]!r}; known: {', '.join(CRITICAL_OBJECT_CLASSES)}"
            )
        missing = [k for k in CRITICAL_OBJECT_CLASSES if k not in value]
        if missing:
            raise ValueError(f"missing critical-object classes: {', '.join(missing)}")
        return {name: _as_flag(name, value[name]) for name in CRITICAL_OBJECT_CLASSES}

    @field_validator("explanation")
    @classmethod
    def _one_line(cls, value: str) -> str:
        # One canonical spelling per explanation: runs of whitespace (newlines included) become a space, and
        # Unicode is NFC, as the Qwen2 tokenizer normalizes it (else U+2F800 would come back as U+4E3D).
        text = " ".join(unicodedata.normalize("NFC", value).split())
        if found := SPECIAL_TOKEN_TEXT.search(text):
            raise PydanticCustomError(
                _SPECIAL_TOKEN_ERROR,
                "contains '{token}', written like a special token (<|...|>, |<...>|), which a scaffold cannot carry",
                {"token": found.group()},
            )
        return text

    @field_validator("trajectory", mode="before")
    @classmethod
    def _five_waypoints(cls, value: Any) -> tuple[tuple[float, float], ...]:
        try:
            points = [tuple(p) for p in value]
        except TypeError as err:
            raise ValueError("trajectory must be a sequence of [x, y] waypoints") from err
        if len(points) != NUM_WAYPOINTS:
            raise ValueError(f"trajectory must have {NUM_WAYPOINTS} waypoints (t = 1..5 s), got {len(points)}")
        out = []
        for i, point in enumerate(points):
            if len(point) != 2:
                raise ValueError(f"waypoint {i} must be [x, y], got {len(point)} numbers")
            out.append(tuple(_coordinate(f"waypoint {i} {axis}", v) for axis, v in zip("xy", point, strict=True)))
        return tuple(out)


def _as_flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value in _YES_NO:
        return _YES_NO[value]
    raise ValueError(f"critical object {name!r} must be 'yes' or 'no', got {value!r}")


def _coordinate(what: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what} is not a number: {value!r}") from err
    if math.isnan(number):
        raise ValueError(f"{what} is NaN")
    number = round(number, COORD_FRAC_DIGITS)
    if abs(number) > COORD_LIMIT_M:
        raise ValueError(f"{what} = {value} m is outside the fixed-width range +-{COORD_LIMIT_M} m")
    return number + 0.0  # -0.0 -> 0.0, so that zero has one spelling


def format_coordinate(value: float) -> str:
    """Fixed-width signed text of one coordinate in metres, e.g. `+014.70`."""
    width = 1 + COORD_INT_DIGITS + 1 + COORD_FRAC_DIGITS
    return f"{value:+0{width}.{COORD_FRAC_DIGITS}f}"


@dataclass(frozen=True)
class Piece:
    """A run of response text: fixed scaffold text (`slot is None`) or the value of one named slot."""

    text: str
    section: str
    slot: str | None = None


def coordinate_slots(index: int, axis: str) -> tuple[str, str]:
    """Names of the two value slots of one coordinate: sign + integer digits, and decimals."""
    return f"trajectory.{index}.{axis}.int", f"trajectory.{index}.{axis}.frac"


def render_pieces(response: DrivingResponse) -> list[Piece]:
    """The response text as scaffold pieces and value slots, in decode order."""
    co, ex, fmb, tr = SECTIONS
    pieces: list[Piece] = []
    for i, name in enumerate(CRITICAL_OBJECT_CLASSES):
        opening = '{"critical_objects": {' if i == 0 else ", "
        pieces.append(Piece(f'{opening}"{name}": "', co))
        pieces.append(Piece("yes" if response.critical_objects[name] else "no", co, f"{co}.{name}"))
        pieces.append(Piece('"', co))
    pieces.append(Piece("}", co))

    pieces.append(Piece(', "explanation": "', ex))
    pieces.append(Piece(json.dumps(response.explanation, ensure_ascii=False)[1:-1], ex, ex))
    pieces.append(Piece('"', ex))

    meta = response.future_meta_behavior
    pieces.append(Piece(', "future_meta_behavior": {"longitudinal": "', fmb))
    pieces.append(Piece(meta.longitudinal, fmb, f"{fmb}.longitudinal"))
    pieces.append(Piece('", "lateral": "', fmb))
    pieces.append(Piece(meta.lateral, fmb, f"{fmb}.lateral"))
    pieces.append(Piece('"}', fmb))

    pieces.append(Piece(', "trajectory": "[', tr))
    for i, point in enumerate(response.trajectory):
        pieces.append(Piece("[" if i == 0 else ", [", tr))
        for axis, value in zip("xy", point, strict=True):
            int_slot, frac_slot = coordinate_slots(i, axis)
            whole, frac = format_coordinate(value).split(".")
            if axis == "y":
                pieces.append(Piece(", ", tr))
            pieces.append(Piece(whole, tr, int_slot))
            pieces.append(Piece(".", tr))
            pieces.append(Piece(frac, tr, frac_slot))
        pieces.append(Piece("]", tr))
    pieces.append(Piece(']"}', tr))
    return pieces


def render(response: DrivingResponse) -> str:
    """The response as JSON text with fixed-width signed coordinates."""
    return "".join(p.text for p in render_pieces(response))


def slot_choices(slot: str) -> tuple[str, ...] | None:
    """Every text a value slot can hold, or None for the free-text explanation."""
    if slot.startswith("critical_objects."):
        return tuple(_YES_NO)
    if slot == "future_meta_behavior.longitudinal":
        return LONGITUDINAL_BEHAVIORS
    if slot == "future_meta_behavior.lateral":
        return LATERAL_BEHAVIORS
    if slot.endswith(".int"):
        digits = ("".join(d) for d in product("0123456789", repeat=COORD_INT_DIGITS))
        return tuple(sign + d for d in digits for sign in "+-")
    if slot.endswith(".frac"):
        return tuple("".join(d) for d in product("0123456789", repeat=COORD_FRAC_DIGITS))
    if slot == "explanation":
        return None
    raise KeyError(f"unknown slot {slot!r}")


def from_slot_values(values: Mapping[str, str]) -> DrivingResponse:
    """Build a response from the text of every value slot (the inverse of `render_pieces`).

    Raises ResponseError naming the slot whose text is not a valid value.
    """
    try:
        explanation = json.loads(f'"{values["explanation"]}"')
    except json.JSONDecodeError as err:
        raise ResponseError(f"slot 'explanation' is not valid JSON string content: {err.msg}") from None
    trajectory = []
    for i in range(NUM_WAYPOINTS):
        point = []
        for axis in "xy":
            int_slot, frac_slot = coordinate_slots(i, axis)
            whole, frac = values[int_slot], values[frac_slot]
            if not _INT_PART.match(whole):
                raise ResponseError(f"slot {int_slot!r} must be a sign and {COORD_INT_DIGITS} digits, got {whole!r}")
            if not _FRAC_PART.match(frac):
                raise ResponseError(f"slot {frac_slot!r} must be {COORD_FRAC_DIGITS} digits, got {frac!r}")
            point.append(float(f"{whole}.{frac}"))
        trajectory.append(point)
    return _validated(
        {
            "critical_objects": {c: values[f"critical_objects.{c}"] for c in CRITICAL_OBJECT_CLASSES},
            "explanation": explanation,
            "future_meta_behavior": {
                "longitudinal": values["future_meta_behavior.longitudinal"],
                "lateral": values["future_meta_behavior.lateral"],
            },
            "trajectory": trajectory,
        }
    )


def parse(text: str, free_meta_text: bool = False) -> DrivingResponse:
    """Parse and validate response JSON text; raises ResponseError saying what is wrong. `free_meta_text` keeps
    a meta-behaviour value outside the vocabulary verbatim (a release answer's phrase)."""
    return from_json_object(json_object(text), free_meta_text)


def json_object(text: str) -> dict[str, Any]:
    """Response text as a JSON object; ResponseError when it is not JSON or not an object."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ResponseError(f"response is not valid JSON: {err.msg} at character {err.pos}") from None
    if not isinstance(data, dict):
        raise ResponseError(f"response must be a JSON object, got {type(data).__name__}")
    return data


def from_json_object(data: Mapping[str, Any], free_meta_text: bool = False) -> DrivingResponse:
    """The validated response of a parsed JSON object (a trajectory given as text, as the release writes it, is
    read into its pairs); ResponseError saying what is wrong."""
    trajectory = data.get("trajectory")
    if isinstance(trajectory, str):
        match = _TRAJECTORY_TEXT.match(trajectory)
        if match is None:
            raise ResponseError(f"trajectory text is not a list of [x, y] pairs: {trajectory[:80]!r}")
        numbers = re.findall(_NUMBER, trajectory)
        data = {**data, "trajectory": [numbers[i : i + 2] for i in range(0, len(numbers), 2)]}
    return _validated(data, free_meta_text)


def _validated(data: Mapping[str, Any], free_meta_text: bool = False) -> DrivingResponse:
    try:
        return DrivingResponse.model_validate(dict(data), context={"free_meta_text": free_meta_text})
    except ValueError as err:
        errors = getattr(err, "errors", None)
        special = errors is not None and errors()[0]["type"] == _SPECIAL_TOKEN_ERROR
        raise (SpecialTokenText if special else ResponseError)(_first_error(err)) from None


def _first_error(err: ValueError) -> str:
    errors = getattr(err, "errors", None)
    if errors is None:
        return str(err)
    first = errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def example_response() -> DrivingResponse:
    """A fixed valid response: used for the scaffold layout and in documentation."""
    flags = {name: name == "nearby_vehicle" for name in CRITICAL_OBJECT_CLASSES}
    return DrivingResponse(
        critical_objects=flags,
        explanation="The car ahead is slower, so I change to the left lane to pass it.",
        future_meta_behavior=MetaBehavior(longitudinal="keep", lateral="lane_change_left"),
        trajectory=((14.7, 0.04), (29.1, 0.35), (43.2, 1.1), (57.05, 2.3), (70.8, 3.4)),
    )
