"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis, issue 32): requests made from the schema, valid
and not, sent to a server on loopback over a fake planner (the model is not what is fuzzed here), with its
limits and an API key. No answer is a 5xx or a status the schema does not document, and every answer has
the documented media type and shape. Bounded: a fixed number of examples per operation, derandomized."""

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from fastddrive.decode.planning_vocabulary import vocabulary_path
from fastddrive.engine.model_files import model_path
from fastddrive.serve.app import create_app
from fastddrive.serve.limits import ServiceLimits
from serve_fakes import FakePlanner, running

KEY = {"Authorization": "Bearer fuzzing"}
LIMITS = ServiceLimits(max_body_bytes=512 * 1024, max_images=4, max_image_pixels=448 * 448)


@pytest.fixture(scope="module")
def served():
    app = create_app(
        FakePlanner, "ss", max_queue=8, timeout_s=60, limits=LIMITS, api_key="fuzzing",
        pvf_vocabulary=vocabulary_path(model_path("default")),
    )  # fmt: skip
    with running(app, headers=KEY) as base:
        yield base


@pytest.fixture(scope="module")
def api(served):
    return schemathesis.openapi.from_url(served + "/openapi.json", headers=KEY)


OPERATIONS = [
    ("POST", "/v1/plan"),
    ("POST", "/v1/plan/form"),
    ("GET", "/v1/scenes"),
    ("GET", "/v1/scenes/{split}/{index}"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
]


def test_the_operations_fuzzed_are_all_the_schema_has(api):
    assert sorted((op.ok().method.upper(), op.ok().path) for op in api.get_all_operations()) == sorted(OPERATIONS)


# Requests that break the schema too, where an operation takes anything (the others take no input to break).
CASES = [(*op, GenerationMode.POSITIVE) for op in OPERATIONS] + [
    (*op, GenerationMode.NEGATIVE) for op in OPERATIONS if op[0] == "POST" or "{" in op[1]
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=lambda v: getattr(v, "value", v))
def test_every_answer_is_documented_and_none_is_a_server_error(api, served, method, path, mode):
    statuses = set()

    @given(case=api[path][method].as_strategy(mode))  # valid requests, and requests that break the schema
    @settings(
        max_examples=100 if method == "POST" else 10,
        deadline=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case):
        response = case.call(base_url=served, headers=KEY, timeout=60)
        statuses.add(response.status_code)
        case.validate_response(
            response,
            checks=[not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance],
        )

    fuzz()
    if path == "/v1/plan" and mode is GenerationMode.POSITIVE:  # it reached both the planner and the refusals
        assert {200, 422} <= statuses, statuses
