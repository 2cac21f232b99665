import numpy as np
import pytest
import torch

from fastddrive.core.scaffold import Scaffold
from fastddrive.engine.masks import additive_mask, block_mask
from fastddrive.train.collate import DualStreamCollator
from fastddrive.train.config import load_config
from model_fixtures import synthetic_sample, text_model, vision_model

TOLERANCE = 2e-4


@pytest.fixture(scope="module", params=["qwen2.5-vl", "qwen2"])
def model(request):
    return vision_model() if request.param == "qwen2.5-vl" else text_model()


def _batch(model, block_size, seeds=(0, 1)):
    config = load_config("tiny-sasd", block_size=max(block_size, 2))
    collator = DualStreamCollator(model, Scaffold(model.tokenizer), config)
    examples = [collator.example(synthetic_sample(s)) for s in seeds]
    return collator, examples, collator(examples, block_size, np.random.default_rng(0))


@pytest.mark.parametrize("block_size", [4, 8, 32])
def test_packed_noisy_blocks_equal_separate_drafts(model, block_size):
    collator, examples, batch = _batch(model, block_size)
    with torch.no_grad():
        noisy, _ = model.dual_stream_logits(**batch.forward_inputs())
    checked = 0
    for b, example in enumerate(examples):
        start = int(batch.response_start[b])
        for copy in range(batch.noisy_ids.shape[1]):
            for block in collator.scaffold.blocks(block_size):
                prompt = example.prompt
                prefix = batch.clean_ids[b, : start + block.start][None]
                _, cache = model.prefill(type(prompt)(prefix, prompt.pixel_values, prompt.image_grid_thw))
                separate = model.draft(cache, batch.noisy_ids[b, copy, block.start : block.end])
                packed = noisy[b, copy, block.start : block.end]
                assert torch.allclose(packed, separate, atol=TOLERANCE), (b, copy, block)
                checked += 1
    assert checked == 2 * 2 * len(collator.scaffold.blocks(block_size))


def test_packed_clean_stream_equals_a_plain_causal_forward(model):
    _, examples, batch = _batch(model, 8)
    with torch.no_grad():
        _, clean = model.dual_stream_logits(**batch.forward_inputs())
        for b, example in enumerate(examples):
            n = int(batch.clean_lengths[b])
            ids = batch.clean_ids[b, :n][None]
            positions, _ = model._rope_positions(ids, example.prompt.image_grid_thw)
            kwargs = {}
            if example.prompt.pixel_values is not None:
                kwargs = {"pixel_values": example.prompt.pixel_values, "image_grid_thw": example.prompt.image_grid_thw}
            plain = model.model(input_ids=ids, position_ids=positions, **kwargs).logits[0]
            assert torch.allclose(clean[b, :n], plain, atol=TOLERANCE)


def test_masks_use_the_dtype_minimum_not_minus_infinity():
    mask = additive_mask(block_mask(3, causal_head=3)[None], torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and torch.isfinite(mask).all()
    assert (mask == torch.finfo(torch.bfloat16).min).sum() == 3  # the strict upper triangle of 3 new tokens


def test_a_draft_block_after_committed_tokens_keeps_them_causal():
    assert block_mask(4, causal_head=2).tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, True],
        [True, True, True, True],
    ]
    assert block_mask(3).all()


def test_attention_laid_out_as_cudas_kernels_return_it_gives_the_same_ids(monkeypatch):
    """CUDA's attention kernels may return (rows, heads, n, d) over the memory of (rows, n, heads, d); the layer
    stack must not assume a contiguous result (a `view` there stopped greedy AR on a GPU)."""
    from fastddrive.data.highway import episode_samples
    from fastddrive.planner import load

    scene = episode_samples("merge", 90_001, max_duration_s=9)[0]
    planner = load("default", dtype=torch.float32)
    expected = {name: planner.plan(scene, name).token_ids for name in ("ar", "ss")}
    contiguous = torch.nn.functional.scaled_dot_product_attention
    laid_out = []

    def as_cuda_lays_it_out(*args, **kwargs):
        attended = contiguous(*args, **kwargs)
        laid_out.append(attended.shape)
        return attended.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", as_cuda_lays_it_out)
    for name, ids in expected.items():
        assert planner.plan(scene, name).token_ids == ids, name
    assert laid_out
