"""The fixed-shape decode path (CUDA graphs on a GPU) against the eager one: same ids for every decoder,
the same logits, and fallback to eager for what does not fit its shapes."""

from types import SimpleNamespace

import pytest
import torch

from fastddrive.data.highway import episode_samples
from fastddrive.decode import DECODERS
from fastddrive.engine.static_decode import BUCKETS, CAPACITY_STEP
from fastddrive.eval.bench import DecoderRun, _accepted_drafts
from fastddrive.planner import load
from model_fixtures import SHRUNK_3B


@pytest.fixture(scope="module")
def scene():
    return episode_samples("merge", 90_001, max_duration_s=9)[0]


def _pair(device="cpu", graphs=False):
    eager = load("default", device=device, dtype=torch.float32, cuda_graphs=False)
    static = load("default", device=device, dtype=torch.float32, cuda_graphs=False)
    static.model.use_static_shapes(graphs=graphs)
    return eager, static


def test_the_cpu_runs_eagerly_whatever_cuda_graphs_says():
    """Fixed shapes only pay with graphs: on the CPU (`fastddrive bench` passes cuda_graphs=True by default)
    the planner keeps the eager path."""
    assert load("default", cuda_graphs=True).model.static is None
    assert load("default").model.static is None


def test_every_decoder_gives_the_same_ids_at_fixed_shapes(scene):
    eager, static = _pair()
    for name in DECODERS:
        a, b = eager.plan(scene, name), static.plan(scene, name)
        assert a.token_ids == b.token_ids and a.nfe == b.nfe, name
    assert len(static.model.static.shapes) > 1  # several buckets were used


def test_fixed_shape_logits_equal_eager_ones_and_long_forwards_fall_back(scene):
    eager, static = _pair()
    prompt = eager.prompt(scene)
    (a, cache_a), (b, cache_b) = eager.model.prefill(prompt), static.model.prefill(prompt)
    assert static.model.static.owns(cache_b) and not static.model.static.owns(cache_a)
    assert torch.allclose(a, b, atol=1e-5)
    for n in (1, 5, 33, BUCKETS[-1] + 1):  # the last one is longer than any bucket: eager
        ids = list(range(100, 100 + n))
        x, y = eager.model.verify(cache_a, ids), static.model.verify(cache_b, ids)
        assert torch.allclose(x, y, atol=1e-4), n
        assert cache_a.lengths == cache_b.lengths
    assert cache_b.capacity % CAPACITY_STEP == 0 and cache_b.capacity >= cache_b.length + BUCKETS[-1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_give_the_ids_of_the_eager_path(scene):
    eager, graphed = _pair("cuda", graphs=True)
    for name in DECODERS:
        a, b = eager.plan(scene, name), graphed.plan(scene, name)
        assert a.token_ids == b.token_ids, name
    assert all(shape.graph is not None for shape in graphed.model.static.shapes.values())
    assert graphed.model.static.capture_seconds < 60


def test_oracle_drafts_iterate_to_what_the_verifier_accepts():
    """In bfloat16 `ss` can return other ids than the `ar` ids it drafted; the oracle drafts then become the
    ids it returned, until they come back unchanged."""

    class Verifier:  # returns the drafts with every position past the second set to 7, like a rounding flip
        calls = 0

        def plan(self, scene, decoder, drafts):
            Verifier.calls += 1
            return SimpleNamespace(token_ids=drafts[:2] + [7] * (len(drafts) - 2))

    run = DecoderRun("oracle", "ss", {}, Verifier(), oracle=True)
    assert _accepted_drafts(run, None, [1, 2, 3, 4]) == [1, 2, 7, 7] and Verifier.calls == 2
    Verifier.calls = 0
    assert _accepted_drafts(run, None, [1, 2, 7]) == [1, 2, 7] and Verifier.calls == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled layer halves run on a GPU")
def test_compiled_layer_halves_equal_the_eager_ones():
    from fastddrive.engine import layer_halves

    generator = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, device="cuda") * 0.1

    heads, kv_heads, dim, size = 4, 2, 16, 64
    for tokens in (1, 5, 33):  # specialised at 1, then dynamic in the token dimension
        hidden = rand(tokens, size)
        cos, sin = rand(tokens, 1, dim), rand(tokens, 1, dim)
        qkv_width = (heads + 2 * kv_heads) * dim  # the GPU layout: q k v, RoPE's rotation in the kernel
        inputs = (hidden, rand(size, qkv_width), rand(qkv_width))
        compiled_in, compiled_rest = layer_halves.layer_halves(torch.device("cuda"))
        for a, b in zip(
            layer_halves.attention_inputs(*inputs, cos, sin, 1, heads, kv_heads, 1e-6),
            compiled_in(*inputs, cos, sin, 1, heads, kv_heads, 1e-6),
            strict=True,
        ):
            assert torch.allclose(a, b, atol=1e-5)
        rest = (hidden, rand(tokens, heads * dim), rand(heads * dim, size), rand(size, 256), rand(128, size))
        eager = layer_halves.attention_output_and_mlp(*rest, torch.nn.functional.silu, 1e-6)
        assert torch.allclose(eager, compiled_rest(*rest, torch.nn.functional.silu, 1e-6), atol=1e-5)


def test_a_prompt_longer_than_a_bucket_is_prefilled_in_chunks_as_the_eager_path_does():
    from fastddrive.engine.random_init import random_init_model
    from fastddrive.eval.roofline import sweep_prompt

    eager = random_init_model("qwen2.5-vl-3b", "cpu", torch.float32, shrink=SHRUNK_3B)
    static = random_init_model("qwen2.5-vl-3b", "cpu", torch.float32, shrink=SHRUNK_3B)
    static.use_static_shapes(graphs=False)
    prompt = sweep_prompt(eager)
    assert prompt.input_ids.shape[1] > BUCKETS[-1]  # two chunks, the image inside the first
    (a, cache_a), (b, cache_b) = eager.prefill(prompt), static.prefill(prompt)
    assert static.static.owns(cache_b) and cache_a.lengths == cache_b.lengths
    assert {key[2] for key in static.static.shapes} == {True}  # prompt chunks, not decode shapes
    assert torch.allclose(a, b, atol=1e-4)
    ids = list(range(100, 105))
    assert torch.allclose(eager.verify(cache_a, ids), static.verify(cache_b, ids), atol=1e-4)
