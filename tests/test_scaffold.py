import hashlib
import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import responses
from fastddrive.core.scaffold import DEFAULT_EXPLANATION_BUDGET, Scaffold, SlotOverflow
from fastddrive.core.schema import SECTIONS, ResponseError, SpecialTokenText, example_response, parse, render
from fastddrive.core.tokenizer import MissingDiffusionTokens, load_tokenizer
from qwen_tokenizer import plain_explanations


@pytest.fixture(scope="module")
def scaffold(tokenizer):
    return Scaffold(tokenizer)


def test_template_marks_every_position(scaffold):
    n = len(scaffold)
    assert scaffold.template_ids.shape == scaffold.is_value.shape == scaffold.section_index.shape == (n,)
    value_positions = {p for s in scaffold.slots for p in range(s.start, s.end)}
    assert value_positions == {int(p) for p in scaffold.is_value.nonzero()[0]}
    assert (scaffold.template_ids[scaffold.is_value] == scaffold.mask_id).all()
    assert not (scaffold.template_ids[~scaffold.is_value] == scaffold.mask_id).any()
    for slot in scaffold.slots:
        assert set(scaffold.section_index[slot.start : slot.end]) == {SECTIONS.index(slot.section)}


def test_digits_are_one_token_each_and_the_decimal_point_is_scaffold(scaffold):
    budgets = {s.name: s.budget for s in scaffold.slots}
    assert budgets["trajectory.0.x.int"] == 4  # sign + 3 digits
    assert budgets["trajectory.0.x.frac"] == 2
    point = scaffold.slots[[s.name for s in scaffold.slots].index("trajectory.0.x.int")].end
    assert not scaffold.is_value[point]
    assert scaffold.tokenizer.decode([int(scaffold.template_ids[point])]) == "."


@given(responses(plain_explanations))
@settings(max_examples=150, deadline=None)
def test_ids_rebuild_into_json_of_the_same_response(scaffold, response):
    encoded = scaffold.encode(response)
    assert len(encoded.ids) == len(scaffold)
    text = scaffold.text(encoded.ids)
    assert parse(text) == encoded.response
    assert scaffold.decode(encoded.ids) == encoded.response
    data = json.loads(text)
    assert data["explanation"] == encoded.response.explanation
    if not encoded.truncated:
        assert encoded.response == response
        assert text == render(response)
    else:
        assert response.explanation.startswith(encoded.response.explanation)


@given(responses(explanation=plain_explanations.filter(lambda t: len(t.split()) > 0)))
@settings(max_examples=60, deadline=None)
def test_long_explanations_are_cut_at_a_word_boundary(tokenizer, response):
    tight = Scaffold(tokenizer, explanation_budget=4)
    encoded = tight.encode(response)
    kept = encoded.response.explanation
    words = response.explanation.split(" ")
    assert kept == " ".join(words[: len(kept.split(" ")) if kept else 0])
    slot = next(s for s in tight.slots if s.name == "explanation")
    assert sum(t != tight.null_id for t in encoded.ids[slot.start : slot.end]) <= 4


@given(st.integers(4, 64))
@settings(max_examples=61, deadline=None)
def test_blocks_are_section_aligned_for_every_block_size(scaffold, block_size):
    blocks = scaffold.blocks(block_size)
    assert blocks[0].start == 0 and blocks[-1].end == len(scaffold)
    for a, b in zip(blocks, blocks[1:], strict=False):
        assert a.end == b.start
    for block in blocks:
        assert 1 <= len(block) <= block_size
        sections = set(scaffold.section_index[block.start : block.end])
        assert sections == {SECTIONS.index(block.section)}
    assert [b.section for b in blocks] == sorted((b.section for b in blocks), key=SECTIONS.index)
    # Only the last block of a section may be short.
    for a, b in zip(blocks, blocks[1:], strict=False):
        if a.section == b.section:
            assert len(a) == block_size


def test_table_counts_add_up(scaffold):
    rows = {r.section: r for r in scaffold.table()}
    assert list(rows) == [*SECTIONS, "all"]
    assert sum(rows[s].positions for s in SECTIONS) == rows["all"].positions == len(scaffold)
    assert rows["all"].values == int(scaffold.is_value.sum())
    assert rows["explanation"].values == DEFAULT_EXPLANATION_BUDGET
    assert rows["critical_objects"].values == 12  # "yes" and "no" are one token each
    assert 0 < rows["all"].value_share < 0.6


def test_a_value_over_its_budget_names_the_slot(tokenizer):
    small = Scaffold(tokenizer, budgets={"future_meta_behavior.lateral": 1})
    response = example_response()  # lateral "lane_change_left" needs more than one token
    with pytest.raises(SlotOverflow, match="future_meta_behavior.lateral"):
        small.encode(response)


def test_unknown_budget_names_are_refused(tokenizer):
    with pytest.raises(KeyError, match="trajectory.9"):
        Scaffold(tokenizer, budgets={"trajectory.9.x.int": 4})


def test_rebuilding_refuses_garbage_in_a_slot(scaffold):
    ids = scaffold.encode(example_response()).ids
    slot = next(s for s in scaffold.slots if s.name == "future_meta_behavior.longitudinal")
    ids[slot.start] = scaffold.mask_id
    with pytest.raises(ResponseError, match="longitudinal"):
        scaffold.decode(ids)
    with pytest.raises(ResponseError, match="expected"):
        scaffold.decode(ids[:-1])


def test_a_tokenizer_without_the_mask_token_is_refused(tmp_path, tokenizer):
    from transformers import Qwen2Tokenizer

    plain = Qwen2Tokenizer(vocab={"a": 0, "b": 1, "<|endoftext|>": 2}, merges=[])
    with pytest.raises(MissingDiffusionTokens, match=r"\|<MASK>\|"):
        Scaffold(plain)
    plain.save_pretrained(str(tmp_path))
    with pytest.raises(MissingDiffusionTokens):
        Scaffold(load_tokenizer(tmp_path))


def test_allowed_ids_hold_exactly_the_tokens_a_slot_can_take(tokenizer):
    scaffold = Scaffold(tokenizer)
    allowed = scaffold.allowed_ids
    yes_no = {tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no")}
    first = scaffold.slots[0]
    assert first.name.startswith("critical_objects.") and set(allowed[first.start].tolist()) == yes_no
    explanation = next(s for s in scaffold.slots if s.name == "explanation")
    assert all(allowed[p] is None for p in range(explanation.start, explanation.end))
    assert all(allowed[p] is None for p in np.flatnonzero(~scaffold.is_value))
    frac = next(s for s in scaffold.slots if s.name.endswith(".frac"))
    digits = {tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)}
    assert set(allowed[frac.start].tolist()) == digits
    for response in (example_response(),):
        ids = scaffold.encode(response).ids
        assert all(a is None or ids[p] in a for p, a in enumerate(allowed))


@pytest.mark.parametrize(
    ("budget", "digest"),
    [
        (32, "1905b81cc348f12ea1dd4c111e61774531d35bd323cf59e3148436b6a8a4fd44"),
        (192, "b46b309aa2ac971d0b257295372da5ac02356c3482e3254b6937267b4ab8c7e8"),
    ],
)
def test_the_default_layout_is_the_one_the_embedded_checkpoints_were_trained_on(tokenizer, budget, digest):
    for scaffold in (Scaffold(tokenizer, budget), Scaffold(tokenizer, budget, scaffold_tokenization="pieces")):
        layout = scaffold.template_ids.tobytes() + scaffold.section_index.tobytes() + scaffold.is_value.tobytes()
        assert hashlib.sha256(layout).hexdigest() == digest


@pytest.fixture(scope="module")
def runs(tokenizer):
    return Scaffold(tokenizer, scaffold_tokenization="runs")


@given(responses(plain_explanations))
@settings(max_examples=100, deadline=None)
def test_maximal_runs_round_trip_with_fewer_scaffold_tokens(runs, scaffold, response):
    pieces = scaffold
    assert runs.table()[-1].scaffold < pieces.table()[-1].scaffold
    assert [s.budget for s in runs.slots] == [s.budget for s in pieces.slots]
    assert (np.diff(runs.section_index) >= 0).all()
    encoded = runs.encode(response)
    assert runs.decode(encoded.ids) == encoded.response
    if not encoded.truncated:
        assert runs.text(encoded.ids) == render(response)


def test_a_scaffold_run_is_tokenized_as_one_text(runs, tokenizer):
    scaffold = runs
    # '"' closing the last flag, '}' closing the object and ', "explanation": "' form one run.
    last_flag = next(s for s in scaffold.slots if s.name == "critical_objects.door_opening_vehicle")
    explanation = next(s for s in scaffold.slots if s.name == "explanation")
    run = scaffold.template_ids[last_flag.end : explanation.start].tolist()
    assert run == tokenizer.encode('"}, "explanation": "', add_special_tokens=False)
    with pytest.raises(ValueError, match="scaffold_tokenization"):
        Scaffold(tokenizer, scaffold_tokenization="words")


@pytest.mark.parametrize("token", ["<|NULL|>", "|<MASK>|", "<|im_end|>", "<|image_pad|>"])
def test_an_explanation_holding_a_special_token_is_refused(scaffold, tokenizer, token):
    # model_copy skips validation, as a caller building responses by hand might.
    response = example_response().model_copy(update={"explanation": f"I brake{token} now."})
    with pytest.raises(SpecialTokenText, match=re.escape(token)):
        scaffold.encode(response)
    ids = scaffold.encode(example_response()).ids
    ids[next(s for s in scaffold.slots if s.name == "explanation").start] = tokenizer.convert_tokens_to_ids(token)
    if token != "<|NULL|>":  # NULL in a slot is padding: the decoded text never holds it
        with pytest.raises(SpecialTokenText, match=re.escape(token)):
            scaffold.decode(ids)
