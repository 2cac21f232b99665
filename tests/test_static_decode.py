"""The fixed-shape decode path (CUDA graphs on a GPU) against the eager one: same ids for every decoder,
the same logits, and fallback to eager for what does not fit its shapes."""

import pytest
import torch

from fastddrive.data.highway import episode_samples
from fastddrive.decode import DECODERS
from fastddrive.planner import load
from fastddrive.static_decode import BUCKETS, CAPACITY_STEP


@pytest.fixture(scope="module")
def scene():
    return episode_samples("merge", 90_001, max_duration_s=9)[0]


def _pair(device="cpu", graphs=False):
    eager = load("default", device=device, dtype=torch.float32, cuda_graphs=False)
    static = load("default", device=device, dtype=torch.float32, cuda_graphs=False)
    static.model.use_static_shapes(graphs=graphs)
    return eager, static


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
