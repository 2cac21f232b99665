"""The training loop: one command for one CPU, one GPU or several processes (`accelerate launch`).

Every step's data and masks come from generators seeded with (seed, step[, rank]), so a run resumed
from a checkpoint takes exactly the steps an uninterrupted run would have taken.
"""

from __future__ import annotations

import csv
import io
import json
import math
import resource
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from pydantic import ValidationError

from fastddrive.core.memory import MemoryBudgetError, check_allocation
from fastddrive.core.outputs import OutputError, check_folder_destination, owner, write_json, write_text
from fastddrive.core.sample import DrivingSample, SampleError
from fastddrive.core.scaffold import Scaffold
from fastddrive.core.tokenizer import default_tokenizer_path, load_tokenizer
from fastddrive.core.training_episodes import Episode, training_episodes, with_training_episodes
from fastddrive.data.dataset import DrivingDataset, check_row_numbers, from_row
from fastddrive.engine.model import BlockDiffusionModel, CheckpointInfo
from fastddrive.engine.model_files import (
    INFO_FILE,
    ensure_diffusion_tokens,
    load_model,
    model_path,
    read_info,
    save_model,
    tiny_image_processor,
    tiny_qwen2_5_vl,
)
from fastddrive.engine.random_init import random_init_model
from fastddrive.train.bf16_adamw import BF16AdamW
from fastddrive.train.checkpoint import (
    Checkpoint,
    latest_checkpoint,
    list_checkpoints,
    optimizer_state,
    remove_leftovers,
    save_checkpoint,
    scheduler_state,
)
from fastddrive.train.collate import IGNORE, Batch, DualStreamCollator
from fastddrive.train.config import ConfigError, TrainConfig
from fastddrive.train.jacobi_forcing import JacobiForcingBatch, JacobiForcingCollator, checked_trajectories
from fastddrive.train.losses import LossParts, TokenCounts, jacobi_forcing_loss, sasd_loss
from fastddrive.train.memory_estimate import MemoryEstimate, estimate_training_memory, model_shape
from fastddrive.train.noise import annealed_block_size
from fastddrive.train.sharding import (
    full_value,
    full_weights,
    gathered_model,
    gathered_optimizer_state,
    load_optimizer_state,
    shard_model,
)
from fastddrive.train.trajectories import TrajectorySet
from fastddrive.train.validation import greedy_ar_ade

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
    "samples_per_s",
    "tokens_per_s",
    "peak_memory_gib",
    "val_loss",
    "val_ade3",
    "val_ade5",
    "val_invalid",
)
# Settings that say where things are or what is reported, not what is trained: a resumed run may change them
# (the data set and the trajectories are compared by their fingerprints instead of their paths). `steps` too:
# training a finished run longer is what --resume is for (the lr schedule is stretched from there on, and said).
RESUME_FREE_SETTINGS = frozenset(
    {
        "steps",
        "out",
        "data",
        "trajectories",
        "init_from",
        "log_every",
        "checkpoint_every",
        "keep_checkpoints",
        "validate_every",
        "validation_samples",
    }
)


class NonFiniteLoss(ConfigError):
    """A training step whose loss (or gradient) is NaN or infinite: the run stops there, keeping its last
    checkpoint and saving no final model (issue 32). A config or data problem: exit status 2."""


@dataclass
class TrainReport:
    """A finished training run: where it wrote, the steps taken (and the one it resumed from), speed, the final model
    folder and the last validation figures."""

    out: Path
    steps: int
    resumed_from: int
    seconds: float
    steps_per_second: float
    final: Path
    last_validation: dict[str, float]


def initial_model(config: TrainConfig, episodes: Iterable[Episode] = ()) -> BlockDiffusionModel:
    """The starting point: a tiny Qwen2.5-VL from scratch, an embedded checkpoint, or a local folder; its
    fastddrive.json records the simulated `episodes` this run trains on besides those its start was trained on
    (core/training_episodes.py)."""
    path = _init_path(config)
    if config.init_from.startswith("random:"):
        wrapper = random_init_model(
            config.init_from.split(":", 1)[1], dtype=torch.float32, shrink=config.random_shrink, seed=config.seed
        )
        wrapper.model.train()
    elif path is None:
        tokenizer = load_tokenizer(default_tokenizer_path())
        model = tiny_qwen2_5_vl(tokenizer, **config.architecture.model_dump(), seed=config.seed)
        wrapper = BlockDiffusionModel(model, tokenizer, tiny_image_processor(config.image_max_pixels))
    else:
        wrapper = load_model(path, training=True)
    if wrapper.image_processor is not None:  # frames resized as the config says, whatever the folder held
        wrapper.set_image_pixels(config.image_min_pixels, config.image_max_pixels)
    ensure_diffusion_tokens(wrapper)
    wrapper.info = CheckpointInfo(
        kind="block-diffusion" if config.recipe == "sasd" else "autoregressive",
        mask_token_id=wrapper.info.mask_token_id,
        null_token_id=wrapper.info.null_token_id,
        explanation_budget=config.explanation_budget,
        block_size=config.block_size,
        scaffold_tokenization=config.scaffold_tokenization,
        extra=with_training_episodes({"preset": config.name}, training_episodes(wrapper.info.extra) | set(episodes)),
        cameras=wrapper.info.cameras,  # how the model reads its input stays the folder's
        prompt=wrapper.info.prompt,
    )
    return wrapper


def taught_episodes(dataset: DrivingDataset, trajectories: TrajectorySet | None) -> set[Episode]:
    """The simulated episodes a run learns from: its training split's, and those of the samples whose prompts
    the Jacobi Forcing trajectories were collected on (in the split they name)."""
    episodes = dataset.simulated_episodes("train")
    if trajectories is not None:
        indices = [t.index for t in trajectories.trajectories]
        episodes |= dataset.simulated_episodes(trajectories.settings["split"], indices)
    return episodes


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the trained parameters: torch's over float32 weights, BF16AdamW over bf16 ones."""
    trained = [p for p in model.parameters() if p.requires_grad]
    if config.weights_dtype == "bfloat16":
        return BF16AdamW(trained, lr=config.lr, weight_decay=config.weight_decay, seed=config.seed)
    return torch.optim.AdamW(trained, lr=config.lr, weight_decay=config.weight_decay)


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process has held: the GPU's allocations, or on the CPU the resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def prepare_memory(model: BlockDiffusionModel, config: TrainConfig) -> None:
    """The config's memory settings on the model: transformers' non-reentrant gradient checkpointing (language
    model and vision tower) and a frozen vision tower."""
    if config.gradient_checkpointing:
        non_reentrant = {"use_reentrant": False}
        if hasattr(model.model, "activation_checkpointing_enable"):  # the newer transformers name
            model.model.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
        else:
            model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)
    if config.freeze_vision and model.is_vision:
        model.model.model.visual.requires_grad_(False)


def continued_layout(config: TrainConfig, init: Path | None) -> TrainConfig:
    """The config with the answer layout of the folder it starts from where the config is silent: an imported
    official checkpoint goes on in the release layout with its 192-token explanation (fastddrive.json)."""
    if init is None:
        return config
    info = read_info(init)
    carried = {"scaffold_tokenization": info.scaffold_tokenization, "explanation_budget": info.explanation_budget}
    update = {k: v for k, v in carried.items() if v is not None and k not in config.model_fields_set}
    if not update:
        return config
    try:
        return TrainConfig.model_validate(config.model_dump() | update)
    except ValidationError as err:
        problem = err.errors(include_url=False)[0]
        raise ConfigError(
            f"init_from {config.init_from!r}: its {INFO_FILE} {problem['loc'][0]} does not fit a training config: "
            f"{problem['msg']}"
        ) from None


def batch_loss(
    noisy: torch.Tensor, clean: torch.Tensor, batch: Batch, config: TrainConfig, counts: TokenCounts | None = None
) -> LossParts:
    """The joint objective on one batch's dual-stream logits (means over `counts` where given)."""
    return sasd_loss(
        noisy,
        clean,
        batch.noisy_labels,
        batch.noisy_weights,
        batch.clean_labels,
        config.alpha,
        config.beta,
        clean_weights=batch.clean_weights,
        counts=counts,
    )


def jf_loss(logits: torch.Tensor, batch: JacobiForcingBatch, config: TrainConfig) -> LossParts:
    """Jacobi Forcing's objective (paper 003 Eq. 9) on one packed batch's logits."""
    parts = jacobi_forcing_loss(
        logits,
        batch.teacher,
        batch.student,
        batch.pair_weights,
        batch.blocks,
        batch.labels,
        batch.label_weights,
        config.ar_weight,
    )
    parts.tokens = batch.input_ids.numel()
    return parts


def samples_loss(
    model: BlockDiffusionModel,
    collator: DualStreamCollator,
    samples: Sequence[DrivingSample],
    block: int,
    rng: np.random.Generator | list[np.random.Generator],
    config: TrainConfig,
    global_counts: Callable[[Batch], TokenCounts] | None = None,
) -> LossParts:
    """The collator's objective on `samples`' labelled answers: SASD's, or with the AR recipe's collator the
    section-weighted causal LM loss (which the `jf` recipe adds with `labelled_ar_weight`). `global_counts`
    gives the token counts of the whole data-parallel batch to average over (`TokenCounts`)."""
    batch = collator([collator.example(s) for s in samples], block, rng)
    noisy, clean = model.dual_stream_logits(**batch.forward_inputs())
    parts = batch_loss(noisy, clean, batch, config, global_counts(batch) if global_counts else None)
    parts.tokens = int(batch.clean_lengths.sum()) + batch.noisy_ids.numel()
    return parts


def step_noise(config: TrainConfig, step: int, first: int, count: int) -> list[np.random.Generator]:
    """The noise generators of a step's examples `first` .. `first + count - 1` of its global batch: keyed by
    the example's place, so that one process over the batch draws what its shares draw on several."""
    return [np.random.default_rng([config.seed, step, 1, first + k]) for k in range(count)]


def global_token_counts(accelerator: Accelerator) -> Callable[[Batch], TokenCounts]:
    """This process's batch's labelled tokens summed over every process (one all-reduce)."""

    def counts(batch: Batch) -> TokenCounts:
        local = [(batch.clean_labels != IGNORE).sum(), (batch.noisy_labels != IGNORE).sum()]
        total = accelerator.reduce(torch.stack(local).to(accelerator.device), "sum")
        return TokenCounts(int(total[0]), int(total[1]))

    return counts


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
    sharded: bool = False,
) -> dict[str, float]:
    """Validation loss on fixed samples and masks, and greedy-AR ADE on the first `ade_samples` of them."""
    model.model.eval()
    with torch.no_grad():
        rng = np.random.default_rng([config.seed, 10**9])
        parts = samples_loss(model, collator, samples, config.block_size, rng, config)
    with full_weights(model.model) if sharded else nullcontext():
        accuracy = greedy_ar_ade(model, samples[:ade_samples])
    model.model.train()
    return {
        "val_loss": parts.total.item(),
        "val_ade3": accuracy.ade3_m,
        "val_ade5": accuracy.ade5_m,
        "val_invalid": accuracy.invalid,
    }


def _truncate_log(out: Path, resumed_from: int) -> None:
    """Drop the log's rows after the step a run (re)starts from: the model never kept them (all of them when
    it starts over because no checkpoint was usable). Rewritten atomically."""
    path = out / LOG_FILE
    if not path.is_file():
        return
    with path.open() as handle:
        kept = [r for r in csv.DictReader(handle) if r.get("step") and int(r["step"]) <= resumed_from]
    text = io.StringIO()
    writer = csv.DictWriter(text, LOG_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(kept)
    write_text(path, text.getvalue())


DATA_ORDER_FILE = "data_order.jsonl"  # per step, the sample ids each process trained on


def _record_data_order(out: Path, step: int, per_process: list[list[str]], resumed_from: int | None = None) -> None:
    """Append a step's sample ids per process (or, with `resumed_from`, first drop the steps after it)."""
    path = out / DATA_ORDER_FILE
    if resumed_from is not None and path.is_file():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= resumed_from]
        write_text(path, "".join(f"{line}\n" for line in kept))
    with path.open("a") as handle:
        handle.write(json.dumps({"step": step, "samples": per_process}) + "\n")


def _append_log(out: Path, row: dict[str, Any]) -> None:
    path = out / LOG_FILE
    new = not path.is_file()
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, LOG_COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow({k: row.get(k, "") for k in LOG_COLUMNS})


def _init_path(config: TrainConfig) -> Path | None:
    """The model folder `init_from` names (None for 'scratch'), checked without loading it."""
    if config.init_from == "scratch" or config.init_from.startswith("random:"):
        return None
    if config.init_from.startswith("embedded:"):
        path = model_path(config.init_from.split(":", 1)[1])
    else:
        path = Path(config.init_from)
    if not (path / "config.json").is_file():
        raise ConfigError(f"init_from {config.init_from!r}: {path} holds no model (config.json is missing)")
    return path


def _check_out(config: TrainConfig, init: Path | None) -> Path:
    """`out` is a folder of the run's own: not a file, not one of its inputs or inside one, not a data set or
    a model folder, not in the installed package, writable."""
    out = Path(config.out)
    check_folder_destination(out, "out", inputs=(config.data, config.trajectories, init))
    what = owner(out.resolve())
    if what is not None:
        raise OutputError(f"out {out}: that is {what}; give the run a folder of its own")
    return out


def _check_rows(data: str, split: str, rows: list[dict[str, Any]]) -> None:
    """Refuse a data set holding a sample whose numbers are not finite, naming it: a NaN in a prompt trains
    the model on the text 'nan' without a word."""
    for index, row in enumerate(rows):
        try:
            check_row_numbers(row)
        except SampleError as err:
            raise ConfigError(
                f"{data}: {split} sample {index} ({row.get('sample_id')}): {err}; mend or leave out that sample"
            ) from None


def run_record(config: TrainConfig, dataset: DrivingDataset, trajectories: TrajectorySet | None) -> dict[str, Any]:
    """What each checkpoint records of its run, for `--resume` to compare: the config, and fingerprints of the
    data set and of the trajectories (the jf recipe)."""
    return {
        "config": json.loads(json.dumps(config.model_dump(mode="json"))),
        "data": dataset.fingerprint(),
        "trajectories": trajectories.digest if trajectories is not None else None,
    }


def run_changes(recorded: dict[str, Any], current: dict[str, Any], config: TrainConfig) -> list[str]:
    """How this run differs from the one a checkpoint recorded (settings a resume may change left out)."""
    changes = []
    if recorded.get("data") != current["data"]:
        changes.append(f"it was trained on another data set than {config.data} (their shard records differ)")
    if recorded.get("trajectories") != current["trajectories"]:
        changes.append(f"it was trained on other trajectories than {config.trajectories}")
    before, now = recorded.get("config") or {}, current["config"]
    for key in sorted(set(before) | set(now)):
        if key not in RESUME_FREE_SETTINGS and before.get(key) != now.get(key):
            changes.append(f"{key} was {_short(before.get(key))}, now {_short(now.get(key))}")
    return changes


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_resume(
    checkpoint: Checkpoint, current: dict[str, Any], config: TrainConfig, allow: bool, say: Callable[[str], None]
) -> None:
    """Refuse to resume a checkpoint of another data set or config unless allowed (then say what changed)."""
    recorded = checkpoint.state.get("run")
    if not isinstance(recorded, dict):
        say(f"{checkpoint.path.name} records no config or data fingerprint (an older fastddrive's): not compared")
        return
    steps_before = (recorded.get("config") or {}).get("steps")
    if steps_before not in (None, config.steps):
        say(
            f"resuming {checkpoint.path.name} to {config.steps} steps (it was a run of {steps_before}): the lr "
            "schedule is stretched to the new length from here on"
        )
    changes = run_changes(recorded, current, config)
    if not changes:
        return
    if allow:
        say(f"resuming {checkpoint.path.name} with changes: {'; '.join(changes)}")
        return
    more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
    raise ConfigError(
        f"--resume: {checkpoint.path} differs from this run: {'; '.join(changes[:3])}{more}; pass "
        "--resume-with-changes to continue it anyway, or give another --out"
    )


def training_memory(config: TrainConfig) -> MemoryEstimate:
    """The memory estimate of a run (`train.memory_estimate`) for the processes of this launch."""
    _init_path(config)  # a missing starting folder is named as such, before its config is read
    processes = PartialState(cpu=not torch.cuda.is_available()).num_processes  # gloo on a machine without GPUs
    sharded = config.sharding == "fsdp" and processes > 1
    return estimate_training_memory(config, model_shape(config), processes, sharded)


def check_training_memory(
    config: TrainConfig, device: torch.device, say: Callable[[str], None], refuse: bool = True
) -> None:
    """Print the memory a process will hold, and refuse a run whose estimate exceeds the device's budget
    (MemoryBudgetError naming it), before anything is written; with `refuse` False, say so and go on."""
    estimate = training_memory(config)
    say(estimate.line())
    what = f"training batch_size={config.batch_size} ({estimate.model_parameters:,} parameters from {config.init_from})"
    try:
        check_allocation(what, estimate.per_rank_bytes, device)
    except MemoryBudgetError as err:
        if refuse:
            raise
        say(f"{err} (training anyway: --ignore-memory-estimate)")


def _non_finite_term(parts: LossParts, recipe: str) -> str | None:
    """Which loss term of a step is NaN or infinite ("the noisy loss is nan"), None when all are finite."""
    names = {"noisy": "consistency" if recipe == "jf" else "noisy", "clean": "AR" if recipe == "jf" else "clean"}
    for attr in ("noisy", "clean", "labelled"):
        value = getattr(parts, attr)
        if value is not None and not torch.isfinite(value).all():
            return f"the {names.get(attr, attr)} loss is {value.item()}"
    return None if torch.isfinite(parts.total).all() else f"the loss is {parts.total.item()}"


def _stop(step: int, problem: str, out: Path) -> NonFiniteLoss:
    kept = list_checkpoints(out)
    last = f"the last good checkpoint, {kept[-1].name}, is kept" if kept else "no checkpoint had been written yet"
    return NonFiniteLoss(
        f"training stopped at step {step}: {problem}; no final model is saved and {last} in {out}; lower lr or "
        "check the data and the loss weights (resuming with a changed config needs --resume-with-changes)"
    )


def train(
    config: TrainConfig,
    resume: bool = False,
    on_step: Callable[[int, int, dict[str, float]], None] | None = None,
    say: Callable[[str], None] = print,
    stop_after: int | None = None,
    allow_changes: bool = False,
    check_memory: bool = True,
) -> TrainReport:
    """Run (or resume) a training run; `stop_after` ends it early at that step, as an interruption would.

    Everything is checked before anything is written (issue 32): the config, `out`, the data set, the
    trajectories, the starting model's files, the memory the batches need, and on `resume` the checkpoint's
    files (a damaged one is reported and the previous one used) and that it was trained on this data set
    with this config (`allow_changes` lifts that). The run stops at the first non-finite loss, keeping its
    last checkpoint (NonFiniteLoss)."""
    transformers.utils.logging.disable_progress_bar()  # per-checkpoint "writing shards" bars drown the progress
    # Accelerate keeps mixed precision in a per-process singleton; a second run in one process (a notebook,
    # the tests) may use another precision. The distributed state (PartialState) is kept.
    AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(mixed_precision=config.mixed_precision, cpu=not torch.cuda.is_available())
    init = _init_path(config)
    config = continued_layout(config, init)
    out = _check_out(config, init)
    dataset = DrivingDataset.open(config.data)  # a missing or foreign data folder is refused before anything else
    rows = dataset.table("train").to_pylist()
    if not rows:
        raise ConfigError(f"{config.data} has no training samples")
    _check_rows(config.data, "train", rows)
    val_rows = dataset.table("val").to_pylist()[: config.validation_samples] or rows[: config.validation_samples]
    val_samples = [from_row(r) for r in val_rows]
    trajectories = checked_trajectories(config) if config.recipe == "jf" else None
    record = run_record(config, dataset, trajectories)

    checkpoint = None
    if resume:
        checkpoint = latest_checkpoint(out, warn=say)
        if checkpoint is None:
            say(f"no usable checkpoint in {out}: starting from the beginning")
        else:
            _check_resume(checkpoint, record, config, allow_changes, say)
    elif list_checkpoints(out):
        raise ConfigError(f"{out} already holds checkpoints; pass --resume to continue or choose another --out")
    check_training_memory(config, accelerator.device, say, refuse=check_memory)

    if checkpoint:  # its fastddrive.json already records the episodes the run trains on
        model = load_model(checkpoint.path, training=True)
    else:
        model = initial_model(config, taught_episodes(dataset, trajectories))
    model.model.to(accelerator.device, dtype=torch.bfloat16 if config.weights_dtype == "bfloat16" else None).train()
    scaffold = Scaffold(
        model.tokenizer,
        explanation_budget=config.explanation_budget,
        scaffold_tokenization=config.scaffold_tokenization,
    )
    # A Jacobi Forcing model stays an AR model: it is validated as the AR recipe's are.
    jacobi = JacobiForcingCollator(model, scaffold, config, trajectories) if trajectories is not None else None
    if jacobi is not None and jacobi.left_out:
        say(f"{jacobi.left_out} trajectories left out of {len(jacobi) + jacobi.left_out}: their answers do not parse")
    collator = DualStreamCollator(
        model, scaffold, config.model_copy(update={"recipe": "ar"}) if jacobi is not None else config
    )

    # Everything is checked: from here on the run writes.
    if accelerator.is_main_process:
        leftovers = remove_leftovers(out)
        if leftovers:
            say(f"removed {len(leftovers)} leftover temporary folder(s) of an interrupted save: {leftovers[0].name}")
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "train_config.json", config.model_dump(mode="json"))
    accelerator.wait_for_everyone()

    world, rank = accelerator.num_processes, accelerator.process_index
    prepare_memory(model, config)
    sharded = config.sharding == "fsdp" and world > 1
    if config.sharding == "fsdp" and not sharded:
        say("sharding: fsdp with one process: nothing to shard, the run holds the whole model")
    if sharded:
        shard_model(model.model, world, accelerator.device)
    optimizer = make_optimizer(model.model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    start = 0
    if checkpoint:
        saved = optimizer_state(checkpoint.path)
        if sharded:
            load_optimizer_state(model.model, optimizer, saved)
        else:
            optimizer.load_state_dict(saved)
        scheduler.load_state_dict(scheduler_state(checkpoint.path))
        start = checkpoint.step
        say(f"resuming from {checkpoint.path.name} (step {start})")
    if resume and accelerator.is_main_process:
        _truncate_log(out, start)
    # The scheduler is not prepared: accelerate's would step it once per process at every optimizer step. A
    # sharded model is not either: FSDP already averages its gradients over the processes.
    if sharded:
        optimizer = accelerator.prepare(optimizer)
    else:
        model.model, optimizer = accelerator.prepare(model.model, optimizer)

    # Data parallel: each process averages over the whole batch's tokens and scales by the processes, whose
    # gradients DDP averages, so that a step equals one process's over the whole batch.
    shared = global_token_counts(accelerator) if world > 1 else None
    last_validation: dict[str, float] = {}
    began = time.perf_counter()
    window_start, window_steps, window_tokens = time.perf_counter(), 0, 0
    end = min(config.steps, stop_after) if stop_after is not None else config.steps
    for step in range(start, end):
        done = step + 1
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
                    ar = samples_loss(model, collator, samples, config.block_size, unused, config)
                    parts.labelled, parts.tokens = ar.clean, parts.tokens + ar.tokens
                    parts.total = parts.total + config.labelled_ar_weight * parts.labelled
        else:
            block = annealed_block_size(step / config.steps, config.block_size, config.anneal_block_size)
            noise = step_noise(config, step, rank * config.batch_size, len(mine))
            with accelerator.autocast():
                samples = [from_row(rows[i]) for i in mine]
                parts = samples_loss(model, collator, samples, block, noise, config, shared)
        problem = _non_finite_term(parts, config.recipe)
        if world > 1:  # every process stops together, or the others would wait for it forever
            flags = accelerator.reduce(torch.tensor([int(problem is not None)], device=accelerator.device), "sum")
            problem = problem or ("the loss of another process is not finite" if flags.item() else None)
        if problem is not None:
            raise _stop(done, problem, out)
        accelerator.backward(parts.total * world if shared is not None and jacobi is None else parts.total)
        norm = accelerator.clip_grad_norm_(model.model.parameters(), config.grad_clip)
        norm = full_value(norm) if norm is not None else None
        if norm is not None and not torch.isfinite(torch.as_tensor(norm)).all():
            raise _stop(done, f"the gradient norm is {float(norm)} (the loss is {parts.total.item()})", out)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window_steps += 1
        window_tokens += parts.tokens
        if jacobi is None:
            taken = torch.as_tensor(np.asarray(mine), device=accelerator.device)
            taken = accelerator.gather(taken).reshape(world, -1).tolist() if world > 1 else [taken.tolist()]
            if accelerator.is_main_process:
                ids = [[rows[i]["sample_id"] for i in share] for share in taken]
                _record_data_order(out, done, ids, resumed_from=start if step == start and resume else None)

        if shared is not None and jacobi is None:  # this process's part of the batch's means: their sum
            summed = accelerator.reduce(torch.stack([parts.total, parts.noisy, parts.clean]).detach(), "sum")
            parts.total, parts.noisy, parts.clean = summed[0], summed[1], summed[2]
        metrics = {
            "loss": parts.total.item(),
            "noisy_loss": parts.noisy.item(),
            "clean_loss": parts.clean.item(),
            **({"labelled_loss": parts.labelled.item()} if parts.labelled is not None else {}),
            "lr": scheduler.get_last_lr()[0],
            "block_size": block,
        }
        if done % config.log_every == 0 or done == end:
            elapsed = time.perf_counter() - window_start
            metrics["steps_per_s"] = window_steps / elapsed
            metrics["samples_per_s"] = window_steps * config.batch_size * world / elapsed
            metrics["tokens_per_s"] = window_tokens * world / elapsed  # this process's positions, times the processes
            metrics["peak_memory_gib"] = peak_memory_bytes(accelerator.device) / 2**30
            window_start, window_steps, window_tokens = time.perf_counter(), 0, 0
            if accelerator.is_main_process:
                _append_log(out, {"step": done, **metrics})
        if config.validation_samples and (done % config.validate_every == 0 or done == config.steps):
            last_validation = validate(model, collator, val_samples, config, config.validation_samples, sharded)
            if accelerator.is_main_process:
                _append_log(out, {"step": done, **last_validation})
            metrics |= last_validation
        if done % config.checkpoint_every == 0 or done == end:
            # A sharded run's state is gathered whole on the main process: every process takes part.
            whole = gathered_model(model.model) if sharded else None
            moments = gathered_optimizer_state(model.model, optimizer.optimizer) if sharded else optimizer.state_dict()
            if accelerator.is_main_process:
                state = {"preset": config.name, "run": record}
                save_checkpoint(out, done, model, moments, scheduler, state, config.keep_checkpoints, whole)
        accelerator.wait_for_everyone()
        if on_step and accelerator.is_main_process:
            on_step(done, config.steps, metrics)

    final = out / "final"
    if end == config.steps and sharded:
        whole = gathered_model(model.model, getattr(torch, config.final_dtype))
        if accelerator.is_main_process:
            save_model(model, final, whole)
    elif end == config.steps and accelerator.is_main_process:
        model.model = accelerator.unwrap_model(model.model)
        model.model.to(getattr(torch, config.final_dtype))  # training is over: bf16 drops the master weights
        save_model(model, final)
    seconds = time.perf_counter() - began
    return TrainReport(out, end, start, seconds, (end - start) / seconds if seconds else 0.0, final, last_validation)
