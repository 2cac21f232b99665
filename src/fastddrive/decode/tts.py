"""Test-time scaling with shared-prefix trajectory rollouts (paper 000 section 3.4).

`ss` runs greedy through critical_objects, explanation and future_meta_behavior once. The cache is then
forked into N rows of one batched cache, and the N rollouts decode the trajectory section together,
one forward per step for all of them, each with its own sampled verifier. Each rollout's 5 waypoints
are JMT-upsampled to 20 points at 4 Hz and the rollouts averaged; the answer is the shared prefix with
the averaged trajectory written into the scaffold.

How the rollouts get their samples is a matter of cost only. The sampler draws one uniform per position
from the rollout's seed (`state.Sampler`), so the token at a position is the same exact AR sample
whichever forward computed its logits. By default the rollouts verify guessed windows in lockstep
(`lockstep.lockstep_rollouts`): the rows stay at one length, and most trajectory digits are accepted
from a Jacobi update, so the four rollouts take far fewer forwards than one per value. With
`rollout_drafts` each rollout continues Scaffold Spec on its own, as the paper describes: a greedy MDM
draft that the sampled verifier accepts up to its first disagreement, the rows at their own lengths.
Both give the same ids.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from fastddrive.core.jmt import jmt_upsample
from fastddrive.core.scaffold import DEFAULT_BLOCK_SIZE, Scaffold
from fastddrive.core.schema import DrivingResponse, ResponseError
from fastddrive.decode.blocks import section_blocks
from fastddrive.decode.lockstep import DEFAULT_WINDOW, lockstep_rollouts
from fastddrive.decode.meter import ForwardMeter, synchronize
from fastddrive.decode.result import Decoded
from fastddrive.decode.speculative import Speculation, run, run_rows
from fastddrive.decode.state import Canvas, row_picker, sampler
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs

DEFAULT_ROLLOUTS = 4
WAYPOINT_ROWS = slice(3, None, 4)  # t = 1, 2, 3, 4, 5 s of the 4 Hz trajectory
DEFAULT_TEMPERATURE = 0.5


def fork_rollouts(model: BlockDiffusionModel, canvas: Canvas, rollouts: int) -> list[Canvas]:
    """`rollouts` canvases continuing `canvas`, each owning one row of one batched copy of its cache."""
    cache = model.fork(canvas.cache, rollouts)
    return [
        Canvas(
            canvas.scaffold,
            cache,
            canvas.prompt_length,
            list(canvas.ids),
            canvas.committed,
            canvas.cached,
            canvas.next_logits,
            row=r,
        )
        for r in range(rollouts)
    ]


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
    rollout_drafts: bool = False,
    rollout_window: int = DEFAULT_WINDOW,
) -> Decoded:
    """`tts`: the ids are the shared prefix and the averaged trajectory. `extra` holds every rollout's ids,
    the averaged 20-point trajectory (metres, 4 Hz) and the cost of the shared prefix and of the batched
    rollouts (forwards, ms). Rollout r samples with seed + r; the rollouts verify windows of
    `rollout_window` guessed positions in lockstep, or each continues Scaffold Spec if `rollout_drafts`
    (module doc)."""
    if rollouts < 1:
        raise ValueError(f"rollouts must be >= 1, got {rollouts}")
    blocks = section_blocks(scaffold, block_size)
    trajectory_start = scaffold.section_spans["trajectory"][0]
    began, prefix = time.perf_counter(), ForwardMeter()
    with prefix.watch(model):
        canvas = Canvas.prefill(model, prompt, scaffold)
        shared = Speculation(
            canvas, blocks, True, until=trajectory_start, fuse=fuse_draft, draft_past_until=rollout_drafts
        )
        run(model, shared)
    synchronize(model.device)
    prefix_ms = 1000 * (time.perf_counter() - began)

    began, batched = time.perf_counter(), ForwardMeter()
    forks = fork_rollouts(model, canvas, rollouts)
    seeds = [seed + r for r in range(rollouts)]
    with batched.watch(model):
        if rollout_drafts:  # each starts from the first trajectory block's draft, if the last shared verify made one
            picks = [sampler(temperature, s, len(scaffold)) for s in seeds]
            speculations = [
                Speculation(fork, blocks, True, pick, None, fuse_draft, shared.drafted)
                for pick, fork in zip(picks, forks, strict=True)
            ]
            run_rows(model, forks[0].cache, speculations)
        else:
            lockstep_rollouts(model, forks, row_picker(temperature, seeds, len(scaffold)), rollout_window)
    synchronize(model.device)
    rollouts_ms = 1000 * (time.perf_counter() - began)

    answers, dense = [], []
    for fork in forks:
        try:
            answers.append(scaffold.decode(fork.ids))
        except ResponseError:
            continue  # a rollout that does not parse does not vote
        dense.append(jmt_upsample(np.asarray(answers[-1].trajectory)))
    mean = np.mean(dense, axis=0) if dense else None
    ids = forks[0].ids
    if mean is not None:
        averaged = DrivingResponse.model_validate(
            answers[0].model_dump() | {"trajectory": mean[WAYPOINT_ROWS].tolist()}
        )
        ids = canvas.ids[:trajectory_start] + scaffold.encode(averaged).ids[trajectory_start:]
    return Decoded(
        ids,
        canvas.accepted_per_step + forks[0].accepted_per_step,
        {
            "rollouts": [f.ids for f in forks],
            "valid_rollouts": len(dense),
            "mean_trajectory_m": mean.tolist() if mean is not None else None,
            "prefix_nfe": prefix.calls,
            "rollout_nfe": batched.calls,
            "rollout_steps": [len(f.accepted_per_step) for f in forks],
            "prefix_ms": prefix_ms,
            "rollouts_ms": rollouts_ms,
        },
    )
