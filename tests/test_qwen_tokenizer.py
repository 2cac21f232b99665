"""The scaffold on the real Qwen2.5-VL tokenizer (paper 000 section 3.2, Table 1), rebuilt offline."""

import difflib
import hashlib
import json
import random
import re
import sys
import unicodedata

import numpy as np
import pytest
from hypothesis import given, settings

from conftest import responses
from fastddrive.core.scaffold import Scaffold
from fastddrive.core.schema import (
    CRITICAL_OBJECT_CLASSES,
    LATERAL_BEHAVIORS,
    LONGITUDINAL_BEHAVIORS,
    SECTIONS,
    DrivingResponse,
    MetaBehavior,
    SpecialTokenText,
    example_response,
    parse,
    render,
)
from fastddrive.core.tokenizer import (
    MASK_TOKEN,
    NULL_TOKEN,
    QWEN2_SPLIT_PATTERN,
    QWEN25VL_ADDED_TOKENS,
    QWEN25VL_BPE_RANKS,
    QWEN25VL_SPECIAL_COUNT,
    DiffusionTokenIds,
    diffusion_token_ids,
    load_tokenizer,
    read_bpe_ranks,
)
from qwen_tokenizer import QWEN_TIKTOKEN_SHA256, plain_explanations, qwen_tiktoken_path, qwen_tokenizer

BUDGETS = (32, 192)
MODES = ("pieces", "runs")


@pytest.fixture(scope="module")
def qwen():
    return qwen_tokenizer()


@pytest.fixture(scope="module")
def reference():
    """tiktoken's own BPE over the same ranks, with Qwen2's split regex and added tokens."""
    import tiktoken

    ranks = read_bpe_ranks(qwen_tiktoken_path())
    added = {t: QWEN25VL_BPE_RANKS + k for k, t in enumerate(QWEN25VL_ADDED_TOKENS)}
    return tiktoken.Encoding("qwen2.5", pat_str=QWEN2_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=added)


@pytest.fixture(scope="module")
def scaffolds(qwen):
    return {(b, m): Scaffold(qwen, explanation_budget=b, scaffold_tokenization=m) for b in BUDGETS for m in MODES}


def test_the_ranks_come_from_the_installed_wheel_without_importing_it():
    path = qwen_tiktoken_path()
    assert "dashscope" not in sys.modules
    assert hashlib.sha256(path.read_bytes()).hexdigest() == QWEN_TIKTOKEN_SHA256
    assert len(read_bpe_ranks(path)) == QWEN25VL_BPE_RANKS


def test_ids_are_those_of_qwen25vl(qwen):
    added = qwen.get_added_vocab()
    assert [added[t] for t in QWEN25VL_ADDED_TOKENS] == list(range(151643, 151665))
    assert diffusion_token_ids(qwen) == DiffusionTokenIds(151665, 151666)
    assert len(qwen) == 151667 and qwen.eos_token == "<|im_end|>" and qwen.pad_token == "<|endoftext|>"
    special = set(QWEN25VL_ADDED_TOKENS[:QWEN25VL_SPECIAL_COUNT]) | {MASK_TOKEN, NULL_TOKEN}
    assert set(qwen.all_special_tokens) == special
    # The ids transformers' Qwen2.5-VL integration test expects for the start of an image question.
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    image = "<|im_start|>user\n<|vision_start|><|image_pad|><|image_pad|>"
    assert qwen.encode(system + image) == [
        151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198, 151652, 151655, 151655,
    ]  # fmt: skip
    assert qwen.encode("What is 2 plus 2?<|im_end|>") == [
        3838,
        374,
        220,
        17,
        5519,
        220,
        17,
        30,
        151645,
    ]  # as Qwen chat examples give them


def _strings(ranks: dict[bytes, int]) -> list[str]:
    """Every 10th vocabulary entry, random text of many scripts and whitespace, answers, special tokens."""
    rng = random.Random(0)
    vocab = [t.decode("utf-8", "ignore") for t in list(ranks)[::10]]
    alphabet = [*"abcXYZ 0123456789 \n\t\r'\".,:;{}[]()+-_/\\é中文日本語🚗ß\u00a0!?<|>", *QWEN25VL_ADDED_TOKENS]
    texts = list(vocab)
    for _ in range(2000):
        texts.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(80))))
        texts.append("".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(40))))
        words = (rng.choice(vocab) + rng.choice(["", "'s", "'LL", " 123", "\n\n", "  "]) for _ in range(15))
        texts.append(" ".join(words))
    texts += [render(r) for r in _answers(200, seed=1)]
    return [unicodedata.normalize("NFC", t) for t in texts]  # tiktoken does not normalize; Qwen2 is NFC


def test_token_for_token_equal_to_tiktoken(qwen, reference):
    texts = _strings(read_bpe_ranks(qwen_tiktoken_path()))
    assert len(texts) > 20_000
    ours = qwen(texts, add_special_tokens=False)["input_ids"]
    theirs = reference.encode_batch(texts, allowed_special=set(QWEN25VL_ADDED_TOKENS))
    differ = [t for t, a, b in zip(texts, ours, theirs, strict=True) if a != b]
    assert differ == []
    assert all(qwen.decode(ids) == t for t, ids in zip(texts[-200:], ours[-200:], strict=True))


def test_a_saved_copy_loads_like_a_checkpoint_tokenizer(qwen, tmp_path):
    qwen.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(tmp_path)
    text = f"<|im_start|>assistant\n{render(example_response())}{MASK_TOKEN}{NULL_TOKEN}<|im_end|>"
    assert loaded.encode(text) == qwen.encode(text)
    assert diffusion_token_ids(loaded) == diffusion_token_ids(qwen)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", BUDGETS)
@given(response=responses(plain_explanations))
@settings(max_examples=40, deadline=None)
def test_answers_round_trip(scaffolds, budget, mode, response):
    scaffold = scaffolds[budget, mode]
    encoded = scaffold.encode(response)
    assert len(encoded.ids) == len(scaffold)
    assert scaffold.decode(encoded.ids) == encoded.response
    assert parse(scaffold.text(encoded.ids)) == encoded.response
    if not encoded.truncated:
        assert encoded.response == response and scaffold.text(encoded.ids) == render(response)
    else:
        assert response.explanation.startswith(encoded.response.explanation)


# Paper 000 Table 1 with the real Qwen2.5-VL tokenizer: (positions, scaffold, values) per section, then all.
TABLE_1 = {
    (32, "pieces"): [(104, 92, 12), (39, 7, 32), (25, 19, 6), (101, 41, 60), (269, 159, 110)],
    (192, "pieces"): [(104, 92, 12), (199, 7, 192), (25, 19, 6), (101, 41, 60), (429, 159, 270)],
    (32, "runs"): [(92, 80, 12), (38, 6, 32), (24, 18, 6), (95, 35, 60), (249, 139, 110)],
    (192, "runs"): [(92, 80, 12), (198, 6, 192), (24, 18, 6), (95, 35, 60), (409, 139, 270)],
}


@pytest.mark.parametrize(("budget", "mode"), list(TABLE_1))
def test_table_1(scaffolds, budget, mode):
    rows = scaffolds[budget, mode].table()
    assert [r.section for r in rows] == [*SECTIONS, "all"]
    assert [(r.positions, r.scaffold, r.values) for r in rows] == TABLE_1[budget, mode]


EXPLANATIONS = (
    "The road ahead is clear; I keep my lane and speed.",
    "A slow car is ahead in my lane; the {side} lane is free, so I change lanes.",
    "Traffic ahead has stopped, so I stop behind the car in front.",
    "I yield to the vehicle crossing the intersection before turning {side}.",
    "The car ahead is pulling away, so I speed up to follow it.",
    "I follow the curve of my lane through the roundabout.",
    "A vehicle is cutting into my lane, so I slow down to keep a safe gap.",
    "I take the exit on the {side}.",
)


def _answers(n: int, seed: int = 0) -> list[DrivingResponse]:
    """Simulator-like answers: a few flags, a phrased explanation, a forward trajectory that may drift sideways."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        speed, drift = rng.uniform(0, 30), rng.normal(0, 0.8)
        t = np.arange(1, 6)
        out.append(
            DrivingResponse(
                critical_objects={c: bool(rng.random() < 0.15) for c in CRITICAL_OBJECT_CLASSES},
                explanation=EXPLANATIONS[rng.integers(len(EXPLANATIONS))].format(side=rng.choice(["left", "right"])),
                future_meta_behavior=MetaBehavior(
                    longitudinal=rng.choice(LONGITUDINAL_BEHAVIORS), lateral=rng.choice(LATERAL_BEHAVIORS)
                ),
                trajectory=list(zip(speed * t + rng.normal(0, 0.3, 5), drift * t**1.5, strict=True)),
            )
        )
    return out


def test_maximal_runs_come_as_close_to_the_whole_text_as_fixed_slots_allow(qwen, scaffolds):
    answers = _answers(1000)
    whole = [qwen.encode(render(r)) for r in answers]
    counts = {}
    for mode in MODES:
        scaffold = scaffolds[32, mode]
        kept = [
            [(t, v) for t, v in zip(scaffold.encode(r).ids, scaffold.is_value, strict=True) if t != scaffold.null_id]
            for r in answers
        ]
        counts[mode] = [len(k) for k in kept]
        assert sum(k == w for k, w in zip(([t for t, _ in k] for k in kept), whole, strict=True)) == 0
        # Where the ids part from the whole text's, a value slot's edge is inside: BPE merged across it.
        inside_runs = all(
            op == "equal" or len({v for _, v in k[i1:i2]}) == 2
            for k, w in zip(kept, whole, strict=True)
            for op, i1, i2, _, _ in difflib.SequenceMatcher(a=[t for t, _ in k], b=w, autojunk=False).get_opcodes()
        )
        assert inside_runs == (mode == "runs")
    pieces, runs, text = (np.asarray(c) for c in (counts["pieces"], counts["runs"], [len(w) for w in whole]))
    assert (pieces - runs == 20).all()  # the same values; 159 scaffold tokens become 139
    # Left: a coordinate's sign, which BPE joins to the ", " or "[" before it (Ġ+, Ġ[+, [-), and the
    # explanation's last mark, which it joins to the closing quote (.",).
    assert (runs - text).min() >= 10 and (runs - text).max() <= 11
    assert (pieces.sum(), runs.sum(), text.sum()) == (248_579, 228_579, 218_578)


@pytest.mark.parametrize("token", [*QWEN25VL_ADDED_TOKENS, MASK_TOKEN, NULL_TOKEN])
def test_explanations_holding_any_added_token_are_refused(scaffolds, qwen, token):
    scaffold = scaffolds[32, "runs"]
    response = example_response().model_copy(update={"explanation": f"I slow down {token} here."})
    assert len(qwen.encode(token)) == 1  # the round trip would carry a control token (or drop <|NULL|>)
    with pytest.raises(SpecialTokenText, match="special token"):
        scaffold.encode(response)
    text = json.loads(render(example_response()))
    text["explanation"] = f"I slow down {token} here."
    if token.startswith(("<|", "|<")):
        with pytest.raises(SpecialTokenText, match="special token"):
            parse(json.dumps(text))
    ids = scaffold.encode(example_response()).ids
    ids[next(s for s in scaffold.slots if s.name == "explanation").start] = qwen.convert_tokens_to_ids(token)
    if token != NULL_TOKEN:  # NULL in a slot is padding: the decoded text never holds it
        with pytest.raises(SpecialTokenText, match=re.escape(token)):
            scaffold.decode(ids)
