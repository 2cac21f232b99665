"""The vision tower at fixed grids equals transformers' own, for one image, two, and grids that windows
do not divide."""

import numpy as np
import pytest
import torch
from PIL import Image

from fastddrive.engine.random_init import random_init_model
from fastddrive.engine.vision_tower import VisionTower
from model_fixtures import SHRUNK_3B


@pytest.fixture(scope="module")
def model():
    return random_init_model("qwen2.5-vl-3b", "cpu", torch.float32, shrink=SHRUNK_3B)


def _reference(model, pixels, grid):
    return torch.cat(list(model.core.model.get_image_features(pixels, grid).pooler_output))


@pytest.mark.parametrize("shapes", [[(224, 448)], [(224, 448), (112, 168)], [(308, 252)]])
def test_fixed_grid_tower_equals_the_transformers_tower(model, shapes):
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]
    processed = model.image_processor(images=[Image.fromarray(i) for i in images], return_tensors="pt")
    pixels, grid = processed["pixel_values"], processed["image_grid_thw"]
    tower = VisionTower(model.core.model.visual, model.device, graphs=False)
    with torch.no_grad():
        expected = _reference(model, pixels, grid)
        assert torch.allclose(tower(pixels, grid), expected, atol=1e-5)
    assert len(tower.layouts) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_captured_tower_replays_the_eager_one():
    from fastddrive.planner import load

    model = load("default", device="cuda", dtype=torch.float32, cuda_graphs=False).model
    visual = model.core.model.visual
    eager, graphed = VisionTower(visual, model.device, graphs=False), VisionTower(visual, model.device, graphs=True)
    processor = model.image_processor
    for seed in (0, 1):  # the second frame replays the graph captured for the first
        image = np.random.default_rng(seed).integers(0, 256, (224, 448, 3), dtype=np.uint8)
        processed = processor(images=[Image.fromarray(image)], return_tensors="pt")
        pixels, grid = processed["pixel_values"], processed["image_grid_thw"]
        assert torch.allclose(eager(pixels, grid), graphed(pixels, grid), atol=1e-5)
    assert len(graphed.captured) == 1
