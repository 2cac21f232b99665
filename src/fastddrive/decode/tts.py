"""Test-time scaling with shared-prefix trajectory rollouts (paper 000 section 3.4).

`ss` runs greedy through critical_objects, explanation and future_meta_behavior once; the cache is then
forked N times and each fork runs `ss` on the trajectory section with a sampled verifier (the draft stays
greedy). Each rollout's 5 waypoints are JMT-upsampled to 20 points at 4 Hz and the rollouts averaged.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from fastddrive.decode.meter import ForwardMeter
from fastddrive.decode.result import Decoded
from fastddrive.decode.speculative import section_blocks, speculative_steps
from fastddrive.decode.state import Canvas, sampler
from fastddrive.eval.jmt import jmt_upsample
from fastddrive.model import BlockDiffusionModel, PromptInputs
from fastddrive.scaffold import DEFAULT_BLOCK_SIZE, Scaffold
from fastddrive.schema import ResponseError

DEFAULT_ROLLOUTS = 4
WAYPOINT_ROWS = slice(3, None, 4)  # t = 1, 2, 3, 4, 5 s of the 4 Hz trajectory
DEFAULT_TEMPERATURE = 0.5


@torch.no_grad()
def trajectory_rollouts_decode(
    model: BlockDiffusionModel,
    prompt: PromptInputs,
    scaffold: Scaffold,
    *,
    rollouts: int = DEFAULT_ROLLOUTS,
    temperature: float = DEFAULT_TEMPERATURE,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
    fuse_draft: bool = True,
) -> Decoded:
    """`tts`: the token ids are the first rollout's; `extra` holds every rollout, the averaged 20-point
    trajectory (metres, 4 Hz) and the cost of the shared prefix and of each rollout (forwards, ms)."""
    if rollouts < 1:
        raise ValueError(f"rollouts must be >= 1, got {rollouts}")
    blocks = section_blocks(scaffold, block_size)
    trajectory_start = scaffold.section_spans["trajectory"][0]
    began = time.perf_counter()
    prefix = ForwardMeter()
    with prefix.watch(model.model):
        canvas = Canvas.prefill(model, prompt, scaffold)
        speculative_steps(model, canvas, blocks, scaffold_aware=True, until=trajectory_start, fuse=fuse_draft)
    prefix_ms = 1000 * (time.perf_counter() - began)

    finished: list[Canvas] = []
    rollout_ms, rollout_nfe = [], []
    for r, fork in enumerate(canvas.fork(rollouts)):
        began, meter = time.perf_counter(), ForwardMeter()
        with meter.watch(model.model):
            pick = sampler(temperature, seed + r)
            speculative_steps(model, fork, blocks, scaffold_aware=True, pick=pick, fuse=fuse_draft)
        rollout_ms.append(1000 * (time.perf_counter() - began))
        rollout_nfe.append(meter.calls)
        finished.append(fork)

    dense = []
    for fork in finished:
        try:
            dense.append(jmt_upsample(np.asarray(scaffold.decode(fork.ids).trajectory)))
        except ResponseError:
            continue  # a rollout that does not parse does not vote
    mean = np.mean(dense, axis=0) if dense else None
    first = finished[0]
    return Decoded(
        first.ids,
        canvas.accepted_per_step + first.accepted_per_step,
        {
            "rollouts": [f.ids for f in finished],
            "valid_rollouts": len(dense),
            "mean_trajectory_m": mean.tolist() if mean is not None else None,
            "prefix_nfe": prefix.calls,
            "rollout_nfe": rollout_nfe,
            "prefix_ms": prefix_ms,
            "rollout_ms": rollout_ms,
        },
        waypoints_m=mean[WAYPOINT_ROWS].tolist() if mean is not None else None,
    )
