"""What a training run holds per process, estimated before it starts (issue 36).

Per process: the parameters (float32 master weights, plus the bf16 copies autocast keeps while a step runs; or
bf16 weights alone), their gradients (in the weights' dtype) and AdamW's two float32 moments (of the trainable
parameters), divided by the processes when they are sharded (FSDP full shard, which also holds the parameters
outside the decoder layers and vision blocks gathered whole while a step runs); and per sample of the batch,
the logits (bf16 or float32, their float32 copy in the cross-entropy and its gradient, at every position of
the packed sequence) and the activations the backward pass keeps: per decoder layer about 10 hidden-size and 4
intermediate-size values a position and the attention scores (heads x positions a position), or with gradient
checkpointing one hidden-size value a layer plus one layer's full set. A sample's positions are its image
tokens (28 x 28 pixels each), its prompt text and its answer once per stream (SASD: the clean stream and two
noisy copies).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageTextToText

from fastddrive.core.tokenizer import default_tokenizer_path, load_tokenizer
from fastddrive.engine.model_check import meta_model, read_json_object
from fastddrive.engine.model_files import model_path, tiny_qwen2_5_vl
from fastddrive.engine.random_init import architecture_config
from fastddrive.train.config import TrainConfig

PROMPT_TEXT_TOKENS = 320  # the chat prompt's text around the images (fastddrive's: about 300 tokens)
ANSWER_SCAFFOLD_TOKENS = 240  # an answer's positions besides its explanation budget (Qwen vocabulary, pieces)
IMAGE_TOKEN_PIXELS = 28 * 28
HIDDEN_VALUES_PER_LAYER = 10  # a decoder layer's saved values per position, in hidden sizes (norms, q/k/v, o, ...)
INTERMEDIATE_VALUES_PER_LAYER = 4  # and in intermediate sizes (gate, up, the activation, their product)


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: its parameters (all, and those trained) and its text sizes."""

    parameters: int
    trainable: int
    outside_blocks: int  # parameters outside the decoder layers and vision blocks (FSDP's root unit)
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per process of one training run (module doc), and the device's memory to compare with."""

    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_per_sample_bytes: int
    logits_per_sample_bytes: int
    batch_bytes: int
    per_rank_bytes: int
    processes: int
    sharded: bool
    positions_per_sample: int
    model_parameters: int
    trainable_parameters: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        gib = 2**30
        return (
            f"memory estimate per process: {self.per_rank_bytes / gib:.2f} GiB = parameters "
            f"{self.parameters_bytes / gib:.2f} + gradients {self.gradients_bytes / gib:.2f} + optimizer "
            f"{self.optimizer_bytes / gib:.2f} + batch {self.batch_bytes / gib:.2f} (per sample: logits "
            f"{self.logits_per_sample_bytes / gib:.2f}, activations {self.activations_per_sample_bytes / gib:.2f}; "
            f"{self.positions_per_sample} positions); {self.model_parameters:,} parameters, "
            f"{self.trainable_parameters:,} trained, {self.processes} process(es)"
            + (", sharded" if self.sharded else "")
        )


def model_shape(config: TrainConfig) -> ModelShape:
    """The shape of the model a run starts from, built on the meta device (no weights are read or made)."""
    with torch.random.fork_rng(devices=[]):
        model = _meta_start(config)
    parameters = sum(p.numel() for p in model.parameters())
    visual = getattr(getattr(model, "model", None), "visual", None)
    frozen = sum(p.numel() for p in visual.parameters()) if config.freeze_vision and visual is not None else 0
    text = model.config.get_text_config()
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    in_blocks = sum(p.numel() for m in model.modules() if type(m).__name__ in blocks for p in m.parameters())
    return ModelShape(
        parameters,
        parameters - frozen,
        parameters - in_blocks,
        text.vocab_size,
        text.hidden_size,
        text.intermediate_size,
        text.num_hidden_layers,
        text.num_attention_heads,
    )


def _meta_start(config: TrainConfig) -> torch.nn.Module:
    """The starting model on the meta device: a shipped architecture, the scratch model, or a folder's config."""
    if config.init_from.startswith("random:"):
        architecture = architecture_config(config.init_from.split(":", 1)[1], config.random_shrink)
        with torch.device("meta"):
            return AutoModelForImageTextToText.from_config(architecture)
    if config.init_from == "scratch":
        tokenizer = load_tokenizer(default_tokenizer_path())
        with torch.device("meta"):
            return tiny_qwen2_5_vl(tokenizer, **config.architecture.model_dump(), seed=config.seed)
    name = config.init_from.split(":", 1)[1] if config.init_from.startswith("embedded:") else config.init_from
    file = Path(model_path(name)) / "config.json"
    return meta_model(read_json_object(file), file)


def estimate_training_memory(
    config: TrainConfig, shape: ModelShape, processes: int = 1, sharded: bool = False
) -> MemoryEstimate:
    """The bytes one process holds (module doc) for `config` on a model of `shape`."""
    share = processes if sharded else 1
    bf16 = config.mixed_precision == "bf16"
    activation = 2 if bf16 else 4
    if config.weights_dtype == "bfloat16":
        weight, parameters = 2, 2 * shape.parameters // share
    else:
        weight, parameters = 4, 4 * shape.parameters // share + (2 * shape.parameters // share if bf16 else 0)
    if sharded:
        parameters += weight * shape.outside_blocks * (processes - 1) // processes
    gradients = weight * shape.trainable // share
    optimizer = 8 * shape.trainable // share
    streams = {"ar": 1, "sasd": 3, "jf": 2}[config.recipe]
    answer = config.explanation_budget + ANSWER_SCAFFOLD_TOKENS
    positions = config.image_max_pixels // IMAGE_TOKEN_PIXELS + PROMPT_TEXT_TOKENS + streams * answer
    logits = positions * shape.vocab * (activation + 8)
    per_position = HIDDEN_VALUES_PER_LAYER * shape.hidden + INTERMEDIATE_VALUES_PER_LAYER * shape.intermediate
    full_layer = positions * (per_position + shape.heads * positions) * activation
    if config.gradient_checkpointing:
        activations = shape.layers * positions * shape.hidden * activation + full_layer
    else:
        activations = shape.layers * full_layer
    samples = config.batch_size * (2 if config.labelled_ar_weight else 1)
    batch = samples * (logits + activations)
    return MemoryEstimate(
        parameters,
        gradients,
        optimizer,
        activations,
        logits,
        batch,
        parameters + gradients + optimizer + batch,
        processes,
        sharded,
        positions,
        shape.parameters,
        shape.trainable,
    )
