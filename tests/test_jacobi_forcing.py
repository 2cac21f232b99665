"""Jacobi Forcing training (paper 003 section 3.1, Appendix C): trajectories of an AR teacher, the
progressive noise schedule, the noise-aware packed forward, the consistency loss and the `jf` recipe."""

import json
from fractions import Fraction

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fastddrive.cli import app
from fastddrive.core.scaffold import Scaffold
from fastddrive.core.schema import SECTIONS, example_response, render
from fastddrive.core.training_episodes import training_episodes
from fastddrive.data.dataset import DATASET_FORMAT, MANIFEST, write_shard
from fastddrive.decode.registry import decode
from fastddrive.engine.model_files import load_model, save_model
from fastddrive.planner import prompt_inputs
from fastddrive.train import jacobi_forcing
from fastddrive.train import trajectories as trajectories_module
from fastddrive.train.checkpoint import list_checkpoints
from fastddrive.train.collate import IGNORE, DualStreamCollator
from fastddrive.train.config import ConfigError, load_config
from fastddrive.train.jacobi_forcing import JacobiForcingCollator, answer_parses, answer_sections, pack_batch
from fastddrive.train.loop import train
from fastddrive.train.losses import consistency_loss, jacobi_forcing_loss
from fastddrive.train.progressive_noise import noise_ratios, noisy_blocks, noisy_state, unconverged_fraction
from fastddrive.train.trajectories import (
    Trajectory,
    TrajectoryError,
    collect_trajectories,
    jacobi_trajectory,
    plan_collection,
    read_trajectories,
)
from model_fixtures import synthetic_sample, text_model, vision_model

PEAKY = 10.0  # untrained tiny models at their initial scale write one token everywhere
STOP_BOOST = 1.5  # the stop token's head row, scaled so that these models' answers end after tens of tokens
EXACT = 1e-6  # float64, but transformers computes RMSNorm in float32 whatever the model dtype
QUICK = dict(validation_samples=2, log_every=1, checkpoint_every=2, validate_every=1000, warmup_steps=1, batch_size=4)


def ar_model(seed: int = 0):
    """A random text-only AR-kind model whose greedy answers vary with the context and stop."""
    model = text_model(seed)
    model.info.kind = "autoregressive"
    stop = model.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        for name, parameter in model.model.named_parameters():
            if "norm" not in name:
                parameter.mul_(PEAKY)
        model.core.get_output_embeddings().weight[stop] *= STOP_BOOST
    return model


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A dataset folder of 5 synthetic training samples."""
    root = tmp_path_factory.mktemp("jf-data")
    record = write_shard(root / "train" / "00000-synthetic.parquet", [synthetic_sample(s) for s in range(5)])
    # Named as a simulator's settings name their scenarios: the samples are of simulated episodes 0..4.
    manifest = {"format": DATASET_FORMAT, "version": 2, "settings": {"scenarios": ["highway"]}, "complete": True}
    (root / MANIFEST).write_text(json.dumps(manifest | {"shards": {"train/00000-synthetic.parquet": record}}))
    return str(root)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    path = tmp_path_factory.mktemp("jf-teacher") / "ar"
    save_model(ar_model(), path)
    return str(path)


def collect(out, teacher, data, samples=5, block_size=8, **callbacks):
    plan = plan_collection(teacher, data, "train", samples, block_size, 0, out)
    model = load_model(teacher)
    return collect_trajectories(plan, model, Scaffold(model.tokenizer), **callbacks)


@pytest.mark.parametrize("block_size", [4, 16])
def test_trajectories_end_at_the_greedy_ar_answer(block_size):
    model = ar_model()
    model.model.double()  # near-equal logits must not order differently in a one-token and a block forward
    scaffold = Scaffold(model.tokenizer)
    stop = model.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for seed in (0, 1):
        sample = synthetic_sample(seed)
        prompt = prompt_inputs(model, sample.command, sample.history, [sample.image])
        answer, blocks = jacobi_trajectory(model, prompt, scaffold, block_size, seed=3)
        reference = decode("ar", model, prompt, scaffold).token_ids
        assert len(set(reference)) > 10  # the answer varies, so equal ids are not a coincidence
        assert [t for states in blocks for t in states[-1]] == answer == [*reference, stop]
        assert all(len(states[-1]) == block_size for states in blocks[:-1])
        assert all(len(state) == len(states[-1]) for states in blocks for state in states)
        assert max(unconverged_fraction(states[0], states[-1]) for states in blocks) > Fraction(1, 2)
    assert len(answer) % block_size  # the stop token ended a block early: its iterates were trimmed


def test_the_schedule_picks_the_states_of_eq7():
    assert noise_ratios(10, 4) == [Fraction(k % 4, 4) for k in range(10)]
    fixed = list(range(100, 108))
    # A block trajectory with every unconverged fraction 8/8, 7/8, ..., 0.
    states = [[0] * (8 - k) + fixed[8 - k :] for k in range(9)]
    chosen = noisy_blocks([states] * 10, window=4)
    assert [unconverged_fraction(c, fixed) for c in chosen] == [
        0,
        Fraction(1, 4),
        Fraction(1, 2),
        Fraction(3, 4),
    ] * 2 + [
        0,
        Fraction(1, 4),
    ]
    assert unconverged_fraction(noisy_blocks([states] * 6, window=8)[5], fixed) == Fraction(5, 8)
    sparse = [states[0], states[5], states[8]]  # fractions 1, 3/8, 0: the closest one is taken
    assert noisy_state(sparse, Fraction(1, 4)) == sparse[1]
    assert noisy_state(sparse, Fraction(3, 4)) == sparse[0]
    assert noisy_state(sparse, Fraction(0)) == sparse[2]


def synthetic_trajectory(length: int, block_size: int, seed: int) -> Trajectory:
    """Random answer ids whose blocks converge left to right from random guesses, as Jacobi's do."""
    rng = np.random.default_rng(seed)
    answer = rng.integers(10, 500, length).tolist()
    blocks = []
    for start in range(0, length, block_size):
        fixed = answer[start : start + block_size]
        guesses = [[*fixed[:k], *rng.integers(10, 500, len(fixed) - k).tolist()] for k in range(1, len(fixed))]
        blocks.append([*guesses, fixed])
    return Trajectory(seed, f"synthetic-{seed}", answer, blocks)


def plain_causal(model, prompt, tail: list[int]) -> torch.Tensor:
    """Logits of an ordinary causal forward of [prompt ; tail], positions as in decoding."""
    ids = torch.cat([prompt.input_ids, torch.tensor([tail])], dim=1)
    positions, _ = model._rope_positions(ids, prompt.image_grid_thw)
    vision = {}
    if prompt.pixel_values is not None:
        vision = {"pixel_values": prompt.pixel_values, "image_grid_thw": prompt.image_grid_thw}
    return model.model(input_ids=ids, position_ids=positions, **vision).logits[0]


@pytest.mark.parametrize("kind", ["qwen2.5-vl", "qwen2"])
def test_the_packed_forward_equals_separate_forwards_per_block(kind):
    model = vision_model() if kind == "qwen2.5-vl" else text_model()
    model.model.double()
    items = []
    for seed, length in ((0, 37), (1, 22)):  # different lengths: the second row is padded
        sample = synthetic_sample(seed)
        items.append(
            (
                prompt_inputs(model, sample.command, sample.history, [sample.image]),
                synthetic_trajectory(length, 8, seed),
            )
        )
    batch = pack_batch(items, 4, np.ones(len(SECTIONS)), Scaffold(model.tokenizer), model.tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model.packed_logits(**batch.forward_inputs())
        for b, (prompt, trajectory) in enumerate(items):
            p, answer = prompt.input_ids.shape[1], trajectory.answer
            clean = plain_causal(model, prompt, answer)
            assert torch.allclose(logits[b, :p], clean[:p], atol=EXACT)
            at = start = 0
            noisy_states = noisy_blocks(trajectory.blocks, 4)
            fixed_points = [states[-1] for states in trajectory.blocks]
            assert sum(noisy != fixed for noisy, fixed in zip(noisy_states, fixed_points, strict=True)) >= 2
            for noisy in noisy_states:
                n = len(noisy)
                separate = plain_causal(model, prompt, answer[:start] + noisy)[-n:]
                assert batch.input_ids[b, p + at : p + at + n].tolist() == noisy
                assert torch.allclose(logits[b, p + at : p + at + n], separate, atol=EXACT), (b, start)
                assert torch.allclose(
                    logits[b, p + at + n : p + at + 2 * n], clean[p + start : p + start + n], atol=EXACT
                )
                at, start = at + 2 * n, start + n
    # Every answer token is an AR label once, and every consistency pair predicts one of them.
    assert (batch.labels != IGNORE).sum() == 37 + 22
    assert len(batch.teacher) == len(batch.student) == 36 + 21 and batch.blocks == 5 + 3
    assert (batch.labels.flatten()[batch.teacher] != IGNORE).all()


def test_answer_sections_are_those_of_the_ar_recipe():
    model = text_model()
    scaffold = Scaffold(model.tokenizer)
    collator = DualStreamCollator(model, scaffold, load_config("tiny-ar"))
    for seed in (0, 1):
        example = collator.example(synthetic_sample(seed))
        assert answer_sections(example.response, scaffold).tolist() == example.section.tolist()
        cut = len(example.response) - 10  # an answer cut short in its trajectory
        assert answer_sections(example.response[:cut], scaffold).tolist() == example.section[:cut].tolist()


def test_the_consistency_loss_is_a_kl_that_trains_only_the_student():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11, requires_grad=True)
    teacher, student = torch.tensor([1, 2, 7]), torch.tensor([3, 4, 9])
    flat = logits.detach().flatten(0, 1)
    assert consistency_loss(flat[teacher], flat[teacher].clone(), torch.ones(3), 3) == 0
    weights = torch.tensor([0.5, 0.5, 1.0])  # two blocks: one of two pairs, one of one
    labels = torch.full((2, 6), IGNORE)
    parts = jacobi_forcing_loss(logits, teacher, student, weights, 2, labels, torch.zeros(2, 6), ar_weight=0.0)
    p, q = torch.softmax(flat[teacher], -1), torch.softmax(flat[student], -1)
    kl = (p * (p.log() - q.log())).sum(-1)
    assert torch.allclose(parts.total, (kl * weights).sum() / 2)
    parts.total.backward()
    grad = logits.grad.flatten(0, 1)
    assert grad[teacher].abs().max() == 0 and (grad[student].abs().sum(-1) > 0).all()
    others = torch.ones(12, dtype=torch.bool)
    others[student] = False
    assert grad[others].abs().max() == 0

    labels[0, 0], labels[1, 3] = 5, 2
    label_weights = torch.zeros(2, 6)
    label_weights[0, 0], label_weights[1, 3] = 1.0, 3.0
    both = jacobi_forcing_loss(logits, teacher, student, weights, 2, labels, label_weights, ar_weight=0.5)
    ce = torch.nn.functional.cross_entropy(flat[[0, 9]], torch.tensor([5, 2]), reduction="none")
    assert torch.allclose(both.clean, (ce * torch.tensor([1.0, 3.0])).mean())
    assert torch.allclose(both.total, both.noisy + 0.5 * both.clean)


def test_an_interrupted_collection_resumes_to_the_same_files(dataset, teacher, tmp_path, monkeypatch):
    monkeypatch.setattr(trajectories_module, "SHARD_SAMPLES", 2)
    collect(tmp_path / "whole", teacher, dataset)
    seen = []

    def interrupt(trajectory):
        seen.append(trajectory)
        if len(seen) == 3:  # in the second shard
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        collect(tmp_path / "cut", teacher, dataset, on_sample=interrupt)
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == [MANIFEST, "shard-00000.json"]
    with pytest.raises(TrajectoryError, match="incomplete"):
        read_trajectories(tmp_path / "cut")
    report = collect(tmp_path / "cut", teacher, dataset)
    assert (report.skipped, report.collected) == (2, 3)
    names = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert names == [MANIFEST, "shard-00000.json", "shard-00001.json", "shard-00002.json"]
    for name in names:
        assert (tmp_path / "cut" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    collected = read_trajectories(tmp_path / "whole").trajectories
    assert len(collected) == 5 and len({t.index for t in collected}) == 5
    assert all(t.answer[-1] == load_model(teacher).tokenizer.convert_tokens_to_ids("<|im_end|>") for t in collected)


def test_a_damaged_shard_is_named_and_collected_again(dataset, teacher, tmp_path, monkeypatch):
    monkeypatch.setattr(trajectories_module, "SHARD_SAMPLES", 2)
    out = tmp_path / "trajectories"
    collect(out, teacher, dataset)
    before = read_trajectories(out)
    shard = out / "shard-00001.json"
    shard.write_bytes(shard.read_bytes().replace(b"[", b"[1, ", 1))
    with pytest.raises(TrajectoryError, match="shard-00001.json is damaged"):
        read_trajectories(out)
    said = []
    report = collect(out, teacher, dataset, say=said.append)
    assert report.collected == 2 and any("shard-00001.json is damaged" in s for s in said)
    assert read_trajectories(out) == before
    with pytest.raises(TrajectoryError, match="block_size 8, not 16"):
        plan_collection(teacher, dataset, "train", 5, 16, 0, out)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data", "nowhere"], "nowhere is not a directory"),
        (["--split", "everything"], "unknown split 'everything'"),
        (["--samples", "0"], "samples must be at least 1"),
        (["--samples", "6"], "has 5 samples; cannot take 6"),
        (["--block-size", "0"], "block size must be in [1, 1024]"),
        (["--block-size", "4096"], "block size must be in [1, 1024]"),
        (["--seed", "-1"], "seed must be in [0, 4294967295]"),
        (["--model", "default"], "is a block-diffusion checkpoint"),
        (["--model", "nothing-here"], "holds no model"),
    ],
)
def test_bad_collection_requests_exit_2_with_one_line(dataset, tmp_path, args, message):
    out = tmp_path / "trajectories"
    command = ["trajectories", "--data", dataset, "--samples", "2", "--out", str(out), *args]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not out.exists()


def test_the_trajectories_command_collects(dataset, teacher, tmp_path):
    out = tmp_path / "trajectories"
    command = ["trajectories", "--model", teacher, "--data", dataset, "--samples", "2", "--block-size", "8"]
    result = CliRunner().invoke(app, [*command, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "collected 2 trajectories" in result.output and "tokens/forward" in result.output
    again = CliRunner().invoke(app, [*command, "--out", str(out)])
    assert "collected 0 trajectories" in again.output and "kept 2 already collected" in again.output
    assert len(read_trajectories(out).trajectories) == 2


def _params(path):
    return {k: v.clone() for k, v in load_model(path, training=True).core.state_dict().items()}


def test_a_jf_run_resumes_to_the_same_weights_as_an_uninterrupted_one(dataset, teacher, tmp_path):
    collect(tmp_path / "trajectories", teacher, dataset, samples=4)
    settings = dict(
        data=dataset,
        init_from=teacher,
        trajectories=str(tmp_path / "trajectories"),
        jacobi_block_size=8,
        noise_window=4,
        steps=4,
        skip_unparsed=False,  # a random teacher's answers never parse
        labelled_ar_weight=2.0,  # its batches of labelled answers are drawn per step too
        **QUICK,
    )
    whole = train(load_config("tiny-jf", out=str(tmp_path / "whole"), **settings))
    cut = load_config("tiny-jf", out=str(tmp_path / "cut"), **settings)
    train(cut, stop_after=2)
    assert [p.name for p in list_checkpoints(tmp_path / "cut")] == ["checkpoint-000002"]
    resumed = train(cut, resume=True)
    assert resumed.resumed_from == 2 and "val_ade5" in resumed.last_validation
    a, b = _params(whole.final), _params(resumed.final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert load_model(whole.final).info.kind == "autoregressive"
    # Both record the episodes of the samples they learned from; the resumed one through its checkpoint.
    for final in (whole.final, resumed.final):
        assert training_episodes(load_model(final).info.extra) == {("highway", seed) for seed in range(5)}
    log = (tmp_path / "whole" / "log.csv").read_text().splitlines()
    first = dict(zip(log[0].split(","), log[1].split(","), strict=True))
    assert float(first["noisy_loss"]) > 0 and float(first["clean_loss"]) > 0  # consistency and AR parts
    parts = float(first["noisy_loss"]) + 10.0 * float(first["clean_loss"]) + 2.0 * float(first["labelled_loss"])
    assert float(first["labelled_loss"]) > 0 and float(first["loss"]) == pytest.approx(parts, rel=1e-5)
    assert float(first["tokens_per_s"]) > 0  # the packed forward's positions and the labelled batch's count
    with pytest.raises(ConfigError, match="collected at block size 8"):
        train(load_config("tiny-jf", out=str(tmp_path / "other"), **(settings | {"jacobi_block_size": 16})))


def test_the_jf_recipe_needs_trajectories():
    with pytest.raises(ConfigError, match="trajectories: the jf recipe needs a trajectories folder"):
        load_config("tiny-ar", recipe="jf")


def test_only_the_jf_recipe_takes_a_weight_for_labelled_answers():
    assert load_config("tiny-jf", labelled_ar_weight=3.0).labelled_ar_weight == 3.0
    with pytest.raises(ConfigError, match="labelled_ar_weight is a weight of the jf recipe"):
        load_config("tiny-ar", labelled_ar_weight=1.0)


def test_an_answer_parses_with_or_without_its_stop_token_and_not_when_broken():
    tokenizer = ar_model().tokenizer
    ids = tokenizer.encode(render(example_response()), add_special_tokens=False)
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert answer_parses(tokenizer, ids) and answer_parses(tokenizer, [*ids, stop])
    assert not answer_parses(tokenizer, ids[:-3] + [stop])  # cut inside the trajectory
    assert not answer_parses(tokenizer, ids[:40] + ids[41:])  # a token skipped, as broken Jacobi answers do


def test_trajectories_whose_answers_do_not_parse_are_left_out_and_counted(dataset, teacher, tmp_path, monkeypatch):
    collect(tmp_path / "trajectories", teacher, dataset, samples=4)
    collected = read_trajectories(tmp_path / "trajectories").trajectories
    settings = dict(data=dataset, init_from=teacher, trajectories=str(tmp_path / "trajectories"), jacobi_block_size=8)
    config = load_config("tiny-jf", out=str(tmp_path / "run"), **settings)
    model = load_model(teacher)
    # The random teacher's answers never parse: let exactly the second one count as parsing.
    monkeypatch.setattr(jacobi_forcing, "answer_parses", lambda tokenizer, answer: answer == collected[1].answer)
    kept = JacobiForcingCollator(model, Scaffold(model.tokenizer), config)
    assert kept.left_out == 3 and [t.sample_id for t in kept.trajectories] == [collected[1].sample_id]
    whole = config.model_copy(update={"skip_unparsed": False})
    everything = JacobiForcingCollator(model, Scaffold(model.tokenizer), whole)
    assert everything.left_out == 0 and len(everything) == 4
    said = []
    train(config.model_copy(update={"steps": 1, **QUICK}), say=said.append)
    assert "3 trajectories left out of 4: their answers do not parse" in said
    monkeypatch.setattr(jacobi_forcing, "answer_parses", lambda tokenizer, answer: False)
    with pytest.raises(ConfigError, match="no trajectory's answer parses"):
        JacobiForcingCollator(model, Scaffold(model.tokenizer), config)
