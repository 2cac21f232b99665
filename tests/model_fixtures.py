"""Tiny random models, synthetic samples and simulator scenes for model and training tests."""

import numpy as np
from transformers import Qwen2Config, Qwen2ForCausalLM

from fastddrive.core.sample import CameraView, DrivingSample
from fastddrive.core.schema import CRITICAL_OBJECT_CLASSES, DrivingResponse, MetaBehavior
from fastddrive.core.tokenizer import default_tokenizer_path, load_tokenizer
from fastddrive.engine.model import BlockDiffusionModel
from fastddrive.engine.model_files import tiny_image_processor, tiny_qwen2_5_vl

# The smallest Qwen2.5-VL architecture the tests build and train (tiny_qwen2_5_vl's keywords).
SMALL = {
    "hidden_size": 64,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "intermediate_size": 128,
    "vision_hidden_size": 32,
    "vision_depth": 2,
    "vision_heads": 2,
}


def vision_model(seed: int = 0) -> BlockDiffusionModel:
    tokenizer = load_tokenizer(default_tokenizer_path())
    model = tiny_qwen2_5_vl(tokenizer, **SMALL, seed=seed)
    return BlockDiffusionModel(model.eval(), tokenizer, tiny_image_processor())


def text_model(seed: int = 0) -> BlockDiffusionModel:
    import torch

    tokenizer = load_tokenizer(default_tokenizer_path())
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    return BlockDiffusionModel(Qwen2ForCausalLM(config).eval(), tokenizer)


def one_scene_per_scenario(first_seed: int) -> list[DrivingSample]:
    """One fresh scene per scenario type, episode `first_seed + k` of the k-th: the first second of a default
    scenario's 9 s, the first after the staged event of a reactive one's (which runs its whole 12 s for it)."""
    from fastddrive.data.highway import DEFAULT_SCENARIOS, SCENARIOS, episode_samples

    return [
        episode_samples(name, first_seed + k, max_duration_s=9 if name in DEFAULT_SCENARIOS else None)[0]
        for k, name in enumerate(SCENARIOS)
    ]


def synthetic_sample(seed: int = 0) -> DrivingSample:
    rng = np.random.default_rng(seed)
    speed = rng.uniform(5, 30)
    t = np.arange(1, 21) * 0.25
    future = np.stack([speed * t, rng.uniform(-0.5, 0.5) * t], axis=1)
    history = np.zeros((7, 6))
    history[:, 0] = -speed * np.arange(6, -1, -1) * 0.5
    history[:, 2] = speed
    response = DrivingResponse(
        critical_objects={c: bool(rng.random() < 0.3) for c in CRITICAL_OBJECT_CLASSES},
        explanation=["The road ahead is clear; I keep my lane and speed.", "I slow down for the car ahead."][seed % 2],
        future_meta_behavior=MetaBehavior(longitudinal=["keep", "decelerate"][seed % 2], lateral="straight"),
        trajectory=future[3::4],
    )
    return DrivingSample(
        sample_id=f"synthetic-{seed}",
        scenario="highway",
        episode_seed=seed,
        time_s=3.0,
        image=rng.integers(0, 255, (224, 448, 3), dtype=np.uint8),
        history=history,
        command="go_straight",
        future=future,
        future_time_s=t,
        response=response,
        view=CameraView(5.5, (134.4, 112.0), 0.0),
    )


WEIGHT_SCALE = 10.0  # untrained tiny models at their initial scale write one token everywhere


def peaky_case(kind: str, seed: int):
    """A random Qwen2 or Qwen2.5-VL model in float64 whose weights are scaled so that greedy outputs vary
    with the context, a prompt of a synthetic sample, and the scaffold."""
    import torch

    from fastddrive.core.scaffold import Scaffold
    from fastddrive.planner import prompt_inputs

    # float64: near-equal logits must not order differently in a one-token and a block forward.
    model = (vision_model if kind == "qwen2.5-vl" else text_model)(seed=seed)
    model.model.double()
    with torch.no_grad():
        for name, parameter in model.model.named_parameters():
            if "norm" not in name and "visual" not in name:
                parameter.mul_(WEIGHT_SCALE)  # peaky logits, so that greedy outputs vary with the context
    sample = synthetic_sample(seed)
    prompt = prompt_inputs(model, sample.command, sample.history, [sample.image])
    return model, prompt, Scaffold(model.tokenizer)


# The 3B preset at CPU-test sizes, with window blocks and full-attention blocks both present.
SHRUNK_3B = {
    "hidden_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "intermediate_size": 256,
    "vocab_size": 1024,
    "vision_config": {
        "depth": 4,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "fullatt_block_indexes": [1, 3],
    },
}


class Oracle:
    """Drafts equal to `ar`'s own tokens, each corrupted (replaced by another token) with probability `rate`
    (decided once per position)."""

    def __init__(self, reference: list[int], rate: float, vocab: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        corrupt = rng.random(len(reference)) < rate
        self.tokens = [
            (t + 1 + int(rng.integers(vocab - 1))) % vocab if c else t for t, c in zip(reference, corrupt, strict=True)
        ]
        self.corrupted = int(corrupt.sum())

    def propose(self, proposal, logits, row_of_first, first, canvas):
        import torch

        masked = [i for i, token in enumerate(proposal) if token == canvas.scaffold.mask_id]
        return masked, torch.tensor([self.tokens[first + i] for i in masked], dtype=torch.long, device=logits.device)

    def read_groups(self, real):
        def read(logits, base, canvas):
            verified, proposals = real(logits, base, canvas)
            b, length = logits.shape[0], len(canvas)
            oracle = [[self.tokens[min(base + 1 + g + j, length - 1)] for j in range(1, b)] for g in range(b)]
            return verified, oracle

        return read


def with_oracle(monkeypatch, reference, rate, vocab):
    """`ss`'s and `selfspec`'s drafts (and `selfspec-quad`'s groups) replaced by an Oracle's."""
    from fastddrive.decode import quadratic, speculative

    oracle = Oracle(reference, rate, vocab)
    monkeypatch.setattr(speculative, "propose", oracle.propose)
    monkeypatch.setattr(quadratic, "_read_groups", oracle.read_groups(quadratic._read_groups))
    return oracle
