"""The embedded default checkpoints load through the same code as any local folder and answer validly."""

import numpy as np
import pytest

from fastddrive.core.scaffold import Scaffold
from fastddrive.data.highway import episode_samples
from fastddrive.engine.model_files import load_model, model_path
from fastddrive.eval.accuracy import greedy_ar_response

MAX_CHECKPOINT_BYTES = 25 * 1024 * 1024


@pytest.fixture(scope="module")
def scene():
    return episode_samples("merge", 4242, max_duration_s=9)[0]


@pytest.mark.parametrize(("name", "kind"), [("default", "block-diffusion"), ("default-ar", "autoregressive")])
def test_embedded_checkpoint_loads_and_answers(name, kind, scene):
    path = model_path(name)
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size <= MAX_CHECKPOINT_BYTES
    assert not list(path.glob("*.bin")) and (path / "model.safetensors").is_file()
    model = load_model(path)
    assert model.info.kind == kind and model.is_vision
    scaffold = Scaffold(model.tokenizer, explanation_budget=model.info.explanation_budget)
    response, ids = greedy_ar_response(model, scaffold, scene)
    assert response is not None, model.tokenizer.decode(ids)
    assert np.isfinite(np.asarray(response.trajectory)).all()
    assert response.trajectory[-1][0] > 0  # it drives forwards
