"""Training batches: the clean sequence and, for SASD, two complementary noisy copies of the response.

Layout of one sample (paper 002 Fig. 3, vision-efficient concatenation): `[noisy 1 ; noisy 2 ; clean]`
where clean = prompt (with image tokens) + response, and each noisy copy holds only the response.
Blocks are the scaffold's section-aligned blocks at the active block size (so a block never runs past
the response: auto-truncation). The first token of every block stays clean (a block is seeded by one
known token, DESIGN 5), scaffold tokens are never masked, and value tokens are masked per section.

Labels are aligned with the logits that predict them (token shift): `noisy_labels[r, i]` is the token
at response offset i + 1 if that position is masked in copy r and lies in the same block, and
`clean_labels[a]` the clean token at a + 1 if it is a value token of the response (every response
token for the AR recipe). -100 elsewhere. `clean_weights[a]` is the AR loss weight of that token's
section (`ar_section_weights`), 0 where there is no label.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastddrive.core.sample import DrivingSample
from fastddrive.core.scaffold import Scaffold
from fastddrive.core.schema import SECTIONS
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs
from fastddrive.planner import scene_prompt
from fastddrive.train.config import TrainConfig
from fastddrive.train.noise import complementary_masks, section_rates

IGNORE = -100


@dataclass
class Example:
    """One sample tokenized: prompt inputs and the response ids with their roles."""

    prompt: PromptInputs
    response: np.ndarray  # response ids
    is_value: np.ndarray  # predicted positions (all positions for the AR layout)
    section: np.ndarray  # index into SECTIONS per response position


@dataclass
class Batch:
    clean_ids: torch.Tensor
    clean_lengths: torch.Tensor
    response_start: torch.Tensor
    noisy_ids: torch.Tensor
    block_start: torch.Tensor
    noisy_labels: torch.Tensor
    noisy_weights: torch.Tensor
    clean_labels: torch.Tensor
    clean_weights: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None

    def forward_inputs(self) -> dict[str, torch.Tensor | None]:
        keys = ("clean_ids", "clean_lengths", "response_start", "noisy_ids", "block_start", "pixel_values")
        return {k: getattr(self, k) for k in keys} | {"image_grid_thw": self.image_grid_thw}


class DualStreamCollator:
    """Turns driving samples into training batches for one model, scaffold and recipe."""

    def __init__(self, model: BlockDiffusionModel, scaffold: Scaffold, config: TrainConfig) -> None:
        self.model = model
        self.scaffold = scaffold
        self.config = config
        self.pad_id = model.tokenizer.pad_token_id
        self.end_id = model.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.weights = np.array([config.section_weights[s] for s in SECTIONS])
        self.ar_weights = np.array([config.ar_section_weights[s] for s in SECTIONS])

    def example(self, sample: DrivingSample) -> Example:
        prompt = scene_prompt(self.model, sample)  # the folder's prompt mode and cameras, as the planner reads them
        ids = np.asarray(self.scaffold.encode(sample.response).ids)
        if self.config.recipe == "ar":
            # The AR baseline writes the JSON freely: the same tokens without NULL padding, then <|im_end|>.
            keep = ids != self.scaffold.null_id
            ids = np.append(ids[keep], self.end_id)
            section = np.append(self.scaffold.section_index[keep], len(SECTIONS) - 1)
            return Example(prompt, ids, np.ones(len(ids), dtype=bool), section)
        return Example(prompt, ids, self.scaffold.is_value.copy(), self.scaffold.section_index.copy())

    def __call__(
        self, examples: list[Example], block_size: int, rng: np.random.Generator | list[np.random.Generator]
    ) -> Batch:
        """The dual-stream batch; `rng` draws the noise, one generator for the batch or one per example (a
        data-parallel step keys each example's by its place in the step's global batch, so that how the batch
        is split between processes changes no mask)."""
        batch = len(examples)
        prompt_lengths = [e.prompt.input_ids.shape[1] for e in examples]
        clean_lengths = [p + len(e.response) for p, e in zip(prompt_lengths, examples, strict=True)]
        lc = max(clean_lengths)
        clean_ids = torch.full((batch, lc), self.pad_id, dtype=torch.long)
        clean_labels = torch.full((batch, lc), IGNORE, dtype=torch.long)
        clean_weights = torch.zeros((batch, lc))
        copies = 2 if self.config.recipe == "sasd" else 0
        r = max(len(e.response) for e in examples)
        noisy_ids = torch.full((batch, copies, r), self.pad_id, dtype=torch.long)
        block_start = torch.full((batch, copies, r), -1, dtype=torch.long)
        noisy_labels = torch.full((batch, copies, r), IGNORE, dtype=torch.long)
        noisy_weights = torch.zeros((batch, copies, r))
        blocks = self.scaffold.blocks(block_size) if copies else []
        for b, (example, start) in enumerate(zip(examples, prompt_lengths, strict=True)):
            response = torch.as_tensor(example.response)
            n = len(response)
            clean_ids[b, :start] = example.prompt.input_ids[0]
            clean_ids[b, start : start + n] = response
            targets = np.flatnonzero(example.is_value)
            clean_labels[b, start + targets - 1] = response[targets]
            clean_weights[b, start + targets - 1] = torch.as_tensor(self.ar_weights[example.section[targets]]).float()
            if not copies:
                continue
            first_of_block = np.zeros(n, dtype=bool)
            starts = np.empty(n, dtype=np.int64)
            for block in blocks:
                first_of_block[block.start] = True
                starts[block.start : block.end] = block.start
            draw = rng[b] if isinstance(rng, list) else rng
            rate = section_rates(draw, self.config.section_noise)[example.section]
            masks = complementary_masks(example.is_value & ~first_of_block, rate, draw)
            for copy, mask in enumerate(masks):
                noisy = response.clone()
                noisy[torch.as_tensor(mask)] = self.scaffold.mask_id
                noisy_ids[b, copy, :n] = noisy
                block_start[b, copy, :n] = torch.as_tensor(starts)
                masked = np.flatnonzero(mask)  # never a block's first position, so i - 1 is in its block
                noisy_labels[b, copy, masked - 1] = response[masked]
                noisy_weights[b, copy, masked - 1] = torch.as_tensor(self.weights[example.section[masked]]).float()
        pixels = [e.prompt.pixel_values for e in examples if e.prompt.pixel_values is not None]
        grids = [e.prompt.image_grid_thw for e in examples if e.prompt.image_grid_thw is not None]
        return Batch(
            clean_ids=clean_ids,
            clean_lengths=torch.tensor(clean_lengths),
            response_start=torch.tensor(prompt_lengths),
            noisy_ids=noisy_ids,
            block_start=block_start,
            noisy_labels=noisy_labels,
            noisy_weights=noisy_weights,
            clean_labels=clean_labels,
            clean_weights=clean_weights,
            pixel_values=torch.cat(pixels) if pixels else None,
            image_grid_thw=torch.cat(grids) if grids else None,
        )
