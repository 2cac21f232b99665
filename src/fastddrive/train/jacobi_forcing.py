"""Jacobi Forcing batches: noisy and clean blocks packed into one sequence (paper 003 section 3.1, Fig. 2a,
Appendix C).

One sample becomes `[prompt ; noisy_1 ; clean_1 ; noisy_2 ; clean_2 ; ...]`: clean block i is the
teacher's fixed point of block i, noisy block i its trajectory state chosen by the progressive noise
schedule (`progressive_noise`). Under the noise-aware causal mask (the clean-context-conditioned mask of
Fig. 2a) the prompt and the clean blocks are plain causal AR, and noisy block i sees the prompt, the
clean blocks before it and itself causally, at the rotary positions of clean block i. So one forward
gives the teacher's logits (clean blocks) and the student's (noisy blocks) for every block.

Token shift as everywhere: the logits at a position predict the next one. Noisy block i position k and
clean block i position k both predict answer position start_i + k + 1: those pairs, where that position
exists, enter the consistency loss. Every clean-stream position that predicts an answer token (the
prompt's last included) carries the AR loss, weighted by the section of the token it predicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from fastddrive.core.scaffold import Scaffold
from fastddrive.core.schema import SECTIONS, ResponseError, parse
from fastddrive.data.dataset import DrivingDataset, from_row
from fastddrive.decode.registry import free_text
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs
from fastddrive.planner import prompt_inputs
from fastddrive.train.collate import IGNORE
from fastddrive.train.config import ConfigError, TrainConfig
from fastddrive.train.progressive_noise import noisy_blocks
from fastddrive.train.trajectories import Trajectory, TrajectoryError, TrajectorySet, read_trajectories


def answer_sections(ids: Sequence[int], scaffold: Scaffold) -> np.ndarray:
    """The section (index into SECTIONS) of every token of an answer written freely in the scaffold's token
    layout (the AR recipe's): a section starts where its opening scaffold piece (its key) first appears
    after the previous one's; the stop token belongs to the last section, as in the AR recipe's batches."""
    ids = list(ids)
    sections = np.zeros(len(ids), dtype=np.int64)
    at = 0
    for k, name in enumerate(SECTIONS[1:], start=1):
        start, end = scaffold.section_spans[name]
        key = scaffold.template_ids[start : start + int(np.argmax(scaffold.is_value[start:end]))].tolist()
        found = next((j for j in range(at, len(ids) - len(key) + 1) if ids[j : j + len(key)] == key), None)
        if found is None:
            break  # an answer cut short: the rest stays in the section it was in
        sections[found:] = k
        at = found + len(key)
    return sections


def answer_parses(tokenizer: PreTrainedTokenizerBase, answer: Sequence[int]) -> bool:
    """Whether a teacher's answer, without its stop token, is a valid driving answer."""
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = list(answer[:-1]) if answer and answer[-1] == stop else list(answer)
    try:
        parse(free_text(tokenizer, ids))
    except ResponseError:
        return False
    return True


def noise_aware_mask(
    clean_index: torch.Tensor, noisy: torch.Tensor, block_start: torch.Tensor, real: torch.Tensor
) -> torch.Tensor:
    """Allowed attention (B, L, L) of packed sequences (Fig. 2a).

    Per packed token: clean_index, its position in [prompt ; answer]; noisy, whether it is in a noisy block;
    block_start, the clean index where its block starts (read for noisy tokens); real, False for padding.
    A clean token sees the clean tokens up to itself; a noisy token the clean tokens before its block and
    the noisy tokens of its block up to itself. Padding sees only itself.
    """
    query, key = clean_index[:, :, None], clean_index[:, None, :]
    causal = key <= query
    clean_key = (real & ~noisy)[:, None, :]
    before_block = ~noisy[:, :, None] | (key < block_start[:, :, None])
    own_block = noisy[:, :, None] & noisy[:, None, :] & (block_start[:, :, None] == block_start[:, None, :])
    allowed = causal & ((clean_key & before_block) | own_block) & real[:, :, None]
    return allowed | torch.eye(clean_index.shape[1], dtype=torch.bool)[None]


@dataclass
class JacobiForcingBatch:
    """Packed sequences (B, L) and what the losses read: flat indices into (B * L) of the teacher (clean)
    and student (noisy) position of each consistency pair, each pair's weight (1 / pairs of its block),
    the number of blocks with a pair, and the AR labels and their section weights per packed position."""

    input_ids: torch.Tensor
    clean_ids: torch.Tensor
    clean_index: torch.Tensor
    allowed: torch.Tensor
    labels: torch.Tensor
    label_weights: torch.Tensor
    teacher: torch.Tensor
    student: torch.Tensor
    pair_weights: torch.Tensor
    blocks: int
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None

    def forward_inputs(self) -> dict[str, torch.Tensor | None]:
        keys = ("input_ids", "clean_ids", "clean_index", "allowed", "pixel_values", "image_grid_thw")
        return {k: getattr(self, k) for k in keys}


@dataclass
class _Packed:
    """One sample's packed sequence before padding."""

    ids: list[int]
    clean_ids: list[int]
    clean_index: list[int]
    noisy: list[bool]
    block_start: list[int]
    labels: list[int]
    label_weights: list[float]
    pairs: list[tuple[int, int, float]]  # (student position, teacher position, weight)
    blocks: int


def _pack_one(
    prompt: PromptInputs, trajectory: Trajectory, window: int, weights: np.ndarray, scaffold: Scaffold
) -> _Packed:
    answer = trajectory.answer
    fixed_points = [states[-1] for states in trajectory.blocks]
    if [t for fixed in fixed_points for t in fixed] != answer:
        raise TrajectoryError(f"trajectory of sample {trajectory.sample_id}: its fixed points are not its answer")
    prompt_ids = prompt.input_ids[0].tolist()
    p = len(prompt_ids)
    answer_weights = weights[answer_sections(answer, scaffold)].tolist()

    def label(position: int) -> tuple[int, float]:
        """The AR label of the logits that predict answer `position` (none past the answer)."""
        return (answer[position], answer_weights[position]) if position < len(answer) else (IGNORE, 0.0)

    first_label, first_weight = label(0)
    packed = _Packed(
        ids=list(prompt_ids),
        clean_ids=prompt_ids + answer,
        clean_index=list(range(p)),
        noisy=[False] * p,
        block_start=[0] * p,
        labels=[IGNORE] * (p - 1) + [first_label],
        label_weights=[0.0] * (p - 1) + [first_weight],
        pairs=[],
        blocks=0,
    )
    start = 0
    for noisy, fixed in zip(noisy_blocks(trajectory.blocks, window), fixed_points, strict=True):
        n = len(fixed)
        noisy_at = len(packed.ids)
        for tokens in (noisy, fixed):
            packed.ids += tokens
            packed.clean_index += range(p + start, p + start + n)
            packed.block_start += [p + start] * n
        packed.noisy += [True] * n + [False] * n
        labels, label_weights = zip(*(label(start + k + 1) for k in range(n)), strict=True)
        packed.labels += [IGNORE] * n + list(labels)
        packed.label_weights += [0.0] * n + list(label_weights)
        predicted = [k for k in range(n) if labels[k] != IGNORE]
        packed.pairs += [(noisy_at + k, noisy_at + n + k, 1 / len(predicted)) for k in predicted]
        packed.blocks += bool(predicted)
        start += n
    return packed


def pack_batch(
    items: Sequence[tuple[PromptInputs, Trajectory]], window: int, weights: np.ndarray, scaffold: Scaffold, pad_id: int
) -> JacobiForcingBatch:
    """Pack (prompt, trajectory) pairs, right-padded to the longest; `weights`: AR loss weight per section."""
    packed = [_pack_one(prompt, trajectory, window, weights, scaffold) for prompt, trajectory in items]
    length = max(len(p.ids) for p in packed)
    clean_length = max(len(p.clean_ids) for p in packed)

    def padded(rows: list[list], fill: object, width: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([row + [fill] * (width - len(row)) for row in rows], dtype=dtype)

    clean_index = padded([p.clean_index for p in packed], 0, length, torch.long)
    real = padded([[True] * len(p.ids) for p in packed], False, length, torch.bool)
    pairs = [(b * length + s, b * length + t, w) for b, p in enumerate(packed) for s, t, w in p.pairs]
    student, teacher, pair_weights = zip(*pairs, strict=True) if pairs else ((), (), ())
    prompts = [prompt for prompt, _ in items]
    pixels = [p.pixel_values for p in prompts if p.pixel_values is not None]
    grids = [p.image_grid_thw for p in prompts if p.image_grid_thw is not None]
    return JacobiForcingBatch(
        input_ids=padded([p.ids for p in packed], pad_id, length, torch.long),
        clean_ids=padded([p.clean_ids for p in packed], pad_id, clean_length, torch.long),
        clean_index=clean_index,
        allowed=noise_aware_mask(
            clean_index,
            padded([p.noisy for p in packed], False, length, torch.bool),
            padded([p.block_start for p in packed], 0, length, torch.long),
            real,
        ),
        labels=padded([p.labels for p in packed], IGNORE, length, torch.long),
        label_weights=padded([p.label_weights for p in packed], 0.0, length, torch.float32),
        teacher=torch.tensor(teacher, dtype=torch.long),
        student=torch.tensor(student, dtype=torch.long),
        pair_weights=torch.tensor(pair_weights, dtype=torch.float32),
        blocks=sum(p.blocks for p in packed),
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.cat(grids) if grids else None,
    )


def checked_trajectories(config: TrainConfig) -> TrajectorySet:
    """The trajectories of `config.trajectories`, checked against the config before any model loads: collected
    at `jacobi_block_size`, on the samples of `config.data`."""
    collected = read_trajectories(config.trajectories)
    settings = collected.settings
    if settings.get("block_size") != config.jacobi_block_size:
        raise ConfigError(
            f"{config.trajectories} was collected at block size {settings.get('block_size')}, "
            f"not the configured jacobi_block_size {config.jacobi_block_size}"
        )
    if not isinstance(settings.get("split"), str):
        raise ConfigError(f"{config.trajectories}: its manifest names no split of the data")
    rows = DrivingDataset.open(config.data).table(settings["split"], columns=["sample_id"]).to_pylist()
    for trajectory in collected.trajectories:
        if trajectory.index >= len(rows) or rows[trajectory.index]["sample_id"] != trajectory.sample_id:
            raise ConfigError(
                f"{config.trajectories} was collected on other data than {config.data} "
                f"(sample {trajectory.index} of split {settings['split']!r} is not {trajectory.sample_id})"
            )
    return collected


class JacobiForcingCollator:
    """Training batches of the `jf` recipe: the trajectories of `config.trajectories` with their samples'
    prompts, read from the split of `config.data` they were collected on. With `config.skip_unparsed` a
    trajectory whose answer does not parse is left out (`left_out` counts them): both losses would teach
    the broken answer, and a round-2 teacher's few broken answers would be trained back into it."""

    def __init__(
        self,
        model: BlockDiffusionModel,
        scaffold: Scaffold,
        config: TrainConfig,
        collected: TrajectorySet | None = None,
    ) -> None:
        collected = collected or checked_trajectories(config)
        rows = DrivingDataset.open(config.data).table(collected.settings["split"]).to_pylist()
        self.model = model
        self.scaffold = scaffold
        self.trajectories = [
            t for t in collected.trajectories if not config.skip_unparsed or answer_parses(model.tokenizer, t.answer)
        ]
        self.left_out = len(collected.trajectories) - len(self.trajectories)
        if not self.trajectories:
            raise ConfigError(f"{config.trajectories}: no trajectory's answer parses as a driving answer")
        self.rows = rows
        self.window = config.noise_window
        self.weights = np.array([config.ar_section_weights[s] for s in SECTIONS])
        self.pad_id = model.tokenizer.pad_token_id

    def __len__(self) -> int:
        return len(self.trajectories)

    def __call__(self, picks: Sequence[int]) -> JacobiForcingBatch:
        items = []
        for pick in picks:
            trajectory = self.trajectories[pick]
            sample = from_row(self.rows[trajectory.index])
            items.append((prompt_inputs(self.model, sample.command, sample.history, [sample.image]), trajectory))
        return pack_batch(items, self.window, self.weights, self.scaffold, self.pad_id)
