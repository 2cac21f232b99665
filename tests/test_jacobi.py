"""Jacobi decoding and multi-block Jacobi with rejection recycling (paper 003): token-for-token greedy `ar`
on models whose outputs vary, with initial iterates of known quality, and the algorithm's own promises."""

import math

import numpy as np
import pytest
import torch

from fastddrive.decode import DecoderError, decode, jacobi_mr
from fastddrive.decode.jacobi_mr import NgramPool, layout
from fastddrive.planner import load
from model_fixtures import one_scene_per_scenario, peaky_case


@pytest.fixture(scope="module", params=[("qwen2", 0), ("qwen2.5-vl", 2), ("qwen2", 7)])
def case(request):
    model, prompt, scaffold = peaky_case(*request.param)
    reference = decode("ar", model, prompt, scaffold).token_ids
    values = [t for t, v in zip(reference, scaffold.is_value, strict=True) if v]
    assert len(set(values)) > 20  # the reference varies, so equal ids are not a coincidence
    return model, prompt, scaffold, reference


def corrupted(reference: list[int], rate: float, vocab: int, seed: int = 0) -> list[int]:
    """`ar`'s ids, each replaced by another token with probability `rate`."""
    rng = np.random.default_rng(seed)
    return [(t + 1 + int(rng.integers(vocab - 1))) % vocab if rng.random() < rate else t for t in reference]


def forwards_with_perfect_guesses(length: int, block_size: int) -> int:
    """The prefill, then one forward per block: a block's first token comes from the previous forward (or
    the prefill), so a block of one position needs none."""
    blocks = [min(block_size, length - start) for start in range(0, length, block_size)]
    return 1 + sum(size > 1 for size in blocks)


@pytest.mark.parametrize("block_size", [4, 8, 16, 32])
def test_jacobi_equals_ar_from_random_and_oracle_guesses(case, block_size):
    model, prompt, scaffold, reference = case
    scratch = decode("jacobi", model, prompt, scaffold, block_size=block_size)
    assert scratch.token_ids == reference
    assert min(scratch.accepted_per_step) >= 1  # at least one token per forward
    oracle = decode("jacobi", model, prompt, scaffold, block_size=block_size, drafts=reference)
    assert oracle.token_ids == reference
    assert oracle.nfe == forwards_with_perfect_guesses(len(scaffold), block_size)  # a whole block per forward
    for rate in (0.2, 0.5):
        noisy = decode("jacobi", model, prompt, scaffold, block_size=block_size, drafts=corrupted(reference, rate, 800))
        assert noisy.token_ids == reference
        assert oracle.nfe < noisy.nfe <= scratch.nfe + 1


@pytest.mark.parametrize(("block_size", "max_blocks"), [(4, 4), (8, 2), (16, 1), (16, 4), (32, 2)])
def test_jacobi_mr_equals_ar(case, block_size, max_blocks):
    model, prompt, scaffold, reference = case
    for drafts in (None, corrupted(reference, 0.2, 800), reference):
        result = decode(
            "jacobi-mr", model, prompt, scaffold, block_size=block_size, max_blocks=max_blocks, drafts=drafts
        )
        assert result.token_ids == reference, (block_size, max_blocks, drafts is None)
        assert min(result.accepted_per_step) >= 1


def test_recycled_ngrams_and_pseudo_active_blocks_are_verified_not_trusted(case, monkeypatch):
    """Poison the pool with wrong continuations and the spawned blocks with wrong drafts: still `ar`'s ids;
    and with `ar`'s own continuations in the pool the candidates win forwards."""
    model, prompt, scaffold, reference = case
    real_add = NgramPool.add

    def poisoned(self, tokens):
        real_add(self, [(t + 3) % 800 for t in tokens])

    monkeypatch.setattr(NgramPool, "add", poisoned)
    assert decode("jacobi-mr", model, prompt, scaffold, candidates=4).token_ids == reference

    def oracle(self, tokens):  # continuations of every reference token, as a perfect pool would hold
        real_add(self, reference)

    monkeypatch.setattr(NgramPool, "add", oracle)
    result = decode("jacobi-mr", model, prompt, scaffold, candidates=4, max_blocks=1)
    assert result.token_ids == reference
    assert result.extra["candidate_wins"] > 0
    assert result.nfe < decode("jacobi", model, prompt, scaffold).nfe


def test_the_layout_lets_candidates_see_the_head_and_themselves_only():
    plan = layout(head=[1, 2], draft=[3, 4, 5], pseudo=[[6, 7]], candidates=[[8, 9], [10]])
    assert plan.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert plan.offsets.tolist() == [0, 1, 2, 3, 4, 5, 6, 2, 3, 2]  # candidates at the draft's positions
    assert plan.pattern[:7, :7].equal(torch.ones(7, 7, dtype=torch.bool).tril())  # the main sequence is causal
    assert plan.pattern[7].tolist() == [True, True] + [False] * 5 + [True, False, False]
    assert plan.pattern[8].tolist() == [True, True] + [False] * 5 + [True, True, False]
    assert plan.pattern[9].tolist() == [True, True] + [False] * 7 + [True]
    assert not plan.pattern[:7, 7:].any()  # nothing in the main sequence sees a candidate
    assert plan.block_rows == [5] and plan.candidate_rows == [7, 9]


def test_the_pool_keeps_the_most_recent_continuations_per_token():
    pool = NgramPool(length=2)
    for tail in range(jacobi_mr.POOL_PER_KEY + 2):
        pool.add([7, tail, 0])
    assert pool.continuations(7) == [[t, 0] for t in range(jacobi_mr.POOL_PER_KEY + 1, 1, -1)]
    assert pool.continuations(99) == []


def test_spawn_threshold_is_ceil_of_ratio_times_block():
    decoder = jacobi_mr.MultiBlockJacobi(None, None, block_size=16, max_blocks=2, spawn_ratio=0.85, candidates=4)
    assert decoder.spawn_at == math.ceil(0.85 * 16) == 14


@pytest.fixture(scope="module")
def scenes():
    """One fresh scene per scenario type (seeds far from the training episodes)."""
    return one_scene_per_scenario(91_000)


@pytest.mark.parametrize("name", ["default", "default-ar", "default-jf"])
def test_jacobi_decoders_equal_ar_on_the_embedded_models(name, scenes):
    planner = load(name)
    for scene in scenes:
        reference = planner.plan(scene, "ar")
        assert reference.response is not None, reference.error
        for decoder in ("jacobi", "jacobi-mr"):
            result = planner.plan(scene, decoder)
            assert result.token_ids == reference.token_ids, (name, decoder, scene.scenario)
            assert result.nfe < reference.nfe


def test_bad_jacobi_options_are_refused(scenes):
    planner = load("default-ar")
    for options in ({"block_size": 0}, {"max_blocks": 0}, {"spawn_ratio": 0.0}, {"candidates": -1}):
        with pytest.raises((DecoderError, ValueError)):
            planner.plan(scenes[0], "jacobi-mr", **options)
    with pytest.raises(DecoderError, match="needs a block-diffusion checkpoint"):
        planner.plan(scenes[0], "ss")
