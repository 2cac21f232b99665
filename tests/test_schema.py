import json
import math
import re

import pytest
from hypothesis import given, settings

from conftest import responses
from fastddrive.core.schema import (
    CRITICAL_OBJECT_CLASSES,
    DrivingResponse,
    ResponseError,
    example_response,
    format_coordinate,
    parse,
    render,
    render_pieces,
)
from qwen_tokenizer import plain_explanations


@given(responses(plain_explanations))
@settings(max_examples=300, deadline=None)
def test_parse_inverts_render(response):
    text = render(response)
    assert parse(text) == response
    assert render(parse(text)) == text
    json.loads(text)  # the rendered text is JSON


@given(responses(plain_explanations))
@settings(max_examples=100, deadline=None)
def test_every_coordinate_has_the_same_width(response):
    coordinates = [p.text for p in render_pieces(response) if p.slot and p.slot.startswith("trajectory")]
    assert {len(c) for c in coordinates if c[0] in "+-"} == {4}
    assert {len(c) for c in coordinates if c[0] not in "+-"} == {2}


def test_rendered_text_matches_the_release_layout():
    text = render(example_response())
    data = json.loads(text)
    assert list(data) == ["critical_objects", "explanation", "future_meta_behavior", "trajectory"]
    assert list(data["critical_objects"]) == list(CRITICAL_OBJECT_CLASSES)
    assert data["critical_objects"]["nearby_vehicle"] == "yes"
    assert (
        data["trajectory"] == "[[+014.70, +000.04], [+029.10, +000.35], [+043.20, +001.10], "
        "[+057.05, +002.30], [+070.80, +003.40]]"
    )
    assert format_coordinate(-0.04) == "-000.04"


def test_coordinates_round_to_centimetres_and_zero_has_one_sign():
    response = example_response().model_copy()
    moved = DrivingResponse.model_validate({**response.model_dump(), "trajectory": [(1.004, -0.001)] * 5})
    assert moved.trajectory[0] == (1.0, 0.0)
    assert math.copysign(1, moved.trajectory[0][1]) == 1


def _json_with(**changes):
    data = json.loads(render(example_response()))
    for key, value in changes.items():
        data[key] = value
    return json.dumps(data)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            _json_with(critical_objects={**{c: "no" for c in CRITICAL_OBJECT_CLASSES}, "truck": "yes"}),
            "unknown critical-object class 'truck'",
        ),
        (
            _json_with(critical_objects={c: "no" for c in CRITICAL_OBJECT_CLASSES[1:]}),
            "missing critical-object classes: nearby_vehicle",
        ),
        (_json_with(critical_objects={c: "maybe" for c in CRITICAL_OBJECT_CLASSES}), "must be 'yes' or 'no'"),
        (
            _json_with(future_meta_behavior={"longitudinal": "fly", "lateral": "straight"}),
            "unknown longitudinal behaviour 'fly'",
        ),
        (
            _json_with(future_meta_behavior={"longitudinal": "keep", "lateral": "drift"}),
            "unknown lateral behaviour 'drift'",
        ),
        (_json_with(trajectory="[[+001.00, +000.00], [+002.00, +000.00]]"), "must have 5 waypoints"),
        (_json_with(trajectory=[[1, 0]] * 6), "must have 5 waypoints"),
        (_json_with(trajectory=[[1000.5, 0]] + [[1, 0]] * 4), "outside the fixed-width range"),
        (_json_with(trajectory=[[float("nan"), 0]] + [[1, 0]] * 4), "is NaN"),
        (_json_with(trajectory="[[+001.00 +000.00]]"), "not a list of [x, y] pairs"),
        ('{"critical_objects": ', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_responses_are_refused_with_the_reason(text, message):
    with pytest.raises(ResponseError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse(text)


def test_direct_construction_validates_too():
    with pytest.raises(ValueError, match="unknown lateral behaviour"):
        DrivingResponse.model_validate(
            {**example_response().model_dump(), "future_meta_behavior": {"longitudinal": "keep", "lateral": "hover"}}
        )
    with pytest.raises(ValueError, match="is NaN"):
        DrivingResponse.model_validate({**example_response().model_dump(), "trajectory": [(math.nan, 0.0)] * 5})


def test_explanations_are_nfc_so_they_survive_the_tokenizer():
    from fastddrive.core.schema import example_response

    response = example_response().model_copy(update={"explanation": "\U0002f800"})
    assert DrivingResponse.model_validate(response.model_dump()).explanation == "\u4e3d"


@pytest.mark.parametrize("token", ["<|NULL|>", "|<MASK>|", "<|im_end|>", "<|vision_start|>", "<|fim_pad|>"])
def test_an_explanation_holding_a_special_token_text_is_refused(token):
    from fastddrive.core.schema import SpecialTokenText, from_slot_values

    data = json.loads(render(example_response()))
    data["explanation"] = f"The light is red{token}, so I stop."
    with pytest.raises(SpecialTokenText, match=re.escape(f"explanation: contains '{token}'")):
        parse(json.dumps(data))
    values = {p.slot: p.text for p in render_pieces(example_response()) if p.slot}
    with pytest.raises(SpecialTokenText):
        from_slot_values(values | {"explanation": token})
    with pytest.raises(ValueError, match="special token"):
        DrivingResponse.model_validate({**example_response().model_dump(), "explanation": token})


@pytest.mark.parametrize("text", ["a < b | c > d", "<|", "|>", "<| |>", "x |< y >| z"])
def test_text_that_only_looks_like_a_special_token_is_kept(text):
    response = DrivingResponse.model_validate({**example_response().model_dump(), "explanation": text})
    assert parse(render(response)).explanation == text
