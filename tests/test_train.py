import csv
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fastddrive.cli import app
from fastddrive.core.scaffold import Scaffold
from fastddrive.core.schema import SECTIONS
from fastddrive.core.tokenizer import MissingDiffusionTokens, corpus_texts, train_tokenizer
from fastddrive.core.training_episodes import training_episodes, with_training_episodes
from fastddrive.data.build import build_dataset
from fastddrive.data.dataset import DrivingDataset
from fastddrive.engine.model_files import load_model, save_model, tiny_image_processor, tiny_qwen2_5_vl
from fastddrive.serve.loadtest import free_port
from fastddrive.train.checkpoint import list_checkpoints, validate_checkpoint
from fastddrive.train.collate import IGNORE, DualStreamCollator
from fastddrive.train.config import ConfigError, load_config, presets_dir
from fastddrive.train.loop import batch_loss, initial_model, train
from fastddrive.train.losses import sasd_loss
from fastddrive.train.noise import annealed_block_size, complementary_masks
from model_fixtures import SMALL, synthetic_sample

QUICK = dict(validation_samples=2, log_every=1, checkpoint_every=2, validate_every=1000, warmup_steps=1, batch_size=4)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-data") / "sim"
    build_dataset(root, 2, 21, ["merge"])
    return str(root)


def _fixed_batch_loss(model, config, data, seed=0):
    collator = DualStreamCollator(
        model, Scaffold(model.tokenizer, explanation_budget=config.explanation_budget), config
    )
    samples = list(DrivingDataset.open(data).samples("train"))[:4]
    batch = collator([collator.example(s) for s in samples], config.block_size, np.random.default_rng(seed))
    with torch.no_grad():
        noisy, clean = model.dual_stream_logits(**batch.forward_inputs())
    return batch_loss(noisy, clean, batch, config).total.item()


def _loss_falls(config, data):
    before = _fixed_batch_loss(initial_model(config), config, data)
    report = train(config)
    after = _fixed_batch_loss(load_model(report.final, training=True), config, data)
    assert after < before, (before, after)
    return report


def test_two_steps_of_tiny_ar_then_tiny_sasd_reduce_the_loss(data, tmp_path):
    ar = load_config("tiny-ar", data=data, out=str(tmp_path / "ar"), steps=2, architecture=SMALL, **QUICK)
    ar_report = _loss_falls(ar, data)
    assert load_model(ar_report.final).info.kind == "autoregressive"
    # The model records the simulated episodes it was trained on; a run continuing it adds its own to them.
    taught = DrivingDataset.open(data).simulated_episodes("train")
    assert taught == {("merge", 2100000)}  # episode 1 of the two is in the test split
    assert training_episodes(load_model(ar_report.final).info.extra) == taught
    info_file = ar_report.final / "fastddrive.json"
    info = json.loads(info_file.read_text())
    info_file.write_text(json.dumps(info | {"extra": with_training_episodes(info["extra"], [("cut-in", 300000)])}))
    sasd = load_config(
        "tiny-sasd", data=data, out=str(tmp_path / "sasd"), steps=2, init_from=str(ar_report.final), **QUICK
    )
    report = _loss_falls(sasd, data)
    loaded = load_model(report.final)
    assert loaded.info.kind == "block-diffusion" and loaded.info.mask_token_id is not None
    assert training_episodes(loaded.info.extra) == taught | {("cut-in", 300000)}

    from typer.testing import CliRunner

    from fastddrive.cli import app

    figures = tmp_path / "eval.json"
    for model in (ar_report.final, report.final):
        result = CliRunner().invoke(
            app,
            ["eval", "--model", str(model), "--data", data, "--split", "test", "--limit", "2", "--json", str(figures)],
        )
        assert result.exit_code == 0, result.output
        assert "constant velocity" in result.output
        assert json.loads(figures.read_text())["decoders"]["ar"]["samples"] == 2
    missing = CliRunner().invoke(app, ["eval", "--model", str(tmp_path / "nothing"), "--data", data])
    assert missing.exit_code == 2 and "config.json is missing" in missing.output


def _real_like_checkpoint(path, data):
    """A randomly initialised Qwen2.5-VL at tiny sizes, saved the way a real checkpoint is: no diffusion tokens."""
    rows = DrivingDataset.open(data).table("train", ["command", "history", "response"]).to_pylist()
    tokenizer = train_tokenizer(corpus_texts(rows), vocab_size=500, diffusion_tokens=False)
    model = tiny_qwen2_5_vl(tokenizer, **SMALL)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    tiny_image_processor().save_pretrained(str(path))
    return path


def test_the_3b_recipe_runs_two_steps_on_a_shrunk_random_model(data, tmp_path, capsys):
    base = _real_like_checkpoint(tmp_path / "qwen-like", data)
    with pytest.raises(MissingDiffusionTokens, match="never trained for block diffusion|no \\|<MASK>\\|"):
        load_model(base)
    config = load_config(
        "qwen2.5-vl-3b-sasd",
        data=data,
        out=str(tmp_path / "out"),
        init_from=str(base),
        steps=2,
        **{**QUICK, "batch_size": 2},
    )
    assert (
        config.mixed_precision == "bf16"
        and config.final_dtype == "bfloat16"
        and config.lr == 1e-5
        and config.block_size == 32
    )
    report = _loss_falls(config, data)
    assert "resizing embeddings" in capsys.readouterr().out
    tuned = load_model(report.final)
    assert tuned.core.get_input_embeddings().num_embeddings == len(tuned.tokenizer)


def _params(path):
    model = load_model(path, training=True)
    return {k: v.clone() for k, v in model.core.state_dict().items()}


def test_resuming_an_interrupted_run_gives_the_same_parameters(data, tmp_path):
    settings = dict(data=data, steps=4, architecture=SMALL, **QUICK)
    whole = train(load_config("tiny-ar", out=str(tmp_path / "whole"), **settings))
    interrupted = load_config("tiny-ar", out=str(tmp_path / "cut"), **settings)
    train(interrupted, stop_after=2)
    assert [p.name for p in list_checkpoints(tmp_path / "cut")] == ["checkpoint-000002"]
    resumed = train(interrupted, resume=True)
    assert resumed.resumed_from == 2
    a, b = _params(whole.final), _params(resumed.final)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)

    def logged_steps(run):
        with (tmp_path / run / "log.csv").open() as handle:
            return [row["step"] for row in csv.DictReader(handle)]

    assert logged_steps("cut") == logged_steps("whole")  # no empty row, no step logged twice


@pytest.mark.parametrize("damage", ["truncate-weights", "drop-optimizer"])
def test_a_corrupt_or_partial_checkpoint_is_refused_and_the_previous_one_used(data, tmp_path, damage):
    config = load_config("tiny-ar", data=data, out=str(tmp_path / "run"), steps=6, architecture=SMALL, **QUICK)
    train(config, stop_after=4)
    newest = list_checkpoints(tmp_path / "run")[-1]
    assert newest.name == "checkpoint-000004"
    if damage == "truncate-weights":
        weights = newest / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        (newest / "optimizer.safetensors").unlink()
    with pytest.raises(ValueError, match="checkpoint-000004 is (corrupt|partial)"):
        validate_checkpoint(newest)
    said = []
    report = train(config, resume=True, say=said.append)
    assert report.resumed_from == 2
    assert any(s.startswith("checkpoint-000004 is") and s.endswith("using the checkpoint before it") for s in said)


def test_no_validation_samples_means_no_validation(data, tmp_path):
    """`validation_samples: 0` (the 3B-cut preset's: its random weights have nothing to validate) skips the
    validation loss and the greedy-AR decode, at the last step too; one sample still validates there."""
    for samples in (0, 1):
        quick = {**QUICK, "validation_samples": samples}
        out = tmp_path / f"run-{samples}"
        config = load_config("tiny-ar", data=data, out=str(out), steps=2, architecture=SMALL, **quick)
        report = train(config)
        logged = [row for row in csv.DictReader((out / "log.csv").open()) if row.get("val_loss")]
        assert (len(logged), bool(report.last_validation)) == ((0, False) if samples == 0 else (1, True))


def test_a_fresh_run_refuses_an_output_that_holds_checkpoints(data, tmp_path):
    config = load_config("tiny-ar", data=data, out=str(tmp_path / "run"), steps=2, architecture=SMALL, **QUICK)
    train(config)
    with pytest.raises(ConfigError, match="--resume"):
        train(config)


def test_configs_are_validated_with_the_key_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nrecipe: sasd\ninit_from: scratch\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="learning_rate: unknown key"):
        load_config(path=bad)
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        load_config("huge")
    with pytest.raises(ConfigError, match="unknown section 'radar'"):
        load_config("tiny-sasd", section_weights={"radar": 1.0})
    with pytest.raises(ConfigError, match="power of two"):
        load_config("tiny-sasd", block_size=24)


def test_block_size_anneals_over_powers_of_two():
    sizes = [annealed_block_size(u / 100, 32) for u in range(100)]
    assert sizes[0] == 2 and sizes[-1] == 32 and sorted(set(sizes)) == [2, 4, 8, 16, 32]
    assert sizes == sorted(sizes)
    assert annealed_block_size(0.0, 32, anneal=False) == 32


def test_complementary_masks_cover_every_maskable_token_once():
    rng = np.random.default_rng(0)
    maskable = rng.random(500) < 0.7
    a, b = complementary_masks(maskable, np.full(500, 0.3), rng)
    assert not (a & b).any() and ((a | b) == maskable).all()


def test_sasd_batches_never_mask_scaffold_or_block_starts_and_label_with_token_shift():
    from model_fixtures import vision_model

    model = vision_model()
    config = load_config("tiny-sasd", block_size=8)
    scaffold = Scaffold(model.tokenizer)
    collator = DualStreamCollator(model, scaffold, config)
    example = collator.example(synthetic_sample(0))
    batch = collator([example], 8, np.random.default_rng(1))
    response = torch.as_tensor(example.response)
    starts = {b.start for b in scaffold.blocks(8)}
    masked_any = torch.zeros(len(response), dtype=torch.bool)
    for copy in range(2):
        masked = batch.noisy_ids[0, copy] == scaffold.mask_id
        masked_any |= masked
        assert not masked[torch.as_tensor(~scaffold.is_value)].any()
        assert not any(masked[s] for s in starts)
        where = torch.nonzero(masked).flatten()
        assert torch.equal(batch.noisy_labels[0, copy, where - 1], response[where])
        assert (batch.noisy_labels[0, copy] != IGNORE).sum() == masked.sum()
        weights = batch.noisy_weights[0, copy, where - 1]
        assert set(weights.tolist()) <= {1.5, 1.0, 2.0, 3.0}
    maskable = torch.as_tensor(scaffold.is_value).clone()
    maskable[list(starts)] = False
    assert torch.equal(masked_any, maskable)  # complementary: every maskable value is masked exactly once
    start = int(batch.response_start[0])
    targets = torch.nonzero(batch.clean_labels[0] != IGNORE).flatten() + 1 - start
    assert torch.equal(targets, torch.as_tensor(np.flatnonzero(scaffold.is_value)))


def test_ar_loss_weights_follow_the_response_sections():
    from model_fixtures import vision_model

    model = vision_model()
    scaffold = Scaffold(model.tokenizer)
    weights = {"critical_objects": 1.5, "explanation": 1.0, "future_meta_behavior": 2.0, "trajectory": 3.0}
    plain = DualStreamCollator(model, scaffold, load_config("tiny-ar", ar_section_weights=dict.fromkeys(weights, 1)))
    weighted = DualStreamCollator(model, scaffold, load_config("tiny-ar", ar_section_weights=weights))
    example = weighted.example(synthetic_sample(0))
    batch = weighted([example], 8, np.random.default_rng(0))
    labelled = batch.clean_labels[0] != IGNORE
    start = int(batch.response_start[0])
    sections = torch.as_tensor(example.section)[torch.nonzero(labelled).flatten() + 1 - start]
    expected = torch.tensor([weights[SECTIONS[i]] for i in sections])
    assert torch.equal(batch.clean_weights[0, labelled], expected)
    assert not batch.clean_weights[0, ~labelled].any()
    assert (sections == SECTIONS.index("trajectory")).sum() > 20  # the digits and the end token

    logits = torch.randn(1, batch.clean_labels.shape[1], model.model.config.get_text_config().vocab_size)
    empty = torch.zeros(1, 0, logits.shape[-1])
    targets = batch.clean_labels[0, labelled]
    per_token = torch.nn.functional.cross_entropy(logits[0, labelled], targets, reduction="none")
    unweighted = plain([example], 8, np.random.default_rng(0))
    args = (empty, logits, batch.noisy_labels, batch.noisy_weights, batch.clean_labels, 0.5, 0.5)
    same = sasd_loss(*args, clean_weights=unweighted.clean_weights).total
    assert torch.allclose(same, sasd_loss(*args).total)
    assert torch.allclose(same, per_token.mean())
    heavy = sasd_loss(*args, clean_weights=batch.clean_weights).total
    assert torch.allclose(heavy, (per_token * expected).mean())


TWO_RANKS = (
    "init_from: scratch\nsteps: 2\nwarmup_steps: 1\nlr: 0.001\nvalidate_every: 1000\n"
    "validation_samples: 1\ncheckpoint_every: 2\nanneal_block_size: false\n"
    "architecture: {hidden_size: 64, layers: 2, heads: 4, kv_heads: 2, intermediate_size: 128,"
    " vision_hidden_size: 32, vision_depth: 2, vision_heads: 2}\n"
)


def _launch_two_ranks(config, *options: str) -> subprocess.CompletedProcess:
    """`accelerate launch --multi_gpu --num_processes 2 -m fastddrive.cli train --config CONFIG`, as the README
    says, on this CPU (gloo)."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launcher += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launcher += ["--main_process_port", str(free_port()), "-m", "fastddrive.cli", "train", "--config", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*launcher, *options], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.parametrize(
    ("recipe", "sharding"),
    # AR answers differ in length (the token count matters) under DDP; SASD's three streams under FSDP.
    [("ar", "none"), ("sasd", "fsdp")],
)
def test_two_ranks_on_this_cpu_take_the_step_of_one_process_over_the_doubled_batch(data, tmp_path, recipe, sharding):
    """`accelerate launch --multi_gpu --num_processes 2` (gloo ranks on a CPU), data parallel or FSDP-sharded:
    the ranks train on different samples, and the parameters after two steps equal one process's over the
    doubled batch (the loss averaged over the whole batch's tokens, the schedule stepped once per step)."""
    config = tmp_path / "two.yaml"
    config.write_text(
        f"name: two\nrecipe: {recipe}\ndata: {data}\nout: {tmp_path / 'two'}\nbatch_size: 2\n"
        f"sharding: {sharding}\n{TWO_RANKS}"
    )
    result = _launch_two_ranks(config)
    assert ("sharded" in result.stdout) == (sharding == "fsdp")  # the estimate of a sharded run says so
    order = [json.loads(line) for line in (tmp_path / "two" / "data_order.jsonl").read_text().splitlines()]
    assert [len(step["samples"]) for step in order] == [2, 2]  # world size 2
    assert all(step["samples"][0] != step["samples"][1] for step in order)  # the ranks read different samples

    one = tmp_path / "one.yaml"
    one.write_text(f"name: one\nrecipe: {recipe}\ndata: {data}\nout: {tmp_path / 'one'}\nbatch_size: 4\n{TWO_RANKS}")
    train(load_config(path=one), say=lambda _: None)
    lines = (tmp_path / "one" / "data_order.jsonl").read_text().splitlines()
    single = [json.loads(line)["samples"][0] for line in lines]
    assert single == [step["samples"][0] + step["samples"][1] for step in order]  # the same samples, in one batch
    from safetensors.torch import load_file

    two_params = load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    one_params = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    save_model(initial_model(load_config(path=one)), tmp_path / "initial")
    initial = load_file(str(tmp_path / "initial" / "model.safetensors"))
    assert two_params.keys() == one_params.keys()
    moved = max(float((one_params[k] - initial[k]).norm() / initial[k].norm().clamp(min=1e-12)) for k in initial)
    assert moved > 1e-3  # the two steps changed the weights: equal parameters are no coincidence
    relative = [
        float((two_params[k] - one_params[k]).norm() / one_params[k].norm().clamp(min=1e-12)) for k in one_params
    ]
    worst = max(relative)
    assert worst < 1e-5, worst
    if sharding == "fsdp":  # the checkpoint holds the gathered optimizer state, as one process's
        from fastddrive.train.checkpoint import optimizer_state

        two_state = optimizer_state(tmp_path / "two" / "checkpoint-000002")
        one_state = optimizer_state(tmp_path / "one" / "checkpoint-000002")
        assert two_state["state"].keys() == one_state["state"].keys()
        for index, moments in one_state["state"].items():
            assert two_state["state"][index]["exp_avg"].shape == moments["exp_avg"].shape


def test_a_sharded_bf16_run_resumes_to_the_uninterrupted_runs_weights(data, tmp_path):
    """FSDP over two gloo ranks with bf16 weights (their float32 moments sharded as DTensors): the final model is
    saved whole in bf16; a run that lost its last checkpoint resumes from the one before, its state gathered
    whole and sharded again, and ends with the uninterrupted run's weights bit for bit."""
    from safetensors.torch import load_file

    config = tmp_path / "bf16.yaml"
    every_step = TWO_RANKS.replace("checkpoint_every: 2", "checkpoint_every: 1")
    config.write_text(
        f"name: bf16\nrecipe: sasd\ndata: {data}\nout: {tmp_path / 'run'}\nbatch_size: 2\nsharding: fsdp\n"
        f"mixed_precision: bf16\nweights_dtype: bfloat16\n{every_step}"
    )
    _launch_two_ranks(config)
    whole = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    assert {v.dtype for v in whole.values()} == {torch.bfloat16}
    saved = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert saved["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]  # a plain model folder, not FSDP's
    shutil.rmtree(tmp_path / "run" / "final")
    shutil.rmtree(tmp_path / "run" / "checkpoint-000002")
    resumed = _launch_two_ranks(config, "--resume")
    assert "resuming from checkpoint-000001" in resumed.stdout
    again = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    assert all(torch.equal(again[k], whole[k]) for k in whole)


def test_each_section_is_masked_at_the_rate_of_its_own_beta_noise():
    """Paper 000 section 3.2: section s is masked at t ~ Beta(a_s, b_s). The masked share of each section,
    averaged over many batches, is the mean a / (a + b) of that section's own Beta; swapping two
    sections' (a, b) moves at least two of these means by 0.1 or more."""
    from model_fixtures import text_model

    model = text_model()
    config = load_config("tiny-sasd", block_size=32)
    scaffold = Scaffold(model.tokenizer)
    collator = DualStreamCollator(model, scaffold, config)
    example = collator.example(synthetic_sample(0))
    starts = [b.start for b in scaffold.blocks(32)]
    rng = np.random.default_rng(7)
    shares = {name: [] for name in SECTIONS}
    for _ in range(600):
        masked = (collator([example], 32, rng).noisy_ids[0, 0] == scaffold.mask_id).numpy()
        for k, name in enumerate(SECTIONS):
            maskable = scaffold.is_value & (scaffold.section_index == k)
            maskable[starts] = False
            shares[name].append(masked[maskable].mean())
    for name in SECTIONS:
        a, b = config.section_noise[name]
        assert abs(np.mean(shares[name]) - a / (a + b)) < 0.04, (name, np.mean(shares[name]), a / (a + b))


def test_a_run_whose_every_checkpoint_is_corrupt_starts_over_without_duplicate_log_rows(data, tmp_path):
    settings = dict(data=data, steps=4, architecture=SMALL, **QUICK)
    train(load_config("tiny-ar", out=str(tmp_path / "whole"), **settings))
    config = load_config("tiny-ar", out=str(tmp_path / "run"), **settings)
    train(config, stop_after=4)
    for checkpoint in list_checkpoints(tmp_path / "run"):
        (checkpoint / "optimizer.safetensors").unlink()
    train(config, resume=True, say=lambda _: None)

    def logged_steps(run):
        with (tmp_path / run / "log.csv").open() as handle:
            return [row["step"] for row in csv.DictReader(handle)]

    assert logged_steps("run") == logged_steps("whole")  # the first attempt's rows are gone, none is empty


@pytest.mark.parametrize("preset", ["tiny-ar", "tiny-sasd"])
def test_the_parts_of_a_split_batch_over_its_global_token_counts_sum_to_the_whole_batchs_loss(data, preset):
    """What each data-parallel process computes (its sums over the whole batch's token counts) adds up to one
    process's loss over the whole batch, whatever the processes' token counts (AR answers differ in length)."""
    from fastddrive.train.collate import IGNORE
    from fastddrive.train.loop import batch_loss, step_noise
    from fastddrive.train.losses import TokenCounts

    config = load_config(preset, architecture=SMALL, data=data, out="unused")
    model = initial_model(config.model_copy(update={"init_from": "scratch"}))
    collator = DualStreamCollator(
        model, Scaffold(model.tokenizer, explanation_budget=config.explanation_budget), config
    )
    samples = list(DrivingDataset.open(data).samples("train"))[:4]
    examples = [collator.example(s) for s in samples]

    def loss(part: list, first: int, counts=None):
        batch = collator(part, config.block_size, step_noise(config, 0, first, len(part)))
        with torch.no_grad():
            noisy, clean = model.dual_stream_logits(**batch.forward_inputs())
        return batch_loss(noisy, clean, batch, config, counts), batch

    whole, batch = loss(examples, 0)
    counts = TokenCounts(int((batch.clean_labels != IGNORE).sum()), int((batch.noisy_labels != IGNORE).sum()))
    halves = [loss(examples[:2], 0, counts)[0], loss(examples[2:], 2, counts)[0]]
    assert torch.allclose(halves[0].total + halves[1].total, whole.total, rtol=1e-5)


PEAK_SCRIPT = """
import re
from fastddrive.cli import main

def kib(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))

# A child's peak resident set starts as its parent's (forked from pytest): reset it, then measure from here.
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")
base = kib("VmRSS")
try:
    main()
finally:
    print(f"PEAK_KIB {kib('VmHWM') - base}", flush=True)
"""


STEP_SCRIPT = """
import re, sys
from fastddrive.core.scaffold import Scaffold
from fastddrive.data.dataset import DrivingDataset
from fastddrive.train.collate import DualStreamCollator
from fastddrive.train.config import load_config
from fastddrive.train.loop import initial_model, make_optimizer, prepare_memory, samples_loss, step_noise
from fastddrive.train.loop import training_memory

def kib(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))

with open("/proc/self/clear_refs", "w") as refs:  # the peak from here, not the parent's (PEAK_SCRIPT)
    refs.write("5")
base = kib("VmRSS")
config = load_config(path=sys.argv[1], data=sys.argv[2], out="unused")
print(f"ESTIMATE_BYTES {training_memory(config).per_rank_bytes}", flush=True)
model = initial_model(config)
prepare_memory(model, config)
model.model.train()
optimizer = make_optimizer(model.model, config)
collator = DualStreamCollator(model, Scaffold(model.tokenizer, explanation_budget=config.explanation_budget), config)
samples = list(DrivingDataset.open(config.data).samples("train"))[: config.batch_size]
noise = step_noise(config, 0, 0, len(samples))
samples_loss(model, collator, samples, config.block_size, noise, config).total.backward()
optimizer.step()
print(f"PEAK_KIB {kib('VmHWM') - base}", flush=True)
"""
CAP = "9.5GiB"  # between the bf16 run with checkpointing and the float32 run without (their estimates: 8.07, 11.03)


def _peak_run(arguments: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, int, int]:
    """`fastddrive train ARGUMENTS` in a fresh process: the result, the estimate it printed first and the peak
    resident memory the run added (bytes)."""
    command = [sys.executable, "-c", PEAK_SCRIPT, "train", *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})
    found = re.search(r"memory estimate per process: ([\d.]+) GiB", done.stdout)
    peak = re.search(r"PEAK_KIB (\d+)", done.stdout)
    estimate = int(float(found.group(1)) * 2**30) if found else 0
    return done, estimate, int(peak.group(1)) * 1024 if peak else 0


def test_the_3b_width_cut_preset_trains_in_bf16_with_checkpointing_under_a_cap_the_float32_run_exceeds(data, tmp_path):
    """`qwen2.5-vl-3b-cut`: the 3B's widths cut to 2 layers and a 2-block vision tower, the real vocabulary,
    bf16 weights with float32 moments and gradient checkpointing, its first step (the preset's two take twice
    the time on this CPU) under a memory budget (CAP), checkpoint included; its final model is saved in bf16.
    The float32 run without checkpointing is refused under that budget and its training step, run anyway, holds
    more than it. Each peak is within 25% of its estimate."""
    from safetensors import safe_open

    out = tmp_path / "cut"
    done, estimate, peak = _peak_run(
        ["--preset", "qwen2.5-vl-3b-cut", "--data", str(data), "--out", str(out), "--steps", "1"],
        {"FASTDDRIVE_MEMORY_BUDGET": CAP},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert abs(peak - estimate) <= 0.25 * peak, (peak / 2**30, estimate / 2**30)
    cap = float(CAP.removesuffix("GiB")) * 2**30
    assert peak < cap, peak / 2**30
    with safe_open(str(out / "final" / "model.safetensors"), "pt") as saved:
        assert {saved.get_slice(k).get_dtype() for k in saved.keys()} == {"BF16"}  # noqa: SIM118

    float32 = tmp_path / "float32.yaml"
    preset = (presets_dir() / "qwen2.5-vl-3b-cut.yaml").read_text()
    changes = {"mixed_precision: bf16": "mixed_precision: 'no'", "weights_dtype: bfloat16": "weights_dtype: float32"}
    changes["gradient_checkpointing: true"] = "gradient_checkpointing: false"
    for old, new in changes.items():
        assert old in preset
        preset = preset.replace(old, new)
    float32.write_text(preset)
    plain = ["--config", str(float32), "--data", str(data), "--steps", "1"]
    refused, _, _ = _peak_run([*plain, "--out", str(tmp_path / "refused")], {"FASTDDRIVE_MEMORY_BUDGET": CAP})
    assert refused.returncode == 2 and "budget" in refused.stderr + refused.stdout, refused.stderr[-2000:]
    assert not (tmp_path / "refused").exists()
    # Run anyway, its first training step (the loop's: the dual-stream batch, backward, AdamW) is measured
    # alone: the training command would then write 9 GB of checkpoint and final model for nothing.
    step = [sys.executable, "-c", STEP_SCRIPT, str(float32), str(data)]
    done = subprocess.run(step, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    estimate = int(re.search(r"ESTIMATE_BYTES (\d+)", done.stdout).group(1))
    peak = int(re.search(r"PEAK_KIB (\d+)", done.stdout).group(1)) * 1024
    assert peak > cap, peak / 2**30
    assert abs(peak - estimate) <= 0.25 * peak, (peak / 2**30, estimate / 2**30)

    estimate_only = CliRunner().invoke(app, ["train", "--preset", "qwen2.5-vl-3b-cut", "--estimate-only", "--json"])
    parts = json.loads(estimate_only.stdout)
    assert parts["per_rank_bytes"] == sum(
        parts[k] for k in ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "batch_bytes")
    )
    assert parts["model_parameters"] > 5e8  # 3B widths with the real vocabulary: the embedding alone is 311M
    alone = CliRunner().invoke(
        app,
        ["train", "--preset", "qwen2.5-vl-3b-cut", "--estimate-only", "--json"],
        env={"FASTDDRIVE_MEMORY_BUDGET": "1GiB"},
    )
    assert alone.exit_code == 0  # an estimate alone is never refused
