"""Decoders: losslessness against greedy AR, documented behaviour of the MDM decoders, test-time scaling."""

import json

import numpy as np
import pytest
import torch

from fastddrive.data.highway import SCENARIOS, episode_samples
from fastddrive.decode import DECODERS, LOSSLESS, DecoderError, decode, decoder_options
from fastddrive.decode.quadratic import quadratic_layout
from fastddrive.decode.speculative import ss_nfe_floor
from fastddrive.planner import Planner, load, prompt_inputs
from fastddrive.scaffold import Scaffold
from model_fixtures import synthetic_sample, text_model, vision_model


def _random_case(kind: str, seed: int):
    # float64: a random model's logits are nearly flat, and float32 near-ties could flip an argmax
    # between a one-token and a block forward; the trained embedded model runs in float32 below.
    model = (vision_model if kind == "qwen2.5-vl" else text_model)(seed=seed)
    model.model.double()
    sample = synthetic_sample(seed)
    prompt = prompt_inputs(model, sample.command, sample.history, [sample.image])
    return model, prompt, Scaffold(model.tokenizer)


@pytest.fixture(scope="module", params=[("qwen2", 0), ("qwen2", 1), ("qwen2.5-vl", 0), ("qwen2.5-vl", 2)])
def random_case(request):
    model, prompt, scaffold = _random_case(*request.param)
    return model, prompt, scaffold, decode("ar", model, prompt, scaffold).token_ids


@pytest.mark.parametrize(
    ("decoder", "options"),
    [
        ("ss", {"block_size": 4}),
        ("ss", {"block_size": 8, "fuse_draft": False}),
        ("ss", {"block_size": 8}),
        ("ss", {"block_size": 32, "fuse_draft": False}),
        ("ss", {"block_size": 32}),
        ("selfspec", {"block_size": 4}),
        ("selfspec", {"block_size": 32}),
        ("selfspec-quad", {"block_size": 4}),
        ("selfspec-quad", {"block_size": 8}),
    ],
)
def test_speculative_decoders_equal_greedy_ar_on_random_models(random_case, decoder, options):
    model, prompt, scaffold, reference = random_case
    result = decode(decoder, model, prompt, scaffold, **options)
    assert result.token_ids == reference
    assert sum(result.accepted_per_step) <= len(reference)


def test_quadratic_decoder_equals_greedy_ar_at_block_size_32():
    model, prompt, scaffold = _random_case("qwen2", 3)
    reference = decode("ar", model, prompt, scaffold).token_ids
    assert decode("selfspec-quad", model, prompt, scaffold, block_size=32).token_ids == reference


def test_quadratic_layout_is_causal_over_first_tokens_and_blockwise_inside_groups():
    offsets, allowed = quadratic_layout(3)
    assert offsets.tolist() == [0, 1, 2, 1, 2, 3, 2, 3, 4]
    first = [0, 3, 6]
    assert allowed[np.ix_(first, first)].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert not allowed[0, 1]  # a first token never sees masks: it is the AR verification
    assert allowed[4].tolist() == [True, False, False, True, True, True, False, False, False]


@pytest.fixture(scope="module")
def embedded():
    return load("default")


@pytest.fixture(scope="module")
def scenes():
    """One fresh scene per scenario type (seeds far from the training episodes)."""
    return [episode_samples(name, 90_000 + k, max_duration_s=9)[0] for k, name in enumerate(SCENARIOS)]


def test_lossless_decoders_equal_greedy_ar_on_the_embedded_model(embedded, scenes):
    for scene in scenes:
        reference = embedded.plan(scene, "ar")
        assert reference.response is not None, reference.error
        for name in LOSSLESS:
            result = embedded.plan(scene, name)
            assert result.token_ids == reference.token_ids, (name, scene.scenario)
        plain = embedded.plan(scene, "ss", fuse_draft=False)
        assert plain.token_ids == reference.token_ids
        assert ss_nfe_floor(embedded.scaffold) <= plain.nfe < reference.nfe / 2
        fused = embedded.plan(scene, "ss")
        assert ss_nfe_floor(embedded.scaffold, fuse_draft=True) <= fused.nfe <= plain.nfe


def test_every_decoder_answers_validly_on_the_embedded_model(embedded, scenes):
    for name in DECODERS:
        result = embedded.plan(scenes[0], name)
        assert isinstance(json.loads(result.text), dict), name  # the scaffold makes any decoder's JSON valid
        if name in (*LOSSLESS, "ar", "sd", "tts"):
            # Values too; mdm and fullseq decode inputs the SASD-trained head never saw and may combine
            # two meta words' tokens into no known value (the slot vocabulary is per token).
            assert result.response is not None, (name, result.error)
        assert result.nfe >= 1
        assert result.tokens == sum(t != embedded.scaffold.null_id for t in result.token_ids)
        assert result.prefill_ms > 0 and result.decode_ms > 0


@pytest.mark.parametrize("decoder", ["sd", "mdm", "fullseq"])
def test_tau_one_unmasks_one_token_per_step_and_tau_zero_a_whole_block(embedded, scenes, decoder):
    one = embedded.plan(scenes[1], decoder, tau=1.0)
    assert set(one.accepted_per_step) == {1}
    drafted = sum(one.accepted_per_step)
    every = embedded.plan(scenes[1], decoder, tau=0.0)
    assert sum(every.accepted_per_step) == drafted  # the same positions, fewer steps
    assert len(every.accepted_per_step) < len(one.accepted_per_step)
    assert every.nfe < one.nfe
    if decoder == "fullseq":
        assert every.nfe == 1 and one.nfe == drafted == int(embedded.scaffold.is_value.sum())


def test_sd_drafts_only_value_positions_and_mdm_also_the_scaffold(embedded, scenes):
    values = int(embedded.scaffold.is_value.sum())
    sd = embedded.plan(scenes[2], "sd", tau=1.0)
    mdm = embedded.plan(scenes[2], "mdm", tau=1.0)
    assert sum(sd.accepted_per_step) <= values  # values only; some are seeded by an AR step
    assert sum(mdm.accepted_per_step) > values  # mdm also drafts scaffold positions


def test_tts_with_one_greedy_rollout_equals_ss(embedded, scenes):
    ss = embedded.plan(scenes[3], "ss", fuse_draft=False)
    tts = embedded.plan(scenes[3], "tts", rollouts=1, temperature=0.0, fuse_draft=False)
    assert tts.token_ids == ss.token_ids and tts.nfe == ss.nfe
    assert tts.response.trajectory == ss.response.trajectory
    # Fused, the rollouts start with a draft of their own: the verify before the fork cannot draft for a
    # sampled continuation. The ids are the same.
    fused = embedded.plan(scenes[3], "tts", rollouts=1, temperature=0.0)
    assert fused.token_ids == ss.token_ids and fused.nfe <= embedded.plan(scenes[3], "ss").nfe + 1


def test_tts_decodes_the_shared_prefix_once(embedded, scenes):
    tts = embedded.plan(scenes[3], "tts", rollouts=4, temperature=0.5, seed=1)
    extra = tts.extra
    assert len(extra["rollouts"]) == 4 and len(extra["rollout_nfe"]) == 4
    assert tts.nfe == extra["prefix_nfe"] + sum(extra["rollout_nfe"])  # the prefix is counted once
    assert extra["prefix_nfe"] > 1  # four independent passes would each pay it again
    ss = embedded.plan(scenes[3], "ss")
    start = embedded.scaffold.section_spans["trajectory"][0]
    assert all(r[:start] == ss.token_ids[:start] for r in extra["rollouts"])  # greedy prefix shared
    mean = np.asarray(extra["mean_trajectory_m"])
    assert mean.shape == (20, 2)
    assert np.allclose(np.asarray(tts.response.trajectory), mean[3::4], atol=0.005)


def test_unknown_decoder_and_unknown_option_are_named(embedded, scenes):
    with pytest.raises(DecoderError, match="unknown decoder 'beam'.*ss"):
        embedded.plan(scenes[0], "beam")
    with pytest.raises(DecoderError, match="'ss' takes no option 'tau'"):
        embedded.plan(scenes[0], "ss", tau=0.5)
    assert decoder_options("sd") == {"tau": 0.9, "block_size": 32}
    assert decoder_options("ss") == {"block_size": 32, "fuse_draft": True}


def test_only_ar_runs_on_an_autoregressive_checkpoint(scenes):
    planner = load("default-ar")
    assert planner.plan(scenes[0], "ar").response is not None
    with pytest.raises(DecoderError, match="needs a block-diffusion checkpoint"):
        planner.plan(scenes[0], "ss")


def test_plan_validates_raw_inputs(embedded, scenes):
    scene = scenes[0]
    result = embedded.plan(images=[scene.image], history=scene.history.tolist(), command=scene.command, decoder="ss")
    assert result.token_ids == embedded.plan(scene, "ss").token_ids
    from fastddrive.data.sample import SampleError

    with pytest.raises(SampleError, match="history must be 7 rows"):
        embedded.plan(images=[scene.image], history=[[0.0] * 6] * 3, command="go_straight")
    with pytest.raises(SampleError, match="multiple of 28"):
        embedded.plan(images=[scene.image[:100]], history=scene.history, command="go_straight")
    with pytest.raises(SampleError, match="uint8"):
        embedded.plan(images=[scene.image.astype(float)], history=scene.history, command="go_straight")
    with pytest.raises(SampleError, match="unknown navigation command"):
        embedded.plan(images=[scene.image], history=scene.history, command="turn_around")


def test_forward_counting_matches_the_model_calls(embedded, scenes):
    calls = []
    handle = embedded.model.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        result = embedded.plan(scenes[0], "ss")
    finally:
        handle.remove()
    assert result.nfe == len(calls)
    assert isinstance(embedded, Planner) and torch.is_tensor(embedded.prompt(scenes[0]).input_ids)


def test_evaluation_reports_a_failed_sample_and_completes_the_rest(embedded, scenes, monkeypatch):
    from fastddrive import planner
    from fastddrive.eval import accuracy

    real, calls = planner.decode, []

    def flaky(*args, **options):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return real(*args, **options)

    monkeypatch.setattr(planner, "decode", flaky)
    report = accuracy.evaluate(embedded.model, scenes[:3], "ss")
    assert report.samples == 3 and len(report.failures) == 1 and "out of memory" in report.failures[0]
    assert report.invalid == 0 and np.isfinite(report.ade5_m) and report.validity == pytest.approx(2 / 3)
    assert set(report.l2_m) == {"stp3", "uniad"} and report.rfs is None  # these scenes have no raters


def test_evaluation_scores_rfs_against_the_simulated_raters(embedded):
    from fastddrive.eval.accuracy import evaluate

    scene = episode_samples("highway", 90_010, max_duration_s=9, raters=True)[0]
    assert len(scene.rater_scores) >= 1
    report = evaluate(embedded.model, [scene], "ss")
    assert report.rfs is not None and 0.0 <= report.rfs <= 10.0
    assert report.per_sample[0]["rfs"] == report.rfs
