"""Peak GPU memory and speed of training steps of the real-width Qwen2.5-VL-3B (random weights) beside the memory
estimate, with and without gradient checkpointing (docs/training.md's GPU table).

    python scripts/measure_train_step.py --data runs/sim --json step3b.json

The step is train/loop.py's (the collator's dual-stream batch, `samples_loss`, backward, AdamW) under accelerate's
bf16 autocast, with the `qwen2.5-vl-3b-sasd` preset's settings; 4 steps per configuration, the first not timed.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from accelerate import Accelerator

from fastddrive.core.scaffold import Scaffold
from fastddrive.data.dataset import DrivingDataset
from fastddrive.engine.random_init import random_init_model
from fastddrive.train.collate import DualStreamCollator
from fastddrive.train.config import load_config
from fastddrive.train.loop import prepare_memory, samples_loss, step_noise
from fastddrive.train.memory_estimate import estimate_training_memory, model_shape

CONFIGURATIONS = ((True, 2), (False, 2), (True, 4))  # (gradient checkpointing, batch size)
STEPS = 4


def measure(data: str, checkpointing: bool, batch: int) -> dict[str, float | int | bool]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    config = load_config(
        "qwen2.5-vl-3b-sasd",
        init_from="random:qwen2.5-vl-3b",
        data=data,
        out="unused",
        batch_size=batch,
        gradient_checkpointing=checkpointing,
    )
    estimate = estimate_training_memory(config, model_shape(config))
    accelerator = Accelerator(mixed_precision=config.mixed_precision)
    model = random_init_model("qwen2.5-vl-3b", device="cuda", dtype=torch.float32, seed=config.seed)
    model.set_image_pixels(config.image_min_pixels, config.image_max_pixels)
    model.model.train()
    prepare_memory(model, config)
    scaffold = Scaffold(model.tokenizer, config.explanation_budget, scaffold_tokenization=config.scaffold_tokenization)
    collator = DualStreamCollator(model, scaffold, config)
    optimizer = torch.optim.AdamW([p for p in model.model.parameters() if p.requires_grad], lr=config.lr)
    model.model, optimizer = accelerator.prepare(model.model, optimizer)
    samples = list(DrivingDataset.open(data).samples("train"))
    seconds, tokens = [], 0
    for step in range(STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        batch_samples = [samples[(step * batch + k) % len(samples)] for k in range(batch)]
        with accelerator.autocast():
            parts = samples_loss(
                model, collator, batch_samples, config.block_size, step_noise(config, step, 0, batch), config
            )
        accelerator.backward(parts.total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        tokens = parts.tokens
    step_s = float(np.median(seconds[1:]))
    return {
        "checkpointing": checkpointing,
        "batch": batch,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "estimate_gib": estimate.per_rank_bytes / 2**30,
        "step_s_median": step_s,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a dataset folder (fastddrive data highway)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = []
    for checkpointing, batch in CONFIGURATIONS:
        rows.append(measure(args.data, checkpointing, batch))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
