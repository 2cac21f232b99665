"""The HTTP planning service: routes over one model worker (FastAPI, served by uvicorn).

POST /v1/plan (JSON) and /v1/plan/form (the page's multipart form) answer what `fastddrive plan --json`
prints; GET /healthz, /readyz, /metrics (Prometheus), /docs (OpenAPI), / (the page) and /v1/scenes (the scenes
of a data folder, for the page). A full queue is a 503 with Retry-After, a request past its time a 504.

Closed and bounded (issue 32): an optional API key on every route but the probes /healthz and /readyz
(`guards.BearerKey`), bodies bounded in size and time (`guards.BodyLimit`: 413, 408), and a plan request read,
parsed, decoded and checked on a thread against the library and the service's limits (`schemas`), so that the
event loop keeps answering while a large body is refused. A request names no file: the planning vocabulary is
the server's.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import signal
import socket
import string
import sys
from collections.abc import Callable
from contextlib import asynccontextmanager
from functools import partial
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from swagger_ui_bundle import swagger_ui_path

from fastddrive import __version__
from fastddrive.core.outputs import finite_json
from fastddrive.core.sample import NAV_COMMANDS, DrivingSample, SampleError, encode_png
from fastddrive.data.dataset import SPLITS, DrivingDataset
from fastddrive.decode.registry import DECODERS
from fastddrive.planner import ModelFacts, PlanInputs, Planner
from fastddrive.serve import schemas
from fastddrive.serve.guards import OPEN_PATHS, BearerKey, BodyLimit
from fastddrive.serve.limits import ServiceLimits
from fastddrive.serve.metrics import PlanTiming, ServiceMetrics
from fastddrive.serve.model_process import ModelProcessDied
from fastddrive.serve.resources import load_with_vocabulary
from fastddrive.serve.schemas import ZERO_HISTORY, PlanAnswer, PlanRequest, ServiceRules, plan_request_model, refusal
from fastddrive.serve.worker import ModelWorker, NotReady, QueueFull

RETRY_AFTER_S = 1
COMPONENTS = "#/components/schemas/"
SWITCH_INTERVAL_S = 0.0005
FORM_FIELD_BYTES = 64 * 1024  # a form's text fields: history and options are a few hundred bytes
SCENE_ID = re.compile(rf"({'|'.join(SPLITS)})/(\d{{1,9}})")
log = logging.getLogger(__name__)


class FiniteJSONResponse(JSONResponse):
    """JSONResponse with NaN and infinities as null (`outputs.finite_json`)."""

    def render(self, content: Any) -> bytes:
        return finite_json(content, ensure_ascii=False, separators=(",", ":")).encode()


def create_app(
    load: Callable[[], Planner],
    decoder: str = "ss",
    max_queue: int = 32,
    timeout_s: float = 10.0,
    data: Path | None = None,
    isolated: bool = False,
    *,
    limits: ServiceLimits | None = None,
    api_key: str | None = None,
    pvf_vocabulary: Path | None = None,
) -> FastAPI:
    """The service; `load()` runs at startup on the model worker's thread, or in the model's own process
    (`isolated`: then it must be picklable); /readyz says when it is done. `limits`: what a request may hold;
    `api_key`: required as `Authorization: Bearer` on every route but /healthz and /readyz; `pvf_vocabulary`: the
    planning vocabulary handed to `pvf` (`resources.planning_vocabulary`), checked against the model when it loads."""
    default_decoder = decoder  # the form has a field of the same name
    limits = limits or ServiceLimits()
    rules = ServiceRules(limits, pvf_vocabulary)
    request_model = plan_request_model(limits)
    if pvf_vocabulary is not None:
        load = partial(load_with_vocabulary, load, pvf_vocabulary)
    worker = ModelWorker(load, max_queue, isolated, restarted=lambda: metrics.model_restarts.inc())
    metrics = ServiceMetrics(worker.depth)
    dataset = DrivingDataset.open(data) if data is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        # uvicorn has answered every request or given up on it (its grace period) by now: nobody waits for what
        # the model may still be on, so the worker stops without it.
        await run_in_threadpool(worker.close)

    app = FastAPI(
        title="fastddrive planning service",
        version=__version__,
        lifespan=lifespan,
        description="Camera frames, ego history and a navigation command in; a structured driving answer out. "
        + limits.described(),
        docs_url=None,  # served below from the swagger-ui-bundle package: FastAPI's own page loads a CDN
    )
    app.state.worker = worker
    app.mount("/docs-assets", StaticFiles(directory=swagger_ui_path), name="docs-assets")
    keyed: dict[int | str, dict[str, Any]] = {}
    if api_key:
        keyed = {401: {"description": "No API key, or a wrong one: send `Authorization: Bearer <key>`."}}
    refusals: dict[int | str, dict[str, Any]] = {
        **keyed,
        408: {"description": f"The body did not arrive within {limits.body_timeout_s:g} s."},
        413: {"description": f"The body is larger than {limits.max_body_bytes} bytes."},
        422: {"description": "A field is wrong, or past a limit of this server; `detail[].loc` names it."},
        503: {
            "description": "The queue is full, the model is not ready (loading, restarting after its process "
            "ended, stopping) or failed on this request; see `detail`, and Retry-After."
        },
        504: {"description": "No answer within the server's --timeout-s."},
    }

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url,
            title=f"{app.title}: API",
            swagger_js_url="/docs-assets/swagger-ui-bundle.js",
            swagger_css_url="/docs-assets/swagger-ui.css",
            swagger_favicon_url="/docs-assets/favicon-32x32.png",
        )

    # The last added runs first: the timing sees every answer, the key is checked before a body is read.
    app.add_middleware(BodyLimit, limits=limits)
    if api_key:
        app.add_middleware(BearerKey, key=api_key)
    app.add_middleware(PlanTiming, metrics=metrics)

    def ready_model() -> ModelFacts:
        if not worker.ready:
            raise unavailable(f"the service is not ready: {worker.status}")
        return worker.planner.facts

    def unavailable(detail: str) -> HTTPException:
        return HTTPException(503, detail, headers={"Retry-After": str(RETRY_AFTER_S)})

    async def answer(scene: PlanInputs, name: str, options: dict[str, Any]) -> Response:
        try:
            result, job = await worker.plan(scene, name, options, timeout_s)
        except QueueFull:
            raise unavailable("the queue is full") from None
        except NotReady as err:
            raise unavailable(f"the service is not ready: {err}") from None
        except ModelProcessDied as err:
            raise unavailable(f"{err} while planning this request") from None
        except TimeoutError:
            raise HTTPException(504, f"no answer within {timeout_s:g} s") from None
        except ValueError as err:  # what only the decoder can check (drafts' length), a memory budget
            raise RequestValidationError([refusal(("options",), str(err))]) from None
        except Exception as err:  # a fault of the planner on this request: said, logged, and the service goes on
            log.exception("the planner failed on a request")
            raise unavailable(f"the planner failed on this request ({type(err).__name__}: {err})"[:300]) from None
        metrics.answer(result)
        # Server-Timing lets a client tell the service's own overhead from queueing and planning.
        timing = f"queue;dur={job.queue_ms:.3f}, plan;dur={job.plan_ms:.3f}"
        return FiniteJSONResponse(result.to_json(), headers={"Server-Timing": timing})

    # The request is parsed by hand (off the event loop, its shape scanned first), so FastAPI does not see its
    # model: the schema is named here, under components, where clients' generators look for it.
    plan_body = {"content": {"application/json": {"schema": {"$ref": f"{COMPONENTS}PlanRequest"}}}, "required": True}

    @app.post("/v1/plan", response_model=PlanAnswer, responses=refusals, openapi_extra={"requestBody": plan_body})
    async def plan(request: Request) -> Response:
        """Plan one scene: base64 frames, ego history, command; the decoder and options are optional."""
        facts = ready_model()
        body = await request.body()
        # Parsing, base64 and image decoding run on a thread. The parser holds the interpreter lock while it
        # runs (about 0.1 s per MB of numbers): the body's size is bounded, and its shape scanned before.
        checked = await run_in_threadpool(schemas.plan_from_json, body, facts, default_decoder, rules, request_model)
        return await answer(*checked)

    form_body = {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["command"],
                    "properties": {
                        "command": {"type": "string", "enum": list(NAV_COMMANDS)},
                        "frame": {"type": "string", "format": "binary", "description": "A PNG or JPEG frame."},
                        "scene": {"type": "string", "description": "Instead of a frame: a --data scene, split/index."},
                        "history": {"type": "string", "description": "JSON rows of x, y, vx, vy, ax, ay."},
                        "decoder": {"type": "string", "enum": ["", *DECODERS], "description": "'': the server's."},
                        "options": {"type": "string", "description": "The decoder's options as a JSON object."},
                    },
                }
            }
        },
    }

    @app.post("/v1/plan/form", response_model=PlanAnswer, responses=refusals, openapi_extra={"requestBody": form_body})
    async def plan_form(request: Request) -> Response:
        """The page's form: a frame upload (or a data-folder scene), history, command, decoder, options."""
        facts = ready_model()
        cameras = max(1, len(facts.cameras))
        try:
            form = await request.form(max_files=cameras, max_fields=8, max_part_size=FORM_FIELD_BYTES)
        except StarletteHTTPException as err:
            if err.status_code != 400:  # 413, 408: the body's limits
                raise
            raise RequestValidationError([refusal((), f"the form cannot be read: {err.detail}")]) from None
        errors: list[dict[str, Any]] = []
        fields = {
            name: text_field(form, name, errors) for name in ("command", "scene", "history", "decoder", "options")
        }
        frames = []
        for k, frame in enumerate(form.getlist("frame")):  # one per camera of the model, in its order
            field = "frame" if cameras == 1 else f"frame {k}"
            if isinstance(frame, UploadFile) and frame.filename:  # a browser sends an empty part for no file chosen
                frames.append((field, await frame.read()))
            elif isinstance(frame, str) and frame:
                errors.append(refusal((field,), "frame must be a file upload (PNG or JPEG)"))

        def checked() -> tuple[PlanInputs, str, dict[str, Any]]:
            picked = None
            if fields["scene"]:
                try:
                    sample = pick_scene(fields["scene"])
                    picked = sample.image, sample.history.tolist()
                except (ValueError, IndexError) as err:
                    errors.append(refusal(("scene",), str(err)))
            return schemas.plan_from_form(
                facts,
                rules,
                frames,
                picked,
                fields["history"],
                fields["command"],
                fields["decoder"] or default_decoder,
                fields["options"],
                errors,
            )

        return await answer(*await run_in_threadpool(checked))

    def pick_scene(scene_id: str) -> DrivingSample:
        """A scene of the server's own data folder, by split/index: nothing else is opened."""
        match = SCENE_ID.fullmatch(scene_id)
        if match is None:
            raise SampleError(f"a scene is split/index with split one of {', '.join(SPLITS)}, got {scene_id[:40]!r}")
        if dataset is None:
            raise SampleError("this server has no data folder (start it with --data)")
        return dataset.sample(match[1], int(match[2]))

    @app.get("/v1/scenes", responses=keyed)
    def scenes() -> dict[str, list[dict[str, str]]]:
        """The data folder's scenes for the page's picker (none without --data)."""
        if dataset is None:
            return {"scenes": []}
        listed = []
        for split in ("test", "val", "train"):
            rows = dataset.table(split, columns=["sample_id", "scenario", "command"]).to_pylist()
            listed += [{"id": f"{split}/{k}", **row} for k, row in enumerate(rows)]
        return {"scenes": listed}

    @app.get("/v1/scenes/{split}/{index}", responses={**keyed, 404: {"description": "No such scene."}})
    def scene(
        split: Literal["test", "val", "train"], index: Annotated[int, PathParam(ge=0, le=999_999_999)]
    ) -> dict[str, Any]:
        """One scene of the data folder: its frame (a PNG data URL), history, command and camera view."""
        try:
            sample = pick_scene(f"{split}/{index}")
        except (ValueError, IndexError) as err:  # no data folder, an index out of range
            raise HTTPException(404, str(err)) from None
        view = sample.view
        return {
            "id": f"{split}/{index}",
            "image": "data:image/png;base64," + base64.b64encode(encode_png(sample.image)).decode(),
            "history": sample.history.tolist(),
            "command": sample.command,
            "view": {
                "pixels_per_metre": view.pixels_per_metre,
                "ego_pixel": view.ego_pixel,
                "ego_heading_rad": view.ego_heading_rad,
            },
        }

    page = string.Template(files("fastddrive.serve").joinpath("page.html").read_text()).substitute(
        commands="".join(f"<option>{c}</option>" for c in NAV_COMMANDS),
        decoders="".join(f"<option{' selected' * (d == decoder)}>{d}</option>" for d in DECODERS),
        history=json.dumps(ZERO_HISTORY),
    )

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index() -> str:
        return page

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        """The process is up (no key needed)."""
        return {"status": "ok"}

    @app.get("/readyz", responses={**keyed, 503: {"description": "Not ready: loading, restarting or stopping."}})
    def readyz() -> Response:
        """The model is loaded and requests are taken (503 while it loads or restarts, or with why it failed); when
        ready, also the cameras it takes as separate images, in order (none: one frame)."""
        if worker.ready:
            cameras = list(worker.planner.facts.cameras)
            return JSONResponse(
                {"status": "ready", "decoder": default_decoder, "max_queue": max_queue, "cameras": cameras}
            )
        return JSONResponse({"status": worker.status}, 503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/metrics", response_class=PlainTextResponse, responses=keyed)
    def prometheus() -> Response:
        """Prometheus text format."""
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.openapi = partial(_with_request_model, app.openapi, request_model)
    if api_key:
        app.openapi = partial(_with_bearer_key, app.openapi)
    return app


def text_field(form: FormData, name: str, errors: list[dict[str, Any]]) -> str:
    """A text field of a form ('' when absent); a file sent in its place is a refusal."""
    value = form.get(name, "")
    if isinstance(value, str):
        return value
    errors.append(refusal((name,), f"{name} must be a form field, not a file"))
    return ""


def _with_request_model(openapi: Callable[[], dict[str, Any]], model: type[PlanRequest]) -> dict[str, Any]:
    """The OpenAPI schema with the request model (and this server's limits in it) under components."""
    schema = openapi()
    request = model.model_json_schema(ref_template=COMPONENTS + "{model}")
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(request.pop("$defs", {}))
    schemas["PlanRequest"] = request
    return schema


def _with_bearer_key(openapi: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The OpenAPI schema saying that every route but the probes (/healthz, /readyz) takes a bearer key."""
    schema = openapi()
    schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in schema["paths"].items():
        if path not in OPEN_PATHS:
            for operation in operations.values():
                operation["security"] = [{"bearer": []}]
    return schema


def run(app: FastAPI, sock: socket.socket, grace_s: float) -> None:
    """Serve on `sock` (`guards.listening_socket`) until SIGTERM (or Ctrl+C): stop accepting, finish what is in
    flight (at most `grace_s`), abandon what the model may still be on, return."""
    # uvicorn raises the signal again once it has shut down; this handler makes that a normal exit (status 0).
    signal.signal(signal.SIGTERM, lambda *_: None)
    # A model on a thread of this process holds the interpreter lock through most of a decode step; the event
    # loop then waits up to a switch interval (5 ms by default) each time it needs the lock.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=grace_s, log_level="info")
    uvicorn.Server(config).run(sockets=[sock])
    if app.state.worker.running:
        # A thread cannot be stopped, and tearing the interpreter down under a model that is still planning can
        # crash it: the answer is for nobody, so the process ends here.
        log.warning("the model was still planning a request nobody waits for; stopping without it")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
