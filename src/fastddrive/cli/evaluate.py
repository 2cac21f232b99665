"""`fastddrive eval`, `bench`, `roofline` and `demo`: accuracy, speed and the tour."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from fastddrive.cli.common import app, console, progress_bar, user_errors


@app.command("eval")
def eval_command(
    model: Annotated[
        str, typer.Option(help="'default', 'default-ar', 'default-jf' or a local model folder.")
    ] = "default",
    data: Annotated[Path, typer.Option(help="Dataset folder.")] = Path("runs/sim"),
    split: Annotated[str, typer.Option(help="train, val or test.")] = "test",
    decoders: Annotated[str, typer.Option(help="Comma-separated decoders, options as sd:tau=0.0.")] = "ar",
    limit: Annotated[int | None, typer.Option(min=1, help="Evaluate only the first N samples.")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the figures as JSON.")] = None,
) -> None:
    """Accuracy per decoder on a split: ADE@3s/5s (and constant velocity), RFS, L2, collisions, CO-F1, meta.

    Data parallel under `accelerate launch --num_processes N -m fastddrive.cli eval ...`: each process answers
    a share of the split, and the main process prints the same table as one process."""
    import fastddrive
    from fastddrive.data.sample import DatasetError, DrivingDataset
    from fastddrive.decode.registry import parse_decoder_spec, split_decoders
    from fastddrive.eval.accuracy import evaluate_split
    from fastddrive.eval.parallel import device_of_process, is_main_process
    from fastddrive.eval.report import accuracy_json, accuracy_table, scenario_table
    from fastddrive.outputs import check_file_destination, write_json

    with user_errors():
        if json_out is not None:
            check_file_destination(json_out, "--json", suffixes=(".json",), inputs=(data,))
        specs = split_decoders(decoders)
        parsed = dict(zip(specs, (parse_decoder_spec(spec) for spec in specs), strict=True))
        dataset = DrivingDataset.open(data)
        total = len(dataset.table(split, columns=["sample_id"]))
        if total == 0:
            raise DatasetError(f"{data} has no {split} samples: nothing to evaluate")
        planner = fastddrive.load(model, device=device_of_process(device))
    n = min(total, limit) if limit else total
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
    for spec, r in reports.items():
        for failure in r.failures:
            Console(stderr=True).print(f"[bold red]{spec} failed on[/] {failure}", highlight=False)
    console.print(scenario_table(reports))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        write_json(json_out, {"model": model, "split": split, "decoders": accuracy_json(reports)})
        console.print(f"wrote {json_out}")


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
    scenes: Annotated[int, typer.Option(help="Without --data: time this many fresh simulator scenes.")] = 10,
    decoders: Annotated[
        str, typer.Option(help="Comma-separated decoders, 'all', options as sd:tau=0.0:block_size=16.")
    ] = "all",
    samples: Annotated[int, typer.Option(min=2, help="With --data: time this many of its scenes.")] = 50,
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
    seed: Annotated[int, typer.Option(help="Seed of the fresh scenes (without --data).")] = 7,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the rows as JSON.")] = None,
    png: Annotated[Path | None, typer.Option(help="Write the speed-accuracy frontier as PNG.")] = None,
) -> None:
    """Every decoder on the same scenes in one process: NFE, tokens/NFE, tokens/s, latency, speed-up, ADE.

    Data parallel under `accelerate launch --num_processes N -m fastddrive.cli bench --data ...`: the timed
    scenes are shared among the processes, and the main process prints the table."""
    import torch

    import fastddrive
    from fastddrive.decode.registry import DECODERS, parse_decoder_spec, split_decoders
    from fastddrive.eval.bench import DecoderRun, bench_scenes
    from fastddrive.eval.parallel import device_of_process, is_main_process
    from fastddrive.eval.plots import draw_frontier
    from fastddrive.outputs import check_file_destination, write_json

    device = device_of_process(device)
    with user_errors():
        if json_out is not None:
            check_file_destination(json_out, "--json", suffixes=(".json",), inputs=(data,))
        if png is not None:
            check_file_destination(png, "--png", suffixes=(".png",), inputs=(data,))
        specs = list(DECODERS) if decoders == "all" else split_decoders(decoders)
        parsed = [parse_decoder_spec(spec) for spec in specs]
        from fastddrive.eval.roofline import parse_dtype

        weights = parse_dtype(dtype) if dtype else None
        if random_init is not None:
            from fastddrive.random_init import random_init_model

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
        chosen = bench_scenes(data, split, seed, (samples if data else scenes) + 1)
    rows, _ = _run_bench(runs, chosen, f"{model}: {len(chosen) - 1} scenes, medians ({device})")
    if not is_main_process():
        return
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"model": model, "device": device, "rows": [r.to_json() for r in rows]}
        write_json(json_out, payload)
        console.print(f"wrote {json_out}")
    if png is not None:
        draw_frontier([r.to_json() for r in rows], png, title=f"{model}, {len(chosen) - 1} scenes, {device}")
        console.print(f"wrote {png}")


def _run_bench(runs: list, scenes: list, title: str) -> tuple[list, dict]:
    """Run the decoders with a progress bar and print the table (on the main process); (rows, per-scene results)."""
    from fastddrive.eval.bench import run_bench
    from fastddrive.eval.parallel import is_main_process, share
    from fastddrive.eval.report import bench_table

    main = is_main_process()
    with progress_bar(disable=not main) as progress:
        total = len(runs) * len(share(scenes[1:]))  # this process's share of the timed scenes
        task = progress.add_task("decoding", total=total, note=f"{len(runs)} decoders")
        rows, results = run_bench(runs, scenes, on_result=lambda: progress.update(task, advance=1))
    if main:
        console.print(bench_table(rows, title))
    return rows, results


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
    repeats: Annotated[int, typer.Option(min=1, help="Timed forwards per token count.")] = 20,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed forwards per token count first.")] = 3,
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
    from fastddrive.eval.plots import draw_roofline
    from fastddrive.eval.report import roofline_summary, roofline_table
    from fastddrive.eval.roofline import DEFAULT_TOKENS, measure_roofline, parse_tokens, roofline_model
    from fastddrive.outputs import check_file_destination, write_json

    with user_errors():
        if json_out is not None:
            check_file_destination(json_out, "--json", suffixes=(".json",))
        if png is not None:
            check_file_destination(png, "--png", suffixes=(".png",))
        counts = parse_tokens(tokens) if tokens else list(DEFAULT_TOKENS)
        loaded, name = roofline_model(model, random_init, device, dtype, cuda_graphs)
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
    scenes: Annotated[int, typer.Option(help="Fresh simulator scenes to plan (one more warms up).")] = 6,
    seed: Annotated[int, typer.Option(help="Seed of the fresh scenes.")] = 2026,
    model: Annotated[str, typer.Option(help="'default' or a local block-diffusion model folder.")] = "default",
) -> None:
    """The tour: fresh simulator scenes planned by ar, ar-jump, sd, ss and tts; a table, an answer, pictures."""
    import fastddrive
    from fastddrive.demo import demo_runs, write_demo
    from fastddrive.eval.bench import bench_scenes
    from fastddrive.outputs import check_demo_folder

    with user_errors():
        check_demo_folder(out)
        console.print(f"simulating {scenes + 1} fresh scenes (seed {seed}) and loading {model} ...")
        chosen = bench_scenes(None, "test", seed, scenes + 1)
        planner = fastddrive.load(model)
    runs = demo_runs(planner)
    rows, results = _run_bench(runs, chosen, f"{model} on {scenes} fresh scenes, medians (CPU)")
    timed = chosen[1:]
    console.print(f"[bold]ss answer for {timed[0].sample_id}[/] ({timed[0].scenario}, {timed[0].command}):")
    console.print(results["ss"][0].text, highlight=False, soft_wrap=True)
    write_demo(out, f"{model}, {scenes} scenes, CPU", runs, timed, rows, results)
    console.print(f"wrote {len(timed)} scene pictures, frontier.png and answer.json to {out}")
