"""Plan-Verify-Fill (paper 001): width 1 is `sd`, Filter 1 on controlled logits, the AR fallback's check,
the calibrated vocabulary's file, and valid answers on the embedded model."""

import json
import re

import numpy as np
import pytest
import torch

from fastddrive.core.scaffold import Scaffold
from fastddrive.data.dataset import DATASET_FORMAT, MANIFEST, write_shard
from fastddrive.decode.planning_vocabulary import (
    VOCABULARY_FILE,
    PlanningToken,
    PlanningVocabulary,
    PlanningVocabularyError,
    read_vocabulary,
    write_vocabulary,
)
from fastddrive.decode.pvf import (
    Candidate,
    ForwardLog,
    PlanVerifyFill,
    Proposal,
    branch_logits,
    filled,
    predictions,
    pvf_decode,
    tree_layout,
)
from fastddrive.decode.state import Canvas, greedy
from fastddrive.engine.kv_cache import KVCache
from fastddrive.engine.masks import CAUSAL, as_pattern, block_mask
from fastddrive.engine.model import PromptInputs
from fastddrive.engine.model_files import model_path
from fastddrive.eval.pvf_calibration import calibrate_split
from fastddrive.planner import load


@pytest.mark.parametrize("tau", [0.9, 0.6])
def test_width_one_without_revelation_is_sd(embedded, scenes, tau):
    for scene in scenes:
        sd = embedded.plan(scene, "sd", tau=tau)
        one = embedded.plan(scene, "pvf", tau=tau, width=1, reveal=0, fuse_write=False)
        assert one.token_ids == sd.token_ids, scene.scenario
        assert one.nfe == sd.nfe and one.accepted_per_step == sd.accepted_per_step
        assert one.extra["branches_verified"] == 0


def test_fused_writes_give_sd_ids_in_fewer_forwards(embedded, scenes):
    """A finished block fed at the head of the next block's first forward is the same block write: `sd`'s
    ids and steps, one forward less per block that starts with a decided token."""
    saved = []
    for scene in scenes:
        sd = embedded.plan(scene, "sd")
        fused = embedded.plan(scene, "pvf", width=1, reveal=0, fuse_write=True)
        assert fused.token_ids == sd.token_ids, scene.scenario
        assert fused.accepted_per_step == sd.accepted_per_step
        saved.append(sd.nfe - fused.nfe)
    assert min(saved) >= 1, saved


def test_every_route_answers_validly_on_every_scenario(embedded, scenes):
    sd_nfe, pvf_nfe = [], []
    for scene in scenes:
        sd_nfe.append(embedded.plan(scene, "sd").nfe)
        for options in ({}, {"fallback": False}, {"planning": False}):
            result = embedded.plan(scene, "pvf", **options)
            assert result.response is not None, (scene.scenario, options, result.error)
            extra = result.extra
            assert extra["decode_forwards"] == result.nfe - 1  # one batched forward counts once
            assert extra["tokens_per_forward_max"] >= extra["tokens_per_forward_mean"] > 0
            if options == {"fallback": False}:
                assert extra["fallback_steps"] == 0
            if options == {"planning": False}:
                assert extra["planning_steps"] == 0 and extra["planning_vocabulary"] == 0
            if not options:
                pvf_nfe.append(result.nfe)
    assert np.median(pvf_nfe) < np.median(sd_nfe)


def test_branches_in_one_sequence_attend_as_separate_drafts():
    tokens, allowed, offsets = tree_layout([1, 2, 3], 2, [[7, 8], [7, 9]], block=2)
    assert tokens == [1, 2, 3, 7, 8, 3, 7, 9]
    assert offsets.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]  # each copy at the window's own positions
    assert torch.equal(allowed[2:5, 2:5], torch.ones(3, 3, dtype=torch.bool))  # own head and window: one block
    assert torch.equal(allowed[:5, :5], block_mask(5, 2))  # the first copy is the draft made alone
    assert not allowed[2:5, 5:].any() and not allowed[5:, 2:5].any()  # copies never see each other
    assert allowed[5:, :2].all()  # every copy sees the causal head
    _, revealed, _ = tree_layout([1], 0, [[5, 6, 7]], block=2)
    assert not revealed[:3, 3].any() and revealed[3].all()  # the revealed token sees the block, not vice versa


@pytest.mark.parametrize("block_start", [0, 1])
def test_one_forward_of_branches_equals_each_branch_drafted_alone(scenes, block_start):
    planner = load("default")
    planner.model.model.double()  # the two forwards differ in summation order only
    scaffold = planner.scaffold
    canvas = Canvas.prefill(planner.model, planner.prompt(scenes[1]), scaffold)
    canvas.commit_seed(greedy)  # the head: one token, inside the block (start 0) or before it (start 1)
    window = canvas.blank(canvas.committed, 32, scaffold_aware=True)
    masks = [i for i, t in enumerate(window) if t == scaffold.mask_id]
    yes = planner.model.tokenizer.encode("yes", add_special_tokens=False)[0]
    branches = [window, filled(window, [(masks[0], yes)]), filled(window, [(masks[0], yes), (masks[2], yes)])]
    log = ForwardLog()
    together = branch_logits(planner.model, canvas, block_start, len(window), branches, log)
    shared_head = block_start  # the head token is shared when causal, copied into each branch otherwise
    assert log.tokens == [shared_head + 3 * (1 - shared_head + len(window))] and log.branches == 2
    for b, branch in enumerate(branches):
        alone = canvas.draft(planner.model, block_start, branch)[: len(branch)]
        assert torch.allclose(together[b], alone, atol=1e-9), b
    assert not torch.allclose(together[0], together[2])  # the fills change what the block predicts


# ------------------------------------------------------------------ controlled logits


def _logits(probabilities: dict[int, float], vocab: int) -> torch.Tensor:
    """Logits whose softmax puts `probabilities` on their tokens and spreads the rest evenly."""
    rest = (1.0 - sum(probabilities.values())) / (vocab - len(probabilities))
    probs = torch.full((vocab,), rest, dtype=torch.float64)
    for token, p in probabilities.items():
        probs[token] = p
    return probs.log()


def test_filter_one_keeps_the_draft_that_preserves_the_impact_set():
    vocab, tau = 50, 0.9
    route = PlanVerifyFill(4, (0.2, 0.9), 0.1, frozenset({10, 11}), fallback=True)
    columns = [3, 5, 8]  # window indices still masked in the base branch; 8 becomes confident under it
    drafts = [[(3, 10)], [(5, 11)]]
    rows = torch.stack(
        [
            torch.stack([_logits({10: 0.5}, vocab), _logits({11: 0.5}, vocab), _logits({20: 0.95}, vocab)]),
            torch.stack([_logits({10: 0.5}, vocab), _logits({11: 0.6}, vocab), _logits({21: 0.95}, vocab)]),
            torch.stack([_logits({10: 0.9}, vocab), _logits({11: 0.5}, vocab), _logits({20: 0.99}, vocab)]),
        ]
    )
    result = predictions(rows.float(), columns, tau)
    assert [columns[c] for c in result.impact_set()] == [8]
    assert not result.compatible(1, drafts[0])  # the draft at 3 turns 8's top-1 from 20 into 21
    assert result.compatible(2, drafts[1])
    assert route.choose(Proposal("planning", drafts), result) == 2
    assert route.stats["planning_accepted"] == 1 and route.stats["planning_tokens"] == 1
    assert route.choose(Proposal("planning", drafts[:1]), result) == 0  # the only draft breaks it: the base


def test_filter_one_needs_an_impact_set_and_then_prefers_the_larger_information_gain():
    vocab, tau = 50, 0.9
    route = PlanVerifyFill(4, (0.2, 0.9), 0.1, frozenset({10, 11}), fallback=True)
    columns, drafts = [0, 1, 2], [[(0, 10)], [(1, 11)]]
    unsure = _logits({30: 0.4}, vocab)
    no_impact = torch.stack([torch.stack([unsure, unsure, unsure])] * 3)
    assert route.choose(Proposal("planning", drafts), predictions(no_impact.float(), columns, tau)) == 0
    confident = _logits({20: 0.95}, vocab)
    rows = torch.stack(
        [
            torch.stack([unsure, unsure, confident]),
            torch.stack([unsure, _logits({30: 0.6}, vocab), confident]),  # draft 1 sharpens column 1 a little
            torch.stack([_logits({30: 0.9}, vocab), unsure, _logits({20: 0.99}, vocab)]),  # draft 2 more
        ]
    )
    result = predictions(rows.float(), columns, tau)
    assert result.compatible(1, drafts[0]) and result.compatible(2, drafts[1])
    assert result.information_gain(2, drafts[1]) > result.information_gain(1, drafts[0]) > 0
    assert route.choose(Proposal("planning", drafts), result) == 2


def test_the_fallback_commits_the_longest_branch_whose_fills_stay_top_one():
    vocab = 50
    route = PlanVerifyFill(4, (0.8, 0.9), 0.1, frozenset(), fallback=True)
    columns = [4, 6, 9]
    proposal = route.propose([])
    assert proposal.drafts == []
    proposal = route.propose([Candidate(9, 13, 0.5), Candidate(4, 11, 0.3), Candidate(6, 12, 0.05)])
    assert proposal.route == "fallback" and proposal.drafts == [[(4, 11)], [(4, 11), (9, 13)]]  # leftmost >= tau_ar
    keeps, breaks = _logits({11: 0.7}, vocab), _logits({17: 0.7}, vocab)
    other, last = _logits({12: 0.5}, vocab), _logits({13: 0.6}, vocab)
    rows = torch.stack(
        [
            torch.stack([keeps, other, last]),
            torch.stack([keeps, other, last]),
            torch.stack([breaks, other, last]),  # with both fills, the first is no longer the top-1
        ]
    )
    assert route.choose(proposal, predictions(rows.float(), columns, 0.9)) == 1
    assert route.stats["fallback_tokens"] == 1


class ControlledModel:
    """A stand-in for the model whose logits are a rule of the response tokens each position sees, so that
    `pvf_decode` runs on predictions chosen by the test. Forwards follow `BlockDiffusionModel.forward`."""

    def __init__(self, scaffold: Scaffold, rule) -> None:
        self.tokenizer, self.scaffold, self.rule = scaffold.tokenizer, scaffold, rule
        self.vocab = len(scaffold.tokenizer)
        self.forward_hooks, self.source = [], None
        self.cached: dict[int, int] = {}  # response position -> token held by the cache

    def prefill(self, prompt, room):
        self.prompt_length = prompt.input_ids.shape[1]
        cache = KVCache(1, 1, 1, self.prompt_length + room, torch.float32, "cpu")
        cache.advance(self.prompt_length)
        return self.rule({}, 0), cache

    def forward(self, cache, ids, pattern=CAUSAL, offsets=None, keep=None):
        ids = torch.as_tensor(ids).reshape(-1).tolist()
        n, base = len(ids), cache.length - self.prompt_length
        pattern = as_pattern(pattern, n)
        offsets = torch.arange(n) if offsets is None else torch.as_tensor(offsets)
        rows = []
        for j in range(n):
            seen = {p: t for p, t in self.cached.items() if p < base}
            seen |= {base + int(offsets[k]): ids[k] for k in range(n) if pattern[j, k]}
            rows.append(self.rule(seen, base + int(offsets[j]) + 1))
        kept = n if keep is None else keep
        self.cached |= {base + k: ids[k] for k in range(kept)}
        cache.advance(kept)
        return torch.stack(rows)[None]

    def draft(self, cache, ids, causal_head=0):
        return self.forward(cache, ids, block_mask(len(ids), causal_head), keep=0)[0]

    def verify(self, cache, ids):
        return self.forward(cache, ids, CAUSAL)[0]


def _planning_scene(tokenizer):
    """Explanation positions of a controlled scene: `base` is confident at once; `impact` becomes confident
    (token Y) once `base` is filled, unless `a` holds X_a (then Z); `a` and `c` are planning candidates."""
    scaffold = Scaffold(tokenizer)
    slot = next(s for s in scaffold.slots if s.name == "explanation")
    base, a, c, impact = slot.start, slot.start + 1, slot.start + 2, slot.start + 3
    word = {w: tokenizer.encode(w, add_special_tokens=False)[0] for w in (" I", " so", " the", " left", " right")}
    x_a, x_c, y, z = word[" so"], word[" the"], word[" left"], word[" right"]
    vocab = len(tokenizer)

    def rule(seen, position):
        if position == base:
            return _logits({word[" I"]: 0.99}, vocab).float()
        if position == a:
            return _logits({x_a: 0.85}, vocab).float()
        if position == c:
            return _logits({x_c: 0.82}, vocab).float()
        if position == impact:
            if seen.get(a) == x_a:
                return _logits({z: 0.95}, vocab).float()
            return _logits({y: 0.95 if seen.get(base, scaffold.mask_id) != scaffold.mask_id else 0.5}, vocab).float()
        allowed = scaffold.allowed_ids[position] if position < len(scaffold) else None
        return _logits({int(allowed[0]) if allowed is not None else scaffold.null_id: 0.99}, vocab).float()

    return scaffold, rule, (base, a, c, impact), (x_a, x_c, y, z)


def _vocabulary_file(path, tokenizer, ids):
    tokens = tuple(PlanningToken(i, tokenizer.decode([i]), 50, 20, 1.0, 0.1) for i in ids)
    return write_vocabulary(PlanningVocabulary(tokens), path)


@pytest.mark.parametrize("candidates", ["both", "only the breaking one"])
def test_a_planning_draft_that_changes_the_impact_set_is_rejected(tokenizer, tmp_path, candidates):
    scaffold, rule, (_, a, c, impact), (x_a, x_c, y, _) = _planning_scene(tokenizer)
    ids = [x_a, x_c] if candidates == "both" else [x_a]
    vocabulary = _vocabulary_file(tmp_path / "v.json", tokenizer, ids)
    prompt = PromptInputs(torch.zeros(1, 5, dtype=torch.long))
    model = ControlledModel(scaffold, rule)
    decoded = pvf_decode(model, prompt, scaffold, vocabulary=str(vocabulary), fallback=False, reveal=0)
    extra = decoded.extra
    assert decoded.token_ids[impact] == y  # the draft at `a` (which would make it Z) was never committed
    assert (decoded.token_ids[a], decoded.token_ids[c]) == (x_a, x_c)
    assert extra["planning_steps"] >= 1
    if candidates == "both":  # `c` keeps the impact set: committed a step early, beside the base branch
        assert extra["planning_accepted"] == 1 and extra["planning_tokens"] == 1
    else:
        assert extra["planning_accepted"] == 0


# ------------------------------------------------------------------ the vocabulary file


def test_calibration_writes_a_vocabulary_that_pvf_uses(embedded, scenes, tmp_path):
    data = tmp_path / "data"
    record = write_shard(data / "val" / "00000-few.parquet", scenes[:3])
    manifest = {"format": DATASET_FORMAT, "version": 2, "settings": {}, "complete": True}
    (data / MANIFEST).write_text(json.dumps(manifest | {"shards": {"val/00000-few.parquet": record}}))
    seen = []
    vocabulary, path = calibrate_split(
        "default",
        data,
        "val",
        out=tmp_path / "planning.json",
        progress=lambda done, total: seen.append((done, total)),
        min_events=1,
        min_verifiable=1,
        min_verified_rate=0.5,
        min_gain=0.0,
    )
    assert path == tmp_path / "planning.json" and seen[0] == (0, 3) and seen[-1] == (3, 3)
    assert vocabulary.tokens and vocabulary.counts["scenes"] == 3 and vocabulary.settings["split"] == "val"
    read = read_vocabulary(path)
    assert read.ids == vocabulary.ids
    assert all(embedded.model.tokenizer.decode([t.id]) == t.text for t in read.tokens)
    assert all(t.verified_rate >= 0.5 and t.events >= 1 for t in read.tokens)
    result = embedded.plan(scenes[0], "pvf", vocabulary=str(path), plan_low=0.0, plan_high=0.9)
    assert result.extra["planning_vocabulary"] == len(read.tokens)
    assert result.extra["planning_steps"] > 0 and result.response is not None


def test_the_embedded_model_ships_its_vocabulary(embedded):
    shipped = read_vocabulary(model_path("default") / VOCABULARY_FILE)
    assert shipped.tokens and shipped.settings["tau"] == 0.9 and shipped.settings["block_size"] == 32
    assert embedded.model.source == model_path("default")


def test_a_missing_or_malformed_vocabulary_is_a_clear_error(embedded, scenes, tmp_path):
    missing = tmp_path / "none.json"
    with pytest.raises(PlanningVocabularyError, match=f"no planning vocabulary at {re.escape(str(missing))}"):
        embedded.plan(scenes[0], "pvf", vocabulary=str(missing))
    bad = tmp_path / "bad.json"
    for text, problem in [
        ("{not json", "is not valid JSON"),
        (json.dumps({"tokens": []}), "is not a planning vocabulary"),
        (json.dumps({"format": "fastddrive-pvf-vocabulary", "tokens": {}}), "'tokens' must be a list"),
        (json.dumps({"format": "fastddrive-pvf-vocabulary", "tokens": [{"id": 3}]}), "token entry 0 is malformed"),
    ]:
        bad.write_text(text)
        with pytest.raises(PlanningVocabularyError, match=f"{re.escape(str(bad))}.*{re.escape(problem)}"):
            read_vocabulary(bad)
    tokenizer = embedded.model.tokenizer
    foreign = PlanningToken(5, tokenizer.decode([5]) + "x", 50, 20, 1.0, 0.1)
    write_vocabulary(PlanningVocabulary((foreign,)), bad)
    with pytest.raises(PlanningVocabularyError, match="calibrated for another tokenizer"):
        embedded.plan(scenes[0], "pvf", vocabulary=str(bad))
    assert embedded.plan(scenes[0], "pvf", planning=False, vocabulary=str(missing)).response is not None


def test_a_model_not_loaded_from_a_folder_needs_a_vocabulary_path(embedded, scenes):
    model = embedded.model
    source, model.source = model.source, None
    try:
        with pytest.raises(PlanningVocabularyError, match="not loaded from a folder.*vocabulary=PATH"):
            embedded.plan(scenes[0], "pvf")
        assert embedded.plan(scenes[0], "pvf", width=1).response is not None  # no drafts: nothing to read
    finally:
        model.source = source
