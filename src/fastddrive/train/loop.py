"""The training loop: one command for one CPU, one GPU or several processes (`accelerate launch`).

Every step's data and masks come from generators seeded with (seed, step[, rank]), so a run resumed
from a checkpoint takes exactly the steps an uninterrupted run would have taken.
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from fastddrive.data.sample import DrivingDataset, DrivingSample, from_row
from fastddrive.eval.accuracy import evaluate_greedy_ar
from fastddrive.model import BlockDiffusionModel, CheckpointInfo
from fastddrive.model_files import (
    ensure_diffusion_tokens,
    load_model,
    model_path,
    save_model,
    tiny_image_processor,
    tiny_qwen2_5_vl,
)
from fastddrive.scaffold import Scaffold
from fastddrive.tokenizer import default_tokenizer_path, load_tokenizer
from fastddrive.train.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    optimizer_state,
    save_checkpoint,
    scheduler_state,
)
from fastddrive.train.collate import Batch, DualStreamCollator
from fastddrive.train.config import ConfigError, TrainConfig
from fastddrive.train.jacobi_forcing import JacobiForcingBatch, JacobiForcingCollator
from fastddrive.train.losses import LossParts, jacobi_forcing_loss, sasd_loss
from fastddrive.train.noise import annealed_block_size

LOG_FILE = "log.csv"
LOG_COLUMNS = (
    "step",
    "loss",
    "noisy_loss",
    "clean_loss",
    "labelled_loss",
    "lr",
    "block_size",
    "steps_per_s",
    "val_loss",
    "val_ade3",
    "val_ade5",
    "val_invalid",
)


@dataclass
class TrainReport:
    out: Path
    steps: int
    resumed_from: int
    seconds: float
    steps_per_second: float
    final: Path
    last_validation: dict[str, float]


def initial_model(config: TrainConfig) -> BlockDiffusionModel:
    """The starting point: a tiny Qwen2.5-VL from scratch, an embedded checkpoint, or a local folder."""
    if config.init_from == "scratch":
        tokenizer = load_tokenizer(default_tokenizer_path())
        model = tiny_qwen2_5_vl(tokenizer, **config.architecture.model_dump(), seed=config.seed)
        wrapper = BlockDiffusionModel(model, tokenizer, tiny_image_processor(config.image_max_pixels))
    else:
        path = (
            model_path(config.init_from.split(":", 1)[1])
            if config.init_from.startswith("embedded:")
            else Path(config.init_from)
        )
        if not (path / "config.json").is_file():
            raise ConfigError(f"init_from {config.init_from!r}: {path} holds no model (config.json is missing)")
        wrapper = load_model(path, training=True)
    ensure_diffusion_tokens(wrapper)
    wrapper.info = CheckpointInfo(
        kind="block-diffusion" if config.recipe == "sasd" else "autoregressive",
        mask_token_id=wrapper.info.mask_token_id,
        null_token_id=wrapper.info.null_token_id,
        explanation_budget=config.explanation_budget,
        block_size=config.block_size,
        scaffold_tokenization=config.scaffold_tokenization,
        extra={"preset": config.name},
    )
    return wrapper


def batch_loss(noisy: torch.Tensor, clean: torch.Tensor, batch: Batch, config: TrainConfig) -> LossParts:
    """The joint objective on one batch's dual-stream logits."""
    return sasd_loss(
        noisy,
        clean,
        batch.noisy_labels,
        batch.noisy_weights,
        batch.clean_labels,
        config.alpha,
        config.beta,
        clean_weights=batch.clean_weights,
    )


def jf_loss(logits: torch.Tensor, batch: JacobiForcingBatch, config: TrainConfig) -> LossParts:
    """Jacobi Forcing's objective (paper 003 Eq. 9) on one packed batch's logits."""
    return jacobi_forcing_loss(
        logits,
        batch.teacher,
        batch.student,
        batch.pair_weights,
        batch.blocks,
        batch.labels,
        batch.label_weights,
        config.ar_weight,
    )


def samples_loss(
    model: BlockDiffusionModel,
    collator: DualStreamCollator,
    samples: Sequence[DrivingSample],
    block: int,
    rng: np.random.Generator,
    config: TrainConfig,
) -> LossParts:
    """The collator's objective on `samples`' labelled answers: SASD's, or with the AR recipe's collator the
    section-weighted causal LM loss (which the `jf` recipe adds with `labelled_ar_weight`)."""
    batch = collator([collator.example(s) for s in samples], block, rng)
    noisy, clean = model.dual_stream_logits(**batch.forward_inputs())
    return batch_loss(noisy, clean, batch, config)


def rank_picks(key: list[int], pool: int, config: TrainConfig, world: int, rank: int) -> np.ndarray:
    """This process's share of one step's batch, drawn for every process from `pool` items by a generator
    seeded with `key`, so that a resumed or distributed run takes the same items."""
    picks = np.random.default_rng(key).choice(pool, config.batch_size * world)
    return picks[rank * config.batch_size : (rank + 1) * config.batch_size]


def lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio` of the peak."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def validate(
    model: BlockDiffusionModel,
    collator: DualStreamCollator,
    samples: list[DrivingSample],
    config: TrainConfig,
    ade_samples: int,
) -> dict[str, float]:
    """Validation loss on fixed samples and masks, and greedy-AR ADE on the first `ade_samples` of them."""
    model.model.eval()
    with torch.no_grad():
        rng = np.random.default_rng([config.seed, 10**9])
        parts = samples_loss(model, collator, samples, config.block_size, rng, config)
    accuracy = evaluate_greedy_ar(model, samples[:ade_samples])
    model.model.train()
    return {
        "val_loss": parts.total.item(),
        "val_ade3": accuracy.ade3_m,
        "val_ade5": accuracy.ade5_m,
        "val_invalid": accuracy.invalid,
    }


def _truncate_log(out: Path, resumed_from: int) -> None:
    """Drop the log's rows after the step a run (re)starts from: the model never kept them (all of them when
    it starts over because no checkpoint was usable)."""
    path = out / LOG_FILE
    if not path.is_file():
        return
    with path.open() as handle:
        kept = [r for r in csv.DictReader(handle) if r.get("step") and int(r["step"]) <= resumed_from]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, LOG_COLUMNS)
        writer.writeheader()
        writer.writerows(kept)


def _append_log(out: Path, row: dict[str, Any]) -> None:
    path = out / LOG_FILE
    new = not path.is_file()
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, LOG_COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow({k: row.get(k, "") for k in LOG_COLUMNS})


def train(
    config: TrainConfig,
    resume: bool = False,
    on_step: Callable[[int, int, dict[str, float]], None] | None = None,
    say: Callable[[str], None] = print,
    stop_after: int | None = None,
) -> TrainReport:
    """Run (or resume) a training run; `stop_after` ends it early at that step, as an interruption would."""
    transformers.utils.logging.disable_progress_bar()  # per-checkpoint "writing shards" bars drown the progress
    # Accelerate keeps mixed precision in a per-process singleton; a second run in one process (a notebook,
    # the tests) may use another precision. The distributed state (PartialState) is kept.
    AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(
        mixed_precision="bf16" if config.dtype == "bfloat16" else "no", cpu=not torch.cuda.is_available()
    )
    out = Path(config.out)
    DrivingDataset.open(config.data)  # a missing or foreign data folder is refused before anything is written
    existing = list_checkpoints(out)
    checkpoint = None
    if resume:
        checkpoint = latest_checkpoint(out, warn=say)
        if checkpoint is None:
            say(f"no usable checkpoint in {out}: starting from the beginning")
    elif existing:
        raise ConfigError(f"{out} already holds checkpoints; pass --resume to continue or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(config.model_dump(), indent=2))

    model = load_model(checkpoint.path, training=True) if checkpoint else initial_model(config)
    model.model.to(accelerator.device).train()
    scaffold = Scaffold(
        model.tokenizer,
        explanation_budget=config.explanation_budget,
        scaffold_tokenization=config.scaffold_tokenization,
    )
    # A Jacobi Forcing model stays an AR model: it is validated as the AR recipe's are.
    jacobi = JacobiForcingCollator(model, scaffold, config) if config.recipe == "jf" else None
    if jacobi is not None and jacobi.left_out:
        say(f"{jacobi.left_out} trajectories left out of {len(jacobi) + jacobi.left_out}: their answers do not parse")
    collator = DualStreamCollator(
        model, scaffold, config.model_copy(update={"recipe": "ar"}) if jacobi is not None else config
    )
    dataset = DrivingDataset.open(config.data)
    rows = dataset.table("train").to_pylist()
    if not rows:
        raise ConfigError(f"{config.data} has no training samples")
    val_rows = dataset.table("val").to_pylist()[: config.validation_samples] or rows[: config.validation_samples]
    val_samples = [from_row(r) for r in val_rows]

    optimizer = torch.optim.AdamW(model.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    start = 0
    if checkpoint:
        optimizer.load_state_dict(optimizer_state(checkpoint.path))
        scheduler.load_state_dict(scheduler_state(checkpoint.path))
        start = checkpoint.step
        say(f"resuming from {checkpoint.path.name} (step {start})")
    if resume:
        _truncate_log(out, start)
    model.model, optimizer, scheduler = accelerator.prepare(model.model, optimizer, scheduler)

    world, rank = accelerator.num_processes, accelerator.process_index
    last_validation: dict[str, float] = {}
    began = time.perf_counter()
    window_start, window_steps = time.perf_counter(), 0
    end = min(config.steps, stop_after) if stop_after is not None else config.steps
    for step in range(start, end):
        mine = rank_picks([config.seed, step], len(jacobi) if jacobi is not None else len(rows), config, world, rank)
        if jacobi is not None:
            block = config.jacobi_block_size
            packed = jacobi(mine)
            with accelerator.autocast():
                parts = jf_loss(model.packed_logits(**packed.forward_inputs()), packed, config)
                if config.labelled_ar_weight:
                    labelled = rank_picks([config.seed, step, 2], len(rows), config, world, rank)
                    unused = np.random.default_rng(0)  # the AR recipe's batches draw no noise
                    samples = [from_row(rows[i]) for i in labelled]
                    parts.labelled = samples_loss(model, collator, samples, config.block_size, unused, config).clean
                    parts.total = parts.total + config.labelled_ar_weight * parts.labelled
        else:
            block = annealed_block_size(step / config.steps, config.block_size, config.anneal_block_size)
            rng = np.random.default_rng([config.seed, step, rank, 1])
            with accelerator.autocast():
                parts = samples_loss(model, collator, [from_row(rows[i]) for i in mine], block, rng, config)
        accelerator.backward(parts.total)
        if config.grad_clip:
            accelerator.clip_grad_norm_(model.model.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window_steps += 1

        done = step + 1
        metrics = {
            "loss": parts.total.item(),
            "noisy_loss": parts.noisy.item(),
            "clean_loss": parts.clean.item(),
            **({"labelled_loss": parts.labelled.item()} if parts.labelled is not None else {}),
            "lr": scheduler.get_last_lr()[0],
            "block_size": block,
        }
        if done % config.log_every == 0 or done == end:
            metrics["steps_per_s"] = window_steps / (time.perf_counter() - window_start)
            window_start, window_steps = time.perf_counter(), 0
            if accelerator.is_main_process:
                _append_log(out, {"step": done, **metrics})
        if done % config.validate_every == 0 or done == config.steps:
            last_validation = validate(model, collator, val_samples, config, ade_samples=config.validation_samples)
            if accelerator.is_main_process:
                _append_log(out, {"step": done, **last_validation})
            metrics |= last_validation
        if (done % config.checkpoint_every == 0 or done == end) and accelerator.is_main_process:
            save_checkpoint(out, done, model, optimizer, scheduler, {"preset": config.name}, config.keep_checkpoints)
        accelerator.wait_for_everyone()
        if on_step and accelerator.is_main_process:
            on_step(done, config.steps, metrics)

    final = out / "final"
    if end == config.steps and accelerator.is_main_process:
        save_model(model, final)
    seconds = time.perf_counter() - began
    return TrainReport(out, end, start, seconds, (end - start) / seconds if seconds else 0.0, final, last_validation)
