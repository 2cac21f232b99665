"""`fastddrive eval`, `bench`, `roofline` and `demo`: accuracy, speed and the tour."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from fastddrive.cli.common import app, console, first_few, progress_bar, user_errors


@app.command("eval")
def eval_command(
    model: Annotated[
        str, typer.Option(help="'default', 'default-ar', 'default-jf' or a local model folder.")
    ] = "default",
    data: Annotated[Path, typer.Option(help="Dataset folder.")] = Path("runs/sim"),
    split: Annotated[str, typer.Option(help="train, val or test.")] = "test",
    decoders: Annotated[str, typer.Option(help="Comma-separated decoders, options as sd:tau=0.0.")] = "ar",
    limit: Annotated[int | None, typer.Option(min=1, max=1_000_000, help="Evaluate only the first N samples.")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the figures as JSON.")] = None,
) -> None:
    """Accuracy per decoder on a split: ADE@3s/5s (and constant velocity), RFS, L2, collisions, CO-F1, meta.

    A sample that does not read or decode is reported by shard and sample id, the others are scored, and the
    exit status is 1. Data parallel under `accelerate launch --num_processes N -m fastddrive.cli eval ...`:
    each process answers a share of the split, and the main process prints the same table as one process."""
    import fastddrive
    from fastddrive.core.outputs import check_file_destination, write_json
    from fastddrive.core.training_episodes import training_episodes
    from fastddrive.data.dataset import DatasetError, DrivingDataset
    from fastddrive.decode.registry import parse_decoder_spec, split_decoders
    from fastddrive.engine.model_files import model_path, read_info
    from fastddrive.eval.accuracy import evaluate_split, samples_of_training_episodes
    from fastddrive.eval.parallel import device_of_process, is_main_process
    from fastddrive.eval.report import accuracy_json, accuracy_table, scenario_table

    with user_errors():
        if json_out is not None:
            check_file_destination(json_out, "--json", suffixes=(".json",), inputs=(data, *_model_folders(model)))
        specs = split_decoders(decoders)
        parsed = dict(zip(specs, (parse_decoder_spec(spec) for spec in specs), strict=True))
        dataset = DrivingDataset.open(data)
        total = len(dataset.table(split, columns=["sample_id"]))
        if total == 0:
            raise DatasetError(f"{data} has no {split} samples: nothing to evaluate")
        n = min(total, limit) if limit else total
        trained = training_episodes(read_info(model_path(model)).extra)
        trained_on = samples_of_training_episodes(dataset, split, n, trained)
        if trained_on and is_main_process():
            console.print(
                f"[yellow]warning:[/] {len(trained_on)} of the {n} samples to evaluate are of episodes "
                f"{escape(model)} was trained on ({escape(first_few(trained_on))}; its fastddrive.json): their figures "
                "are not held-out ones (--json lists them)",
                highlight=False,
                soft_wrap=True,
            )
        planner = fastddrive.load(model, device=device_of_process(device))
    main = is_main_process()
    with progress_bar(disable=not main) as progress, user_errors():

        def on_decoder(spec: str, samples: int):
            task = progress.add_task(f"{spec} on {split}", total=samples, note="")
            return lambda: progress.update(task, advance=1)

        reports = evaluate_split(planner, dataset, split, parsed, n, on_decoder)
    if not main:
        return
    console.print(
        accuracy_table(
            reports,
            f"{model} on {data} [{split}], {n} samples; official conventions (an invalid answer is a zero "
            "trajectory; rated frames only where there are raters; collisions rasterised as ST-P3/VAD), "
            "'parsed': over the answers that parse",
        )
    )
    console.print(scenario_table(reports))
    if json_out is not None:
        figures = {"model": model, "split": split, "decoders": accuracy_json(reports)}
        write_json(json_out, figures | {"samples_of_training_episodes": trained_on})
        console.print(f"wrote {json_out}")
    failed = {str(row["sample_id"]) for r in reports.values() for row in r.per_sample if "error" in row}
    if failed:
        by_line: dict[str, list[str]] = {}  # an unreadable sample fails every decoder alike: one line
        for spec, r in reports.items():
            for line in r.failures:
                by_line.setdefault(line, []).append(spec)
        _report_failures([f"{line} ({', '.join(specs)})" for line, specs in by_line.items()])
        _fail(f"{len(failed)} of {n} samples failed (listed above); the figures are over the others")


def _model_folders(*names: str | None) -> tuple[Path, ...]:
    """The folders of the models a command reads: inputs its outputs must stay out of."""
    from fastddrive.engine.model_files import model_path

    return tuple(model_path(name) for name in names if name)


def _report_failures(lines: list[str]) -> None:
    """Each failure on stderr, one line each."""
    errors = Console(stderr=True)
    for line in lines:
        errors.print(f"[bold red]failed:[/] {escape(line)}", highlight=False, soft_wrap=True)


def _fail(message: str) -> None:
    """The last line of a run that completed with failures: exit status 1."""
    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


@app.command("bench")
def bench_command(
    model: Annotated[
        str,
        typer.Option(
            help="'default', 'default-ar', 'default-jf' or a local model folder (AR models run ar, jacobi, jacobi-mr)."
        ),
    ] = "default",
    data: Annotated[Path | None, typer.Option(help="Dataset folder (its --split is used).")] = None,
    split: Annotated[str, typer.Option(help="train, val or test (with --data).")] = "test",
    scenes: Annotated[
        int, typer.Option(min=1, max=1000, help="Without --data: time this many fresh simulator scenes.")
    ] = 10,
    decoders: Annotated[
        str, typer.Option(help="Comma-separated decoders, 'all', options as sd:tau=0.0:block_size=16.")
    ] = "all",
    samples: Annotated[int, typer.Option(min=2, max=5000, help="With --data: time this many of its scenes.")] = 50,
    baseline: Annotated[
        str | None, typer.Option(help="Also time this separately trained AR model writing JSON freely.")
    ] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
    dtype: Annotated[
        str | None, typer.Option(help="float32, bfloat16 or float16 (default: bfloat16 on a GPU).")
    ] = None,
    cuda_graphs: Annotated[
        bool, typer.Option(help="On a GPU, replay fixed-shape decode forwards as CUDA graphs.")
    ] = True,
    random_init: Annotated[
        str | None, typer.Option(help="Instead of --model: this architecture with random weights, for timing only.")
    ] = None,
    oracle_drafts: Annotated[
        bool,
        typer.Option(
            help="Also time ss drafting what its verifier accepts (ar's ids, in bfloat16 their fixed point): "
            "the speed bound at perfect acceptance."
        ),
    ] = False,
    seed: Annotated[
        int, typer.Option(min=0, help="Seed of the fresh scenes (without --data), 0 to 92233720368546.")
    ] = 7,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the rows as JSON.")] = None,
    png: Annotated[Path | None, typer.Option(help="Write the speed-accuracy frontier as PNG.")] = None,
) -> None:
    """Every decoder on the same scenes in one process: NFE, tokens/NFE, tokens/s, latency, speed-up, ADE.

    A scene that does not read or decode is reported by shard and sample id and left out of every row, the
    others complete, and the exit status is 1. Data parallel under `accelerate launch --num_processes N -m
    fastddrive.cli bench --data ...`: the timed scenes are shared among the processes, and the main process
    prints the table."""
    import torch

    import fastddrive
    from fastddrive.core.outputs import check_file_destination, write_json
    from fastddrive.decode.registry import DECODERS, parse_decoder_spec, split_decoders
    from fastddrive.eval.bench import DecoderRun, bench_scenes
    from fastddrive.eval.parallel import device_of_process, is_main_process
    from fastddrive.eval.plots import draw_frontier

    device = device_of_process(device)
    with user_errors():
        inputs = (data, *_model_folders(None if random_init else model, baseline))
        if json_out is not None:
            check_file_destination(json_out, "--json", suffixes=(".json",), inputs=inputs)
        if png is not None:
            check_file_destination(png, "--png", suffixes=(".png",), inputs=inputs)
        specs = list(DECODERS) if decoders == "all" else split_decoders(decoders)
        parsed = [parse_decoder_spec(spec) for spec in specs]
        from fastddrive.eval.roofline import parse_dtype

        weights = parse_dtype(dtype) if dtype else None
        chosen = bench_scenes(data, split, seed, (samples if data else scenes) + 1)
        if random_init is not None:
            from fastddrive.engine.random_init import random_init_model

            on_gpu = torch.device(device).type == "cuda"
            built = random_init_model(random_init, device, weights or (torch.bfloat16 if on_gpu else torch.float32))
            if on_gpu and cuda_graphs:
                built.use_static_shapes(graphs=True)
            planner, model = fastddrive.Planner(built), f"{random_init} (random weights, for timing only)"
        else:
            planner = fastddrive.load(model, device=device, dtype=weights, cuda_graphs=cuda_graphs)
        runs = [DecoderRun(spec, name, options, planner) for spec, (name, options) in zip(specs, parsed, strict=True)]
        if oracle_drafts:
            runs.append(DecoderRun("ss (oracle drafts: speed bound)", "ss", {}, planner, oracle=True))
        if baseline:
            free = DecoderRun(
                f"ar ({baseline}, free JSON)",
                "ar",
                {},
                fastddrive.load(baseline, device, weights, cuda_graphs),
                baseline=True,
            )
            runs.insert(0, free)
    result = _run_bench(runs, chosen, lambda timed: f"{model}: {timed} scenes, medians ({device})")
    if not is_main_process():
        return
    if json_out is not None:
        rows = [r.to_json() for r in result.rows]
        write_json(json_out, {"model": model, "device": device, "rows": rows, "failures": result.failures})
        console.print(f"wrote {json_out}")
    if png is not None:
        title = f"{model}, {len(result.scenes)} scenes, {device}"
        draw_frontier([r.to_json() for r in result.rows], png, title=title)
        console.print(f"wrote {png}")
    if result.failures:
        _report_failures(result.failures)
        _fail(f"{len(result.failures)} scene(s) failed (listed above) and are in no row; the rows are over the others")


def _run_bench(runs: list, scenes: list, title: Callable[[int], str]):
    """Run the decoders with a progress bar and print the table (on the main process, titled by `title` of the
    number of scenes in the rows); the BenchResult."""
    from fastddrive.eval.bench import readable, run_bench
    from fastddrive.eval.parallel import is_main_process, share
    from fastddrive.eval.report import bench_table

    main = is_main_process()
    with progress_bar(disable=not main) as progress, user_errors():
        total = len(runs) * len(share(readable(scenes)[1:]))  # this process's share of the timed scenes
        task = progress.add_task("decoding", total=total, note=f"{len(runs)} decoders")
        result = run_bench(runs, scenes, on_result=lambda: progress.update(task, advance=1))
    if main:
        console.print(bench_table(result.rows, title(len(result.scenes))))
    return result


@app.command("roofline")
def roofline_command(
    model: Annotated[
        str | None, typer.Option(help="'default', 'default-ar', 'default-jf' or a local model folder.")
    ] = None,
    random_init: Annotated[
        str | None, typer.Option(help="Instead of --model: this architecture with random weights (qwen2.5-vl-3b).")
    ] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
    dtype: Annotated[
        str | None, typer.Option(help="float32, bfloat16 or float16 (default: float32 on cpu, bfloat16 otherwise).")
    ] = None,
    tokens: Annotated[
        str | None, typer.Option(help="Comma-separated new tokens per forward (default: 1,2,4,...,512).")
    ] = None,
    repeats: Annotated[int, typer.Option(min=1, max=10_000, help="Timed forwards per token count.")] = 20,
    warmup: Annotated[int, typer.Option(min=0, max=1000, help="Untimed forwards per token count first.")] = 3,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write the rows, bandwidth and floor as JSON.")
    ] = None,
    png: Annotated[Path | None, typer.Option(help="Write latency against tokens per forward as PNG.")] = None,
    cuda_graphs: Annotated[
        bool,
        typer.Option(
            help="On a GPU, replay fixed-shape forwards as CUDA graphs (forwards over 128 tokens run eagerly)."
        ),
    ] = True,
) -> None:
    """Latency of one decode forward against the tokens it carries, beside the weight-read floor."""
    from fastddrive.core.outputs import check_file_destination, write_json
    from fastddrive.eval.plots import draw_roofline
    from fastddrive.eval.report import roofline_summary, roofline_table
    from fastddrive.eval.roofline import DEFAULT_TOKENS, measure_roofline, parse_tokens, roofline_model

    with user_errors():
        inputs = _model_folders(None if random_init else model)
        if json_out is not None:
            check_file_destination(json_out, "--json", suffixes=(".json",), inputs=inputs)
        if png is not None:
            check_file_destination(png, "--png", suffixes=(".png",), inputs=inputs)
        counts = parse_tokens(tokens) if tokens else list(DEFAULT_TOKENS)
        loaded, name = roofline_model(model, random_init, device, dtype, cuda_graphs, tokens=counts)
    with progress_bar() as progress:
        task = progress.add_task("forwards", total=len(counts) * (warmup + repeats), note=f"{len(counts)} sizes")
        result = measure_roofline(loaded, counts, repeats, warmup, lambda: progress.update(task, advance=1))
    capture_s = loaded.static.capture_seconds if loaded.static is not None and loaded.static.graphs else None
    console.print(roofline_summary(result, name, capture_s), highlight=False)
    console.print(roofline_table(result, f"{name}: one forward after the prompt, {repeats} repeats"))
    if json_out is not None:
        payload = {"model": None if random_init else name, "random_init": random_init} | result.to_json()
        write_json(json_out, payload)
        console.print(f"wrote {json_out}")
    if png is not None:
        title = f"{name}, {result.device}, {result.dtype}, prompt {result.prompt_tokens} tokens"
        draw_roofline(result.to_json()["rows"], result.floor_ms, png, title=title)
        console.print(f"wrote {png}")


@app.command("demo")
def demo_command(
    out: Annotated[Path, typer.Option(help="Folder for the pictures and the JSON answer.")] = Path("runs/demo"),
    scenes: Annotated[
        int, typer.Option(min=1, max=100, help="Fresh simulator scenes to plan (one more warms up).")
    ] = 6,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the fresh scenes, 0 to 92233720368546.")] = 2026,
    model: Annotated[str, typer.Option(help="'default' or a local block-diffusion model folder.")] = "default",
) -> None:
    """The tour: fresh simulator scenes planned by ar, ar-jump, sd, ss and tts; a table, an answer, pictures."""
    import fastddrive
    from fastddrive.core.outputs import check_folder_destination
    from fastddrive.eval.bench import bench_scenes, check_seed
    from fastddrive.eval.demo import demo_runs, write_demo

    with user_errors():
        check_folder_destination(out, "--out", inputs=_model_folders(model), own_folder=True)
        check_seed(seed)
        console.print(f"simulating {scenes + 1} fresh scenes (seed {seed}) and loading {model} ...")
        chosen = bench_scenes(None, "test", seed, scenes + 1)
        planner = fastddrive.load(model)
    runs = demo_runs(planner)
    result = _run_bench(runs, chosen, lambda timed: f"{model} on {timed} fresh scenes, medians (CPU)")
    if not result.scenes:
        _report_failures(result.failures)
        _fail("every scene failed (listed above): nothing to show")
    first = result.scenes[0]
    console.print(f"[bold]ss answer for {first.sample_id}[/] ({first.scenario}, {first.command}):")
    console.print(result.results["ss"][0].text, highlight=False, soft_wrap=True)
    title = f"{model}, {len(result.scenes)} scenes, CPU"
    write_demo(out, title, runs, result.scenes, result.rows, result.results)
    console.print(f"wrote {len(result.scenes)} scene pictures, frontier.png and answer.json to {out}")
    if result.failures:
        _report_failures(result.failures)
        _fail(f"{len(result.failures)} scene(s) failed (listed above) and are in no row")
