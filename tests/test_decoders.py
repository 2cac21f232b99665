"""Decoders: losslessness against greedy AR with drafts of known quality, the documented behaviour of the
MDM decoders, and test-time scaling's batched rollouts and exact sampling."""

import json

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from fastddrive.core.scaffold import Scaffold
from fastddrive.core.schema import parse
from fastddrive.data.highway import DEFAULT_SCENARIOS, episode_samples
from fastddrive.decode import DECODERS, LOSSLESS, DecoderError, decode, decoder_options, speculative, tts
from fastddrive.decode.blocks import section_blocks
from fastddrive.decode.quadratic import quadratic_layout
from fastddrive.decode.speculative import Speculation, fused_layout, run, ss_nfe_floor
from fastddrive.decode.state import Canvas, row_picker, sampler
from fastddrive.engine.masks import block_mask
from fastddrive.engine.model import BlockDiffusionModel
from fastddrive.planner import Planner, load
from model_fixtures import peaky_case, with_oracle


@pytest.fixture(scope="module", params=[("qwen2", 0), ("qwen2.5-vl", 2)])
def random_case(request):
    model, prompt, scaffold = peaky_case(*request.param)
    reference = decode("ar", model, prompt, scaffold).token_ids
    values = [t for t, v in zip(reference, scaffold.is_value, strict=True) if v]
    assert len(set(values)) > 20  # the reference varies, so equal ids are not a coincidence
    return model, prompt, scaffold, reference


CORRUPTION = [0.0, 0.05, 0.2, 0.5]
BLOCK_SIZES = [4, 8, 16, 32]


@pytest.mark.parametrize("rate", CORRUPTION)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_speculative_decoders_equal_ar_with_oracle_drafts(random_case, monkeypatch, rate, block_size):
    model, prompt, scaffold, reference = random_case
    oracle = with_oracle(monkeypatch, reference, rate, len(model.tokenizer))
    assert (oracle.corrupted > 0) == (rate > 0)
    wrong_values = any(o != r for o, r, v in zip(oracle.tokens, reference, scaffold.is_value, strict=True) if v)
    runs = [
        ("ss", {"block_size": block_size, "fuse_draft": True}),
        ("ss", {"block_size": block_size, "fuse_draft": False}),
        ("selfspec", {"block_size": block_size}),
    ]
    if block_size <= 16:  # B^2 tokens a forward; 32 is covered once below
        runs.append(("selfspec-quad", {"block_size": block_size}))
    for name, options in runs:
        result = decode(name, model, prompt, scaffold, **options)
        assert result.token_ids == reference, (name, options)
        if rate == 0.0:
            assert max(result.accepted_per_step) >= min(block_size, 4), (name, options)  # drafts were accepted
        if name == "ss" and rate == 0.0:
            assert result.nfe == ss_nfe_floor(scaffold, block_size, options["fuse_draft"]), options
        if name == "ss" and wrong_values:
            assert result.nfe > ss_nfe_floor(scaffold, block_size, options["fuse_draft"]), options


def test_quadratic_decoder_at_block_size_32_and_ar_jump_equal_ar(random_case, monkeypatch):
    model, prompt, scaffold, reference = random_case
    with_oracle(monkeypatch, reference, 0.2, len(model.tokenizer))
    assert decode("selfspec-quad", model, prompt, scaffold, block_size=32).token_ids == reference
    jump = decode("ar-jump", model, prompt, scaffold)
    assert jump.token_ids == reference
    assert jump.nfe == 1 + int(scaffold.is_value.sum())  # the prefill, then one forward per value


def test_random_drafts_alone_are_also_exact(random_case):
    model, prompt, scaffold, reference = random_case
    for name in LOSSLESS:
        assert decode(name, model, prompt, scaffold).token_ids == reference, name


def test_ss_nfe_floor_counts_the_forwards_of_perfect_drafts():
    scaffold = Scaffold(load("default").model.tokenizer)
    blocks = [b for b in scaffold.blocks(32) if scaffold.is_value[b.start : b.end].any()]
    unfused = ss_nfe_floor(scaffold, 32, fuse_draft=False)
    assert unfused == 1 + 2 * len(blocks)  # the paper's count: a draft and a verify per block with values
    assert ss_nfe_floor(scaffold, 32, fuse_draft=True) < unfused
    assert ss_nfe_floor(scaffold, 4, fuse_draft=False) < 1 + 2 * len(
        [b for b in scaffold.blocks(4) if scaffold.is_value[b.start : b.end].any()]
    )  # small blocks whose only value was the previous verify's bonus need no forward


def test_quadratic_layout_is_causal_over_first_tokens_and_blockwise_inside_groups():
    offsets, allowed = quadratic_layout(3)
    assert offsets.tolist() == [0, 1, 2, 1, 2, 3, 2, 3, 4]
    first = [0, 3, 6]
    assert allowed[np.ix_(first, first)].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert not allowed[0, 1]  # a first token never sees masks: it is the AR verification
    assert allowed[4].tolist() == [True, False, False, True, True, True, False, False, False]


def test_the_fused_draft_block_starts_with_a_known_token():
    offsets, allowed = fused_layout(4, 3)
    assert offsets.tolist() == [0, 1, 2, 3, 3, 4, 5]  # the tail repeats the last fed token's position
    assert torch.equal(allowed[:4, :4], block_mask(4, 4))  # the verify is causal
    assert not allowed[:4, 4:].any()  # and never sees the draft
    assert allowed[4:, :3].all() and not allowed[4:, 3].any()  # the tail sees the clean tokens before it
    assert allowed[4:, 4:].all()  # and itself bidirectionally, as a training block


@pytest.fixture(scope="module")
def references(embedded, scenes):
    """Greedy `ar` on each scene."""
    return [embedded.plan(scene, "ar") for scene in scenes]


# 8 left out and 16 on the default scenarios' scenes only (32 on every scenario's): the suite must stay under
# 15 minutes on 2 cores.
@pytest.mark.parametrize(("block_size", "scenario_count"), [(16, len(DEFAULT_SCENARIOS)), (32, None)])
def test_lossless_decoders_equal_greedy_ar_on_the_embedded_model(
    embedded, scenes, references, block_size, scenario_count
):
    for scene, reference in list(zip(scenes, references, strict=True))[:scenario_count]:
        assert reference.response is not None, reference.error
        for name in LOSSLESS:
            options = {} if name == "ar-jump" else {"block_size": min(block_size, 16 if "quad" in name else 32)}
            result = embedded.plan(scene, name, **options)
            assert result.token_ids == reference.token_ids, (name, scene.scenario, block_size)
        plain = embedded.plan(scene, "ss", block_size=block_size, fuse_draft=False)
        assert plain.token_ids == reference.token_ids
        assert ss_nfe_floor(embedded.scaffold, block_size, False) <= plain.nfe < reference.nfe / 2
        fused = embedded.plan(scene, "ss", block_size=block_size)
        assert fused.token_ids == reference.token_ids
        assert ss_nfe_floor(embedded.scaffold, block_size, True) <= fused.nfe


def test_ar_equals_transformers_generate_on_the_ar_baseline(scenes):
    planner = load("default-ar")
    planner.model.model.double()  # the two forwards differ in summation order only
    core = planner.model.core
    end = planner.model.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for scene in scenes[:2]:
        ours = planner.plan(scene, "ar")
        prompt = planner.prompt(scene)
        with torch.no_grad():
            generated = core.generate(
                input_ids=prompt.input_ids,
                pixel_values=prompt.pixel_values,
                image_grid_thw=prompt.image_grid_thw,
                mm_token_type_ids=(prompt.input_ids == planner.model.image_token_id).int(),
                attention_mask=torch.ones_like(prompt.input_ids),
                max_new_tokens=len(planner.scaffold) + 16,
                do_sample=False,
                eos_token_id=end,
                pad_token_id=end,
            )
        new = generated[0, prompt.input_ids.shape[1] :].tolist()
        assert ours.token_ids == (new[: new.index(end)] if end in new else new)


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
    for fuse in (False, True):
        ss = embedded.plan(scenes[3], "ss", fuse_draft=fuse)
        one = embedded.plan(scenes[3], "tts", rollouts=1, temperature=0.0, fuse_draft=fuse, rollout_drafts=True)
        assert one.token_ids == ss.token_ids and one.nfe == ss.nfe
        assert one.response == ss.response
    lockstep = embedded.plan(scenes[3], "tts", rollouts=1, temperature=0.0, rollout_drafts=False)
    assert lockstep.token_ids == ss.token_ids
    assert embedded.plan(scenes[3], "tts", rollouts=1, temperature=0.0).nfe == lockstep.nfe  # the default


def _float64_default() -> Planner:
    planner = load("default")
    planner.model.model.double()
    return planner


def _sequential_rollout(model: BlockDiffusionModel, prompt, scaffold, temperature, seed) -> list[int]:
    blocks = section_blocks(scaffold, 32)
    canvas = Canvas.prefill(model, prompt, scaffold)
    start = scaffold.section_spans["trajectory"][0]
    shared = Speculation(canvas, blocks, scaffold_aware=True, until=start, fuse=True)
    run(model, shared)
    (alone,) = tts.fork_rollouts(model, canvas, 1)
    pick = sampler(temperature, seed, len(scaffold))
    run(model, Speculation(alone, blocks, True, pick=pick, fuse=True, drafted=shared.drafted))
    return alone.ids


@pytest.mark.parametrize("drafts", [True, False])
def test_tts_rollouts_decode_as_one_batch_equal_to_sequential_ones(scenes, monkeypatch, drafts):
    """Batched rollouts, drafted (Scaffold Spec, rows at their own lengths) or verifying guessed windows in
    lockstep, equal sequential Scaffold Spec rollouts with the same seeds: the same exact AR samples,
    whichever forwards computed them."""
    planner = _float64_default()
    model, scaffold, scene = planner.model, planner.scaffold, scenes[3]
    prompt = planner.prompt(scene)
    forks, seen = [], []
    real_fork, real_forward = tts.fork_rollouts, BlockDiffusionModel.forward

    def fork(model, canvas, rollouts):
        forks.append(canvas.cached)
        return real_fork(model, canvas, rollouts)

    def forward(self, cache, *args, **kwargs):
        if forks:
            seen.append((cache.rows, min(cache.lengths), max(cache.lengths)))
        return real_forward(self, cache, *args, **kwargs)

    monkeypatch.setattr(tts, "fork_rollouts", fork)
    monkeypatch.setattr(BlockDiffusionModel, "forward", forward)
    result = planner.plan(scene, "tts", rollouts=4, temperature=0.8, seed=11, rollout_drafts=drafts)
    monkeypatch.undo()
    extra = result.extra
    sequential = [_sequential_rollout(model, prompt, scaffold, 0.8, 11 + r) for r in range(4)]
    assert extra["rollouts"] == sequential
    assert len({tuple(r) for r in sequential}) > 1  # the samples differ, so the equality means something
    # One forward per step for all rollouts, none of them reaching back into the shared prefix.
    prompt_length = prompt.input_ids.shape[1]
    assert len(seen) == extra["rollout_nfe"] and all(rows == 4 for rows, _, _ in seen)
    assert all(shortest >= prompt_length + forks[0] for _, shortest, _ in seen)
    trajectory_values = int(scaffold.is_value[scaffold.section_spans["trajectory"][0] :].sum())
    assert extra["rollout_nfe"] < trajectory_values  # drafts or guesses were accepted: fewer than one per value
    if not drafts:  # in lockstep the rows keep one length
        assert all(shortest == longest for _, shortest, longest in seen)
    assert result.nfe == extra["prefix_nfe"] + extra["rollout_nfe"]


def test_tts_answer_is_the_shared_prefix_with_the_averaged_trajectory(embedded, scenes):
    result = embedded.plan(scenes[3], "tts", rollouts=4, temperature=0.5, seed=1)
    extra = result.extra
    start = embedded.scaffold.section_spans["trajectory"][0]
    assert all(r[:start] == result.token_ids[:start] for r in extra["rollouts"])
    mean = np.asarray(extra["mean_trajectory_m"])
    assert mean.shape == (20, 2)
    assert np.allclose(np.asarray(result.response.trajectory), mean[3::4], atol=0.005)
    assert embedded.scaffold.decode(result.token_ids) == result.response == parse(result.text)  # one answer


def test_a_row_sampler_picks_what_each_row_sampler_would():
    logits = torch.randn(5, 3, 50, generator=torch.Generator().manual_seed(0)) * 3
    seeds, temperature = [3, 4, 5, 6, 7], 0.7
    rows = row_picker(temperature, seeds, 20)
    for first in (0, 7, 17):
        positions = torch.arange(first, first + 3)
        alone = [sampler(temperature, s, 20)(logits[r], positions).tolist() for r, s in enumerate(seeds)]
        assert rows(logits, first).tolist() == alone
    assert len({tuple(row) for row in rows(logits, 7).tolist()}) > 1  # the rows differ: the equality means something
    assert row_picker(0.0, seeds, 20)(logits, 3).tolist() == logits.argmax(-1).tolist()


def test_the_sampled_verifier_draws_exact_ar_samples(monkeypatch):
    """Rollouts whose drafts are the AR head's argmax, accepted only where they equal the sample, commit
    values that follow the AR softmax (chi-square on the trajectory's first value over 2000 rollouts)."""
    model, prompt, scaffold = peaky_case("qwen2", 5)
    temperature, rollouts = 2.0, 2000
    blocks = section_blocks(scaffold, 32)
    start = scaffold.section_spans["trajectory"][0]
    first = start + int(np.argmax(scaffold.is_value[start:]))
    canvas = Canvas.prefill(model, prompt, scaffold)
    run(model, Speculation(canvas, blocks, scaffold_aware=True, until=first))
    logits, cache = model.prefill(prompt)
    logits = model.verify(cache, canvas.ids[:first])[-1]
    probs = torch.softmax(logits.double() / temperature, -1).numpy()
    mode = int(probs.argmax())

    def draft_the_mode(proposal, logits, row_of_first, position, canvas):
        masked = [i for i, token in enumerate(proposal) if token == canvas.scaffold.mask_id]
        return masked, torch.full((len(masked),), mode, dtype=torch.long)

    monkeypatch.setattr(speculative, "propose", draft_the_mode)
    forks = tts.fork_rollouts(model, canvas, rollouts)
    speculations = [
        Speculation(fork, blocks, True, sampler(temperature, seed, len(scaffold)), until=first + 1)
        for seed, fork in enumerate(forks)
    ]
    speculative.run_rows(model, forks[0].cache, speculations)
    drawn = np.array([fork.ids[first] for fork in forks])
    accepted = sum(s.stats.accepted for s in speculations)  # rollouts whose draft was the sample
    assert 0 < accepted < rollouts  # drafts were accepted and rejected
    likely = np.flatnonzero(probs * rollouts >= 5)
    assert len(likely) >= 3  # a distribution with several outcomes worth testing
    observed = [np.sum(drawn == t) for t in likely] + [np.sum(~np.isin(drawn, likely))]
    expected = [probs[t] * rollouts for t in likely] + [rollouts * (1 - probs[likely].sum())]
    assert chisquare(observed, expected).pvalue > 1e-3


def test_unknown_decoder_and_unknown_option_are_named(embedded, scenes):
    with pytest.raises(DecoderError, match="unknown decoder 'beam'.*ss"):
        embedded.plan(scenes[0], "beam")
    with pytest.raises(DecoderError, match="'ss' takes no option 'tau'"):
        embedded.plan(scenes[0], "ss", tau=0.5)
    assert decoder_options("sd") == {"tau": 0.9, "block_size": 32}
    assert decoder_options("ss") == {"block_size": 32, "fuse_draft": True, "drafts": None}
    assert decoder_options("ar-jump") == {"temperature": 0.0, "seed": 0}


def test_only_ar_head_decoders_run_on_an_autoregressive_checkpoint(scenes):
    planner = load("default-ar")
    assert planner.plan(scenes[0], "ar").response is not None
    with pytest.raises(DecoderError, match="needs a block-diffusion checkpoint"):
        planner.plan(scenes[0], "ss")


def test_plan_validates_raw_inputs(embedded, scenes):
    scene = scenes[0]
    result = embedded.plan(images=[scene.image], history=scene.history.tolist(), command=scene.command, decoder="ss")
    assert result.token_ids == embedded.plan(scene, "ss").token_ids
    from fastddrive.core.sample import SampleError

    with pytest.raises(SampleError, match="history must be 7 rows"):
        embedded.plan(images=[scene.image], history=[[0.0] * 6] * 3, command="go_straight")
    with pytest.raises(SampleError, match="sides differ by more than 200 times"):
        embedded.plan(images=[scene.image[:1, :300]], history=scene.history, command="go_straight")
    with pytest.raises(SampleError, match="uint8"):
        embedded.plan(images=[scene.image.astype(float)], history=scene.history, command="go_straight")
    with pytest.raises(SampleError, match="unknown navigation command"):
        embedded.plan(images=[scene.image], history=scene.history, command="turn_around")


def test_forward_counting_matches_the_layer_stack_runs(embedded, scenes, monkeypatch):
    calls = []
    real = BlockDiffusionModel.layer_stack

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(BlockDiffusionModel, "layer_stack", counted)
    result = embedded.plan(scenes[0], "ss")
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


def test_ss_with_external_drafts_keeps_the_ids_of_ar(embedded, scenes, references):
    """`drafts` replace the MDM head's drafts; the verifier still decides, so right drafts cost the floor
    and wrong ones only forwards."""
    reference = references[4]
    oracle = embedded.plan(scenes[4], "ss", drafts=reference.token_ids)
    assert oracle.token_ids == reference.token_ids and oracle.nfe == ss_nfe_floor(embedded.scaffold)
    wrong = [embedded.scaffold.null_id] * len(reference.token_ids)
    corrupted = embedded.plan(scenes[4], "ss", drafts=wrong)
    assert corrupted.token_ids == reference.token_ids and corrupted.nfe > oracle.nfe
    with pytest.raises(DecoderError, match=r"option drafts: got 2 ids, expected one per answer position \(261\)"):
        embedded.plan(scenes[4], "ss", drafts=[1, 2])


def test_fed_tokens_count_what_the_forwards_after_the_prefill_carry(embedded, scenes):
    plain = embedded.plan(scenes[0], "ar")
    jump = embedded.plan(scenes[0], "ar-jump")
    # ar feeds every answer token but the last, one per forward; ar-jump feeds them in runs and stops
    # after the last value (the scaffold after it needs no forward).
    assert plain.fed_tokens == len(embedded.scaffold) - 1
    assert jump.fed_tokens == int(np.flatnonzero(embedded.scaffold.is_value)[-1])
    assert plain.fed_per_forward == 1.0 and jump.fed_per_forward > 2.0
    mr = embedded.plan(scenes[0], "jacobi-mr")
    assert mr.fed_per_forward > jump.fed_per_forward  # drafts, pseudo-active blocks and candidates ride along
