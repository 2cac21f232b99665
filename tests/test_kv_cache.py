"""The decode engine against plain transformers: the preallocated cache, its crops and forks, and the
masks sliced from buffers give the logits of an uncached transformers forward (float64)."""

import pytest
import torch

from fastddrive.engine.kv_cache import KVCache
from fastddrive.engine.masks import CAUSAL, FULL, DecodeMasks, additive_mask, block_mask
from model_fixtures import synthetic_sample, text_model, vision_model

EXACT = 1e-6  # float64, but transformers computes RMSNorm in float32 whatever the model dtype


@pytest.fixture(scope="module", params=["qwen2.5-vl", "qwen2"])
def model(request):
    model = vision_model(seed=4) if request.param == "qwen2.5-vl" else text_model(seed=4)
    model.model.double()
    return model


def _prompt(model):
    sample = synthetic_sample(3)
    images = [sample.image] if model.is_vision else []
    text = "<|im_start|>user\n" + ("<|vision_start|><|image_pad|><|vision_end|>" if images else "") + "Go.<|im_end|>"
    return model.encode_prompt(text, images)


def plain_logits(model, prompt, new_ids, allowed=None, offsets=None):
    """Logits of `new_ids` after the prompt from one uncached transformers forward: the prompt causal, each
    new token seeing the whole prompt and the new tokens `allowed` (causal by default), new token j at
    the position of new token offsets[j] (default j)."""
    new = torch.as_tensor(new_ids, dtype=torch.long).reshape(1, -1)
    p, n = prompt.input_ids.shape[1], new.shape[1]
    ids = torch.cat([prompt.input_ids, new], dim=1)
    positions, _ = model._rope_positions(ids, prompt.image_grid_thw)
    if offsets is not None:
        positions = positions.clone()
        positions[..., p:] = positions[..., p : p + 1] + torch.as_tensor(offsets)
    full = block_mask(p + n, p + n).clone()
    full[p:, p:] = block_mask(n, n) if allowed is None else allowed
    kwargs = {}
    if prompt.pixel_values is not None:
        kwargs = {"pixel_values": prompt.pixel_values, "image_grid_thw": prompt.image_grid_thw}
    with torch.no_grad():
        out = model.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=additive_mask(full[None], model.dtype),
            use_cache=False,
            **kwargs,
        )
    return out.logits[0, p - 1 :]  # row 0 predicts the first new token


def test_prefill_equals_the_plain_forward(model):
    prompt = _prompt(model)
    logits, cache = model.prefill(prompt)
    assert cache.length == prompt.input_ids.shape[1]
    assert torch.allclose(logits, plain_logits(model, prompt, [])[0], atol=EXACT)


@pytest.mark.parametrize("rotation_columns", [True, False])
def test_both_weight_layouts_equal_the_plain_forward(model, rotation_columns):
    """RoPE's rotate_half as extra qkv columns (the CPU layout) or computed in the layer (the GPU one)."""
    from fastddrive.engine.model import DecodeWeights

    prompt = _prompt(model)
    version = model._refresh_weights().version
    model.decode_weights = DecodeWeights.of(model.text_model, model.core.lm_head, version, rotation_columns)
    try:
        heads, kv_heads, dim = model.decode_weights.heads, model.decode_weights.kv_heads, model.decode_weights.head_dim
        columns = (heads + 2 * kv_heads + (heads + kv_heads) * rotation_columns) * dim
        assert model.decode_weights.layers[0].qkv.shape[1] == columns
        logits, cache = model.prefill(prompt)
        assert model.decode_weights.layers[0].qkv.shape[1] == columns  # the prefill kept this layout
        new = [40, 9, 11]
        plain = plain_logits(model, prompt, new)
        assert torch.allclose(logits, plain[0], atol=EXACT)
        assert torch.allclose(model.verify(cache, new), plain[1:], atol=EXACT)
    finally:
        model.decode_weights = None


def test_verify_draft_and_crop_equal_the_plain_forward(model):
    prompt = _prompt(model)
    _, cache = model.prefill(prompt)
    start = cache.length
    verified = model.verify(cache, [200, 201, 202])
    assert torch.allclose(verified, plain_logits(model, prompt, [200, 201, 202])[1:], atol=EXACT)
    assert cache.length == start + 3
    # A draft after the cached tokens: bidirectional, with the two uncached committed tokens causal.
    drafted = model.draft(cache, [203, 204, 105, 106, 107], causal_head=2)
    pattern = block_mask(5, 2)
    expected = plain_logits(model, prompt, [200, 201, 202, 203, 204, 105, 106, 107], _after(3, pattern))[4:]
    assert torch.allclose(drafted, expected, atol=EXACT)
    assert cache.length == start + 3  # the draft left nothing behind
    cache.crop(start + 1)
    again = model.verify(cache, [300, 301])
    assert torch.allclose(again, plain_logits(model, prompt, [200, 300, 301])[2:], atol=EXACT)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(cache.length + 1)


def _after(cached, pattern):
    """Causal among `cached` tokens, then `pattern` for the rest, which see all of them."""
    n = cached + pattern.shape[0]
    allowed = block_mask(n, n).clone()
    allowed[cached:, cached:] = pattern
    return allowed


def test_forked_rows_at_different_lengths_equal_the_plain_forward(model):
    prompt = _prompt(model)
    _, cache = model.prefill(prompt)
    rows = cache.fork(3)
    assert rows.rows == 3 and rows.lengths == [cache.length] * 3
    rows.crop(cache.length, row=0)
    model.forward(rows, [[110, 111], [112, 113], [114, 115]], keep=[0, 2, 1])  # rows now 0, 2 and 1 tokens longer
    assert rows.lengths == [cache.length, cache.length + 2, cache.length + 1]
    patterns = [block_mask(3, 3), block_mask(3, 0), block_mask(3, 1)]
    logits = model.forward(rows, [[120, 121, 122], [123, 124, 125], [126, 127, 128]], patterns)
    expected = [
        plain_logits(model, prompt, [120, 121, 122])[1:],
        plain_logits(model, prompt, [112, 113, 123, 124, 125], _after(2, block_mask(3, 0)))[3:],
        plain_logits(model, prompt, [114, 126, 127, 128], _after(1, block_mask(3, 1)))[2:],
    ]
    for row in range(3):
        assert torch.allclose(logits[row], expected[row], atol=EXACT), row
    # the source cache is untouched by its fork
    assert torch.allclose(model.verify(cache, [120]), plain_logits(model, prompt, [120])[1:], atol=EXACT)


def test_keep_and_growth_beyond_the_preallocated_room(model):
    """A tree-shaped forward (paper 002 Alg. 2) keeps some of its tokens; what follows sees only those,
    at the kept tokens' own positions, and the cache grows past its preallocated room."""
    prompt = _prompt(model)
    _, cache = model.prefill(prompt, room=2)
    start = cache.length
    model.forward(cache, [130, 131, 132, 133], FULL)  # past the room: the cache grows
    cache.keep(start, [0, 2])
    assert cache.length == start + 2
    ids = list(range(140, 140 + 300))
    logits = model.verify(cache, ids)
    allowed = block_mask(304, 304).clone()
    allowed[:4, :4] = True
    allowed[4:, [1, 3]] = False  # 31 and 33 were dropped
    offsets = [0, 1, 2, 3, *range(2, 2 + len(ids))]  # the ids follow the two kept tokens
    expected = plain_logits(model, prompt, [130, 131, 132, 133, *ids], allowed, offsets)[5:]
    assert torch.allclose(logits, expected, atol=EXACT)
    assert cache.capacity >= start + 302


def test_masks_are_sliced_from_one_buffer_per_pattern():
    masks = DecodeMasks("cpu")
    assert masks.mask([50], 1, CAUSAL) == (None, False)  # one token: no mask
    assert masks.mask([0], 7, CAUSAL) == (None, True)  # prefill: the kernel's causal attention
    assert masks.mask([50], 7, FULL) == (None, False)
    mask, causal = masks.mask([50], 4, CAUSAL)
    assert not causal and mask.shape == (4, 54) and mask.dtype == torch.float32  # additive: 0 where allowed
    allowed = mask == 0
    assert allowed[:, :50].all() and torch.equal(allowed[:, 50:], block_mask(4, 4))
    assert (mask[~allowed] == torch.finfo(torch.float32).min).all()
    again, _ = masks.mask([80], 4, CAUSAL)
    assert again.untyped_storage().data_ptr() == mask.untyped_storage().data_ptr()  # the same buffer
    allowed = again == 0
    assert again.shape == (4, 84) and allowed[:, :80].all() and torch.equal(allowed[:, 80:], block_mask(4, 4))
    rows, _ = masks.mask([3, 5], 2, FULL)
    assert rows.shape == (2, 1, 2, 7)
    assert (rows[0, 0, :, :5] == 0).all() and not (rows[0, 0, :, 5:] == 0).any()
    assert (rows[1, 0] == 0).all()
    assert DecodeMasks("cpu", torch.float64).mask([50], 4, CAUSAL)[0].dtype == torch.float64


def test_cache_refuses_what_it_cannot_do():
    cache = KVCache(layers=1, kv_heads=1, head_dim=2, capacity=4, dtype=torch.float32, device="cpu", rows=2)
    cache.advance([1, 2])
    with pytest.raises(ValueError, match="different lengths"):
        _ = cache.length
    with pytest.raises(ValueError, match="single-row"):
        cache.fork(2)
