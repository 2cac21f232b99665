"""The release token layout (issue 34; `core.release_answer`, `Scaffold(scaffold_tokenization="release")`) with the
real Qwen2.5-VL tokenizer: the answer is the release's text tokenized as one, coordinates start with ' +' / ' -',
the explanation is 192 NULL-padded positions in blocks of 32 value positions, meta-behaviour phrases map to our
values or stay verbatim."""

import json

import pytest
from hypothesis import given, settings

from conftest import responses
from fastddrive.core.release_answer import LATERAL_PHRASES, LONGITUDINAL_PHRASES, parse_release, render_release
from fastddrive.core.scaffold import Scaffold, SlotOverflow
from fastddrive.core.schema import (
    SECTIONS,
    MetaBehavior,
    ResponseError,
    SpecialTokenText,
    example_response,
    parse,
    render,
)
from qwen_tokenizer import plain_explanations, qwen_tokenizer

# An answer as the release writes it (its trajectory string, its meta phrases), NULL padding already stripped.
RELEASE_TEXT = (
    '{"critical_objects": {"nearby_vehicle": "yes", "pedestrian": "no", "cyclist": "no", "construction": "no", '
    '"traffic_element": "no", "weather_condition": "no", "road_hazard": "no", "emergency_vehicle": "no", '
    '"animal": "no", "special_vehicle": "no", "conflicting_vehicle": "no", "door_opening_vehicle": "no"}, '
    '"explanation": "A car ahead is slowing, so I keep my lane and my speed.", '
    '"future_meta_behavior": {"longitudinal": "keep speed ", "lateral": "go straight "}, '
    '"trajectory": "[[ +014.70, -000.04], [ +029.55, -000.10], [ +044.30, -000.21], [ +059.00, -000.35], '
    '[ +073.65, -000.52]]"}'
)


@pytest.fixture(scope="module")
def qwen():
    return qwen_tokenizer()


@pytest.fixture(scope="module")
def release(qwen):
    return Scaffold(qwen, explanation_budget=192, scaffold_tokenization="release")


@given(response=responses(plain_explanations))
@settings(max_examples=60, deadline=None)
def test_an_answer_is_the_whole_release_text_tokenized_as_one(release, qwen, response):
    encoded = release.encode(response)
    assert len(encoded.ids) == len(release)
    kept = [t for t in encoded.ids if t != release.null_id]
    assert kept == qwen.encode(render_release(encoded.response))  # no cut: the whole text's own BPE
    assert release.decode(encoded.ids) == encoded.response
    assert parse_release(render_release(encoded.response)) == encoded.response
    scaffold = ~release.is_value
    assert (encoded.ids == release.template_ids)[scaffold].all()  # the scaffold ids are the same in every answer
    if not encoded.truncated:
        assert encoded.response == response
    else:
        assert response.explanation.startswith(encoded.response.explanation)


def test_the_release_text_is_read_with_its_phrases_mapped_to_our_values(release):
    response = parse_release(RELEASE_TEXT)
    assert response.future_meta_behavior == MetaBehavior(longitudinal="keep", lateral="straight")
    assert response.trajectory[0] == (14.7, -0.04) and response.trajectory[4] == (73.65, -0.52)
    assert render_release(response) == RELEASE_TEXT  # the release's spacing, signs and widths
    assert parse(render(response)) == response  # and it is an answer of our own format too
    for value, phrase in (LONGITUDINAL_PHRASES | LATERAL_PHRASES).items():
        assert len(release.tokenizer.encode(phrase.rstrip())) <= 3, (value, phrase)  # the release's 3 tokens


def test_a_phrase_outside_the_vocabulary_is_kept_verbatim_and_only_the_release_layout_carries_it(release, qwen):
    text = RELEASE_TEXT.replace('"keep speed "', '"ease off "')
    response = parse_release(text)
    assert response.future_meta_behavior.longitudinal == "ease off "
    encoded = release.encode(response)
    assert release.decode(encoded.ids) == response and release.text(encoded.ids) == text
    with pytest.raises(ResponseError, match="unknown longitudinal behaviour 'ease off '"):
        parse(render(response))  # our own format keeps its strict vocabulary
    with pytest.raises(ResponseError, match="only the release layout"):
        Scaffold(qwen, scaffold_tokenization="runs").encode(response)
    for bad in ('"a\\nb"', '"<|im_end|>"', json.dumps("x" * 65)):
        with pytest.raises(ResponseError, match="is not a phrase"):
            parse_release(RELEASE_TEXT.replace('"keep speed "', bad))
    with pytest.raises(SlotOverflow, match="future_meta_behavior.longitudinal"):
        release.encode(parse_release(RELEASE_TEXT.replace('"keep speed "', '"ease off the gas a little "')))


def test_coordinates_start_with_the_sign_tokens_and_the_explanation_has_192_positions(release, qwen):
    signs = {qwen.convert_tokens_to_ids(t) for t in ("Ġ+", "Ġ-")}
    assert {qwen.decode([s]) for s in signs} == {" +", " -"}
    ints = [s for s in release.slots if s.name.endswith(".int")]
    assert len(ints) == 10 and all(set(release.allowed_ids[s.start].tolist()) == signs for s in ints)
    assert all(len(release.allowed_ids[s.start + k]) == 10 for s in ints for k in (1, 2, 3))  # then 3 digits
    explanation = next(s for s in release.slots if s.name == "explanation")
    assert explanation.budget == 192
    assert [(r.positions, r.values) for r in release.table()] == [(92, 12), (196, 192), (26, 12), (90, 60), (404, 276)]


def test_blocks_count_value_positions_and_never_span_two_sections(release):
    blocks = release.blocks(32)
    assert blocks[0].start == 0 and blocks[-1].end == len(release)
    assert all(a.end == b.start for a, b in zip(blocks, blocks[1:], strict=False))
    values = [int(release.is_value[b.start : b.end].sum()) for b in blocks]
    assert all(0 < v <= 32 for v in values)
    assert all(release.section_index[b.start] == release.section_index[b.end - 1] for b in blocks)
    per_section = {s: [v for b, v in zip(blocks, values, strict=True) if b.section == s] for s in SECTIONS}
    assert per_section == {
        "critical_objects": [12],
        "explanation": [32] * 6,
        "future_meta_behavior": [12],
        "trajectory": [32, 28],
    }
    for size in (8, 32):  # a block closes on its last value: the scaffold before a value joins the value's block
        for block in release.blocks(size):
            assert release.is_value[block.end - 1] or block.end == release.section_spans[block.section][1]


def test_a_control_token_in_a_value_position_is_refused_by_name(release, qwen):
    ids = release.encode(example_response()).ids
    explanation = next(s for s in release.slots if s.name == "explanation")
    ids[explanation.start + 2] = qwen.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(SpecialTokenText, match="im_end"):
        release.decode(ids)
    ids = release.encode(example_response()).ids
    ids[explanation.start] = release.null_id  # the opening quote lost: not JSON, named as such
    with pytest.raises(ResponseError, match="not valid JSON"):
        release.decode(ids)
