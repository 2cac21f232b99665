import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["SDL_VIDEODRIVER"] = "offscreen"
if "PYTEST_XDIST_WORKER" in os.environ:
    # One thread per worker process (and the processes its tests start): the workers share the cores, and
    # OpenMP threads that outnumber them spin waiting for each other.
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastddrive.core.schema import (  # noqa: E402
    COORD_LIMIT_M,
    CRITICAL_OBJECT_CLASSES,
    LATERAL_BEHAVIORS,
    LONGITUDINAL_BEHAVIORS,
    NUM_WAYPOINTS,
    DrivingResponse,
    MetaBehavior,
)
from fastddrive.core.tokenizer import default_tokenizer_path, load_tokenizer  # noqa: E402

coordinates = st.floats(min_value=-COORD_LIMIT_M, max_value=COORD_LIMIT_M, allow_nan=False)
explanations = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=300)


@st.composite
def responses(draw: st.DrawFn, explanation: st.SearchStrategy[str] = explanations) -> DrivingResponse:
    """Any valid driving response."""
    return DrivingResponse(
        critical_objects={name: draw(st.booleans()) for name in CRITICAL_OBJECT_CLASSES},
        explanation=draw(explanation),
        future_meta_behavior=MetaBehavior(
            longitudinal=draw(st.sampled_from(LONGITUDINAL_BEHAVIORS)),
            lateral=draw(st.sampled_from(LATERAL_BEHAVIORS)),
        ),
        trajectory=[(draw(coordinates), draw(coordinates)) for _ in range(NUM_WAYPOINTS)],
    )


@pytest.fixture(scope="session")
def tokenizer():
    """The tokenizer that ships inside the package."""
    return load_tokenizer(default_tokenizer_path())


@pytest.fixture(scope="module")
def embedded():
    """The embedded default planner (tiny-sasd)."""
    from fastddrive.planner import load

    return load("default")


@pytest.fixture(scope="session")
def scenes():
    """One fresh scene per scenario type (seeds far from the training episodes); read only, made once."""
    from model_fixtures import one_scene_per_scenario

    return one_scene_per_scenario(90_000)
