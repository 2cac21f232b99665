"""The HTTP planning service: routes over one model worker (FastAPI, served by uvicorn).

POST /v1/plan (JSON) and /v1/plan/form (the page's multipart form) answer what `fastddrive plan --json`
prints; GET /healthz, /readyz, /metrics (Prometheus), /docs (OpenAPI), / (the page) and /v1/scenes (the scenes
of a data folder, for the page). A full queue is a 503 with Retry-After, a request past its time a 504.
"""

from __future__ import annotations

import base64
import json
import signal
import string
import sys
from collections.abc import Callable
from contextlib import asynccontextmanager
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI, File, Form, HTTPException, Response, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from swagger_ui_bundle import swagger_ui_path

from fastddrive import __version__
from fastddrive.data.sample import NAV_COMMANDS, DrivingDataset, DrivingSample, SampleError, encode_png
from fastddrive.decode.registry import DECODERS
from fastddrive.inputs import image_from_bytes
from fastddrive.outputs import finite_json
from fastddrive.planner import ModelFacts, PlanInputs, Planner
from fastddrive.serve.metrics import PlanTiming, ServiceMetrics
from fastddrive.serve.schemas import ZERO_HISTORY, PlanAnswer, PlanRequest, checked_request, decode_images, refusal
from fastddrive.serve.worker import ModelWorker, NotReady, QueueFull

RETRY_AFTER_S = 1
SWITCH_INTERVAL_S = 0.0005
REFUSALS: dict[int | str, dict[str, Any]] = {
    422: {"description": "A field is wrong; `detail[].loc` names it."},
    503: {"description": "The queue is full or the model is not loaded yet; see Retry-After."},
    504: {"description": "No answer within the server's --timeout-s."},
}


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
) -> FastAPI:
    """The service; `load()` runs at startup on the model worker's thread, or in the model's own process
    (`isolated`: then it must be picklable); /readyz says when it is done."""
    default_decoder = decoder  # the form has a field of the same name
    worker = ModelWorker(load, max_queue, isolated)
    metrics = ServiceMetrics(worker.depth)
    dataset = DrivingDataset.open(data) if data is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        await run_in_threadpool(worker.close)  # uvicorn has finished every request by now

    app = FastAPI(
        title="fastddrive planning service",
        version=__version__,
        lifespan=lifespan,
        description="Camera frames, ego history and a navigation command in; a structured driving answer out.",
        docs_url=None,  # served below from the swagger-ui-bundle package: FastAPI's own page loads a CDN
    )
    app.state.worker = worker
    app.mount("/docs-assets", StaticFiles(directory=swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url,
            title=f"{app.title}: API",
            swagger_js_url="/docs-assets/swagger-ui-bundle.js",
            swagger_css_url="/docs-assets/swagger-ui.css",
            swagger_favicon_url="/docs-assets/favicon-32x32.png",
        )

    app.add_middleware(PlanTiming, metrics=metrics)

    def ready_model() -> ModelFacts:
        if not worker.ready:
            detail = worker.load_error or "the model is loading"
            raise HTTPException(503, detail, headers={"Retry-After": str(RETRY_AFTER_S)})
        return worker.planner.facts

    async def answer(scene: PlanInputs, name: str, options: dict[str, Any]) -> Response:
        try:
            result, job = await worker.plan(scene, name, options, timeout_s)
        except (QueueFull, NotReady) as err:
            detail = "the queue is full" if isinstance(err, QueueFull) else "the service is not ready"
            raise HTTPException(503, detail, headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except TimeoutError:
            raise HTTPException(504, f"no answer within {timeout_s:g} s") from None
        except ValueError as err:  # options only the decoder can check: drafts' length, a vocabulary file
            raise RequestValidationError([refusal(("options",), str(err))]) from None
        metrics.answer(result)
        # Server-Timing lets a client tell the service's own overhead from queueing and planning.
        timing = f"queue;dur={job.queue_ms:.3f}, plan;dur={job.plan_ms:.3f}"
        return FiniteJSONResponse(result.to_json(), headers={"Server-Timing": timing})

    @app.post("/v1/plan", response_model=PlanAnswer, responses=REFUSALS)
    async def plan(request: PlanRequest) -> Response:
        """Plan one scene: base64 frames, ego history, command; the decoder and options are optional."""
        facts = ready_model()
        images, errors = decode_images(request.images)
        name = request.decoder or decoder
        checked = checked_request(facts, images, request.history, request.command, name, request.options, errors)
        return await answer(*checked)

    @app.post("/v1/plan/form", response_model=PlanAnswer, responses=REFUSALS)
    async def plan_form(
        command: Annotated[str, Form(description=f"One of {', '.join(NAV_COMMANDS)}.")],
        frame: Annotated[UploadFile | None, File(description="A PNG or JPEG camera frame.")] = None,
        scene: Annotated[str, Form(description="Instead of a frame: a data-folder scene, split/index.")] = "",
        history: Annotated[str, Form(description="JSON rows of x, y, vx, vy, ax, ay (default: the scene's).")] = "",
        decoder: Annotated[str, Form(description="Default: the server's.")] = "",
        options: Annotated[str, Form(description="The decoder's options as a JSON object.")] = "{}",
    ) -> Response:
        """The page's form: a frame upload (or a data-folder scene), history, command, decoder, options."""
        facts = ready_model()
        images, errors, rows = [], [], None
        if scene:
            try:
                picked = await run_in_threadpool(pick_scene, scene)
                images, rows = [picked.image], picked.history.tolist()
            except (ValueError, IndexError) as err:
                errors.append(refusal(("scene",), str(err)))
        if frame is not None and frame.filename:  # a browser sends an empty part when no file is chosen
            try:
                images = [image_from_bytes(await frame.read())]
            except SampleError as err:
                errors.append(refusal(("frame",), str(err)))
        try:
            rows = json.loads(history) if history.strip() else rows
        except json.JSONDecodeError:
            errors.append(refusal(("history",), "history is not valid JSON; give 7 rows of [x, y, vx, vy, ax, ay]"))
        try:
            options_given = json.loads(options or "{}")
            if not isinstance(options_given, dict):
                raise ValueError
        except ValueError:
            errors.append(refusal(("options",), 'options must be a JSON object, e.g. {"tau": 0.5}'))
            options_given = {}
        checked = checked_request(facts, images, rows, command, decoder or default_decoder, options_given, errors)
        return await answer(*checked)

    def pick_scene(scene_id: str) -> DrivingSample:
        if dataset is None:
            raise SampleError("this server has no data folder (start it with --data)")
        split, _, index = scene_id.partition("/")
        if not index.isdigit():
            raise SampleError(f"a scene is split/index, got {scene_id!r}")
        return dataset.sample(split, int(index))

    @app.get("/v1/scenes")
    def scenes() -> dict[str, list[dict[str, str]]]:
        """The data folder's scenes for the page's picker (none without --data)."""
        if dataset is None:
            return {"scenes": []}
        listed = []
        for split in ("test", "val", "train"):
            rows = dataset.table(split, columns=["sample_id", "scenario", "command"]).to_pylist()
            listed += [{"id": f"{split}/{k}", **row} for k, row in enumerate(rows)]
        return {"scenes": listed}

    @app.get("/v1/scenes/{split}/{index}")
    def scene(split: str, index: int) -> dict[str, Any]:
        """One scene of the data folder: its frame (a PNG data URL), history, command and camera view."""
        try:
            sample = pick_scene(f"{split}/{index}")
        except (ValueError, IndexError) as err:  # no data folder, an unknown split, an index out of range
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
        """The process is up."""
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> Response:
        """The model is loaded and requests are taken (503 while it loads, or with why it failed)."""
        if worker.ready:
            return JSONResponse({"status": "ready", "decoder": default_decoder, "max_queue": max_queue})
        return JSONResponse({"status": worker.load_error or "loading"}, 503, headers={"Retry-After": "1"})

    @app.get("/metrics")
    def prometheus() -> Response:
        """Prometheus text format."""
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def run(app: FastAPI, host: str, port: int, grace_s: float) -> None:
    """Serve until SIGTERM (or Ctrl+C): stop accepting, finish what is in flight (at most `grace_s`), return."""
    # uvicorn raises the signal again once it has shut down; this handler makes that a normal exit (status 0).
    signal.signal(signal.SIGTERM, lambda *_: None)
    # A model on a thread of this process holds the interpreter lock through most of a decode step; the event
    # loop then waits up to a switch interval (5 ms by default) each time it needs the lock.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvicorn.run(app, host=host, port=port, timeout_graceful_shutdown=grace_s, log_level="info")
