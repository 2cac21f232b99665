"""`fastddrive serve` and `fastddrive serve-bench`: the HTTP service and its load test."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fastddrive.cli.common import app, console, user_errors


@app.command("serve")
def serve_command(
    model: Annotated[
        str, typer.Option(help="'default', 'default-ar', 'default-jf' or a local model folder.")
    ] = "default",
    decoder: Annotated[str, typer.Option(help="The decoder of requests that name none.")] = "ss",
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:1, ...")] = "cpu",
    dtype: Annotated[
        str | None, typer.Option(help="float32, bfloat16 or float16 (default: bfloat16 on a GPU).")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")] = 8000,
    max_queue: Annotated[int, typer.Option(min=1, help="Requests that may wait; more are answered 503.")] = 32,
    timeout_s: Annotated[float, typer.Option(min=0.001, help="A request unanswered after this is a 504.")] = 10.0,
    data: Annotated[Path | None, typer.Option(help="A dataset folder whose scenes the page offers.")] = None,
    model_process: Annotated[
        bool, typer.Option(help="Run the model in a process of its own (default: on a thread of the server).")
    ] = False,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="FASTDDRIVE_API_KEY",
            show_default=False,
            help="Require 'Authorization: Bearer KEY' on every route but /healthz and /readyz (401 otherwise).",
        ),
    ] = None,
    pvf_vocabulary: Annotated[
        Path | None,
        typer.Option(help="The planning vocabulary of pvf requests (default: the model folder's, if it has one)."),
    ] = None,
    max_body_mib: Annotated[int, typer.Option(min=1, help="Largest request body in MiB (413).")] = 16,
    body_timeout_s: Annotated[
        float, typer.Option(min=0.001, help="Seconds a request body may take to arrive (408).")
    ] = 30.0,
    max_images: Annotated[int, typer.Option(min=1, help="Images per request (422).")] = 8,
    max_image_pixels: Annotated[
        int, typer.Option(min=784, help="Pixels of one image, read from its header before decoding (422).")
    ] = 2048 * 2048,
    max_request_pixels: Annotated[int, typer.Option(min=784, help="Pixels of all images of a request (422).")] = (
        4096 * 4096
    ),
    option_cap: Annotated[
        list[str] | None,
        typer.Option(
            help="OPTION=N or DECODER.OPTION=N: the largest value a request may give a decoder option (422); "
            "repeat it. Defaults: block_size=64, selfspec-quad.block_size=16, rollouts=8, rollout_window=64, "
            "width=8, reveal=64, max_blocks=4, candidates=16."
        ),
    ] = None,
) -> None:
    """Serve the planner over HTTP: POST /v1/plan, the page at /, /docs, /healthz, /readyz, /metrics.

    One worker owns the model (on a thread, or in a process of its own with --model-process, restarted if it
    dies); SIGTERM stops accepting, finishes the requests in flight (for at most --timeout-s + 5 s) and exits 0.
    Requests are bounded by the limits below, and name no file: pvf plans with --pvf-vocabulary."""
    from functools import partial

    import fastddrive
    from fastddrive.decode.registry import get_decoder
    from fastddrive.engine.model_files import check_device, model_path
    from fastddrive.eval.roofline import parse_dtype
    from fastddrive.serve.app import create_app, run
    from fastddrive.serve.guards import exposure_warning, listening_socket
    from fastddrive.serve.limits import MIB, ServiceLimits, parse_caps
    from fastddrive.serve.resources import planning_vocabulary

    if api_key is not None and not api_key.strip():
        raise typer.BadParameter("the API key is empty", param_hint="--api-key")
    with user_errors():
        get_decoder(decoder)
        sock = listening_socket(host, port)
        folder = model_path(model)
        check_device(device)
        weights = parse_dtype(dtype) if dtype else None
        limits = ServiceLimits(
            max_body_bytes=max_body_mib * MIB,
            body_timeout_s=body_timeout_s,
            max_images=max_images,
            max_image_pixels=max_image_pixels,
            max_request_pixels=max_request_pixels,
            option_caps=parse_caps(option_cap or []),
        )
        service = create_app(
            partial(fastddrive.load, model, device=device, dtype=weights),
            decoder,
            max_queue,
            timeout_s,
            data,
            isolated=model_process,
            limits=limits,
            api_key=api_key.strip() if api_key else None,
            pvf_vocabulary=planning_vocabulary(folder, pvf_vocabulary),
        )
    warning = exposure_warning(host, api_key)
    if warning:
        Console(stderr=True).print(f"[bold yellow]{escape(warning)}[/]", highlight=False, soft_wrap=True)
    run(service, sock, grace_s=timeout_s + 5)


@app.command("serve-bench")
def serve_bench_command(
    model: Annotated[str, typer.Option(help="'default' or a local model folder.")] = "default",
    decoders: Annotated[str, typer.Option(help="Comma-separated decoders.")] = "ss,ar",
    clients: Annotated[str, typer.Option(help="Comma-separated numbers of concurrent clients.")] = "1,4,16",
    requests: Annotated[int, typer.Option(min=2, max=10_000, help="Requests per decoder and number of clients.")] = 64,
    scenes: Annotated[
        int, typer.Option(min=1, max=1024, help="Fresh simulator scenes the requests cycle through.")
    ] = 8,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the fresh scenes, 0 to 92233720368546.")] = 7,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the rows as JSON.")] = None,
) -> None:
    """The service under load (`fastddrive serve` on loopback) against `planner.plan` called directly:
    throughput, p50/p99 latency, and the overhead per request (medians): the service's own (JSON, validation,
    image decoding, hand-over to the model worker) and as a client sees it (its HTTP stack and loopback too)."""
    import fastddrive
    from fastddrive.core.outputs import check_file_destination, write_json
    from fastddrive.decode.registry import get_decoder, split_decoders
    from fastddrive.eval.bench import bench_scenes
    from fastddrive.serve.loadtest import client_counts, serve_bench

    with user_errors():
        if json_out is not None:
            check_file_destination(json_out, "--json", suffixes=(".json",))
        names = split_decoders(decoders)
        for name in names:
            get_decoder(name)
        counts = client_counts(clients, requests)
        chosen = bench_scenes(None, "test", seed, max(scenes, 2))
        planner = fastddrive.load(model)
    rows = serve_bench(model, planner, chosen, names, counts, requests)
    table = Table(title=f"{model}: {requests} requests over {len(chosen)} scenes per row (CPU)")
    columns = ("decoder", "target", "clients", "answered", "503", "other", "plans/s", "p50 ms", "p99 ms")
    for column in (*columns, "overhead ms", "client-seen ms", "first-burst overhead ms"):
        table.add_column(column, justify="left" if column in ("decoder", "target") else "right")
    for row in sorted(rows, key=lambda r: (r.decoder, r.target == "service", r.clients)):
        overheads = (
            "" if ms is None else f"{ms:.2f}" for ms in (row.overhead_ms, row.client_overhead_ms, row.burst_overhead_ms)
        )
        table.add_row(
            row.decoder,
            row.target,
            str(row.clients),
            str(row.answered),
            str(row.refused),
            str(row.failed),
            f"{row.throughput:.2f}",
            f"{row.p50_ms:.1f}",
            f"{row.p99_ms:.1f}",
            *overheads,
        )
    console.print(table)
    if json_out is not None:
        write_json(json_out, {"model": model, "rows": [r.to_json() for r in rows]})
        console.print(f"wrote {json_out}")
