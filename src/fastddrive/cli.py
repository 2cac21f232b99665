"""The `fastddrive` command line."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

app = typer.Typer(help="Fast block-diffusion driving planners.", no_args_is_help=True, add_completion=False)
data_app = typer.Typer(help="Build and inspect driving datasets.", no_args_is_help=True)
tokenizer_app = typer.Typer(help="Train and inspect tokenizers and their response scaffold.", no_args_is_help=True)
app.add_typer(data_app, name="data")
app.add_typer(tokenizer_app, name="tokenizer")
console = Console()


@contextmanager
def user_errors() -> Iterator[None]:
    """Known bad input becomes one clear line on stderr and exit status 2, not a traceback."""
    from fastddrive.data.build import OutputExists
    from fastddrive.data.highway import UnknownScenario
    from fastddrive.data.sample import DatasetError, SampleError
    from fastddrive.schema import ResponseError
    from fastddrive.tokenizer import MissingDiffusionTokens
    from fastddrive.train.checkpoint import CheckpointError
    from fastddrive.train.config import ConfigError

    known = (
        OutputExists,
        UnknownScenario,
        DatasetError,
        SampleError,
        ResponseError,
        MissingDiffusionTokens,
        ConfigError,
        CheckpointError,
    )
    try:
        yield
    except (*known, FileNotFoundError, IndexError) as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
    )


@data_app.command("highway")
def data_highway(
    out: Annotated[Path, typer.Option(help="Output dataset folder.")],
    episodes: Annotated[int, typer.Option(min=1, help="Number of episodes (one shard each).")] = 100,
    seed: Annotated[int, typer.Option(help="Base seed; episode i uses seed * 100000 + i.")] = 0,
    scenarios: Annotated[str, typer.Option(help="Comma-separated scenarios.")] = (
        "highway,merge,exit,roundabout,intersection"
    ),
    workers: Annotated[int, typer.Option(min=1, help="Worker processes.")] = 1,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing dataset in --out.")] = False,
) -> None:
    """Simulate seeded highway-env episodes with the IDM/MOBIL expert and write a dataset."""
    from fastddrive.data.build import EpisodeResult, build_dataset
    from fastddrive.data.highway import check_scenarios

    with user_errors():
        names = check_scenarios([s.strip() for s in scenarios.split(",") if s.strip()])
        progress = _progress()
        task = progress.add_task("episodes", total=None, note="")
        written = {"samples": 0, "failed": 0}

        def on_start(todo: int, done: int) -> None:
            if done:
                console.print(f"resuming: {done} of {todo + done} episodes already written")
            progress.update(task, total=todo)
            progress.start()

        def on_episode(result: EpisodeResult) -> None:
            written["samples"] += result.samples
            if result.error:
                written["failed"] += 1
                last = result.error.strip().splitlines()[-1]
                progress.console.print(f"[red]episode {result.job.index} ({result.job.scenario}) failed:[/] {last}")
            note = f"{written['samples']} samples" + (f", {written['failed']} failed" if written["failed"] else "")
            progress.update(task, advance=1, note=note)

        try:
            report = build_dataset(out, episodes, seed, names, workers, overwrite, on_start, on_episode)
        except KeyboardInterrupt:
            progress.stop()
            console.print(f"interrupted: the episodes written so far are kept in {out}; rerun to resume")
            raise typer.Exit(130) from None
        finally:
            progress.stop()
    console.print(
        f"wrote {report.samples} samples from {report.episodes - report.skipped} episodes "
        f"in {report.seconds:.1f} s ({report.samples_per_second:.2f} samples/s, {workers} worker(s)) to {out}"
    )
    if report.failed:
        console.print(f"[red]{len(report.failed)} episode(s) failed; rerun the same command to retry them[/]")
        raise typer.Exit(1)


@data_app.command("show")
def data_show(
    path: Annotated[Path, typer.Argument(help="Dataset folder.")],
    split: Annotated[str, typer.Option(help="train, val or test.")] = "test",
    index: Annotated[int, typer.Option(help="Sample index within the split.")] = 0,
    png: Annotated[Path | None, typer.Option(help="Write the frame with history and future here.")] = None,
) -> None:
    """Print one sample's target JSON; optionally draw it."""
    from fastddrive.data.sample import DrivingDataset
    from fastddrive.eval.plots import draw_scene
    from fastddrive.prompt import user_text
    from fastddrive.schema import render

    with user_errors():
        sample = DrivingDataset.open(path).sample(split, index)
    console.print(f"[bold]{sample.sample_id}[/]  scenario={sample.scenario}  t={sample.time_s:.2f} s", highlight=False)
    console.print(user_text(sample.command, sample.history), highlight=False)
    console.print_json(render(sample.response))
    if png is not None:
        console.print(f"wrote {draw_scene(sample, png)}")


def _count_table(title: str, counts: Counter, total: int) -> Table:
    table = Table(title=title)
    table.add_column("value")
    table.add_column("samples", justify="right")
    table.add_column("share", justify="right")
    for value, n in counts.most_common():
        table.add_row(str(value), str(n), f"{100 * n / total:.1f}%")
    return table


def _scaffold_table(scaffold: object) -> Table:
    table = Table(title="Response scaffold (paper 000 Table 1)")
    for column in ("section", "positions", "scaffold", "values", "value share"):
        table.add_column(column, justify="left" if column == "section" else "right")
    for row in scaffold.table():
        table.add_row(row.section, str(row.positions), str(row.scaffold), str(row.values), f"{row.value_share:.1%}")
    return table


@data_app.command("stats")
def data_stats(
    path: Annotated[Path, typer.Argument(help="Dataset folder.")],
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer folder (default: the embedded one).")] = None,
    explanation_budget: Annotated[int | None, typer.Option(help="Explanation token budget.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the figures as JSON.")] = None,
) -> None:
    """Counts per scenario, meta-behaviour distribution, explanation truncations, the scaffold table."""
    from fastddrive.data.sample import SPLITS, DrivingDataset
    from fastddrive.scaffold import DEFAULT_EXPLANATION_BUDGET, Scaffold
    from fastddrive.schema import parse
    from fastddrive.tokenizer import default_tokenizer_path, load_tokenizer

    with user_errors():
        dataset = DrivingDataset.open(path)
        scaffold = Scaffold(
            load_tokenizer(tokenizer or default_tokenizer_path()),
            explanation_budget=explanation_budget or DEFAULT_EXPLANATION_BUDGET,
        )
        per_split = {s: dataset.table(s, columns=["scenario", "command", "response"]).to_pylist() for s in SPLITS}
    rows = [row for split in SPLITS for row in per_split[split]]
    if not rows:
        console.print(f"{path} holds no samples")
        raise typer.Exit(1)
    responses = [parse(r["response"]) for r in rows]
    scenarios = Table(title=f"Samples per scenario ({dataset.manifest['settings']['episodes']} episodes)")
    scenarios.add_column("scenario")
    for split in SPLITS:
        scenarios.add_column(split, justify="right")
    by_split = {s: Counter(r["scenario"] for r in per_split[s]) for s in SPLITS}
    for name in sorted({r["scenario"] for r in rows}):
        scenarios.add_row(name, *(str(by_split[s][name]) for s in SPLITS))
    scenarios.add_row("all", *(str(len(per_split[s])) for s in SPLITS))
    console.print(scenarios)
    ends = Counter((key.split("-", 1)[1], reason) for key, reason in dataset.manifest.get("end_reasons", {}).items())
    if ends:
        endings = ", ".join(f"{scenario} {reason} {n}" for (scenario, reason), n in sorted(ends.items()))
        console.print(f"episode endings (the expert's crashes are cut 5 s before): {endings}")

    longitudinal = Counter(r.future_meta_behavior.longitudinal for r in responses)
    lateral = Counter(r.future_meta_behavior.lateral for r in responses)
    commands = Counter(r["command"] for r in rows)
    objects = Counter(name for r in responses for name, flag in r.critical_objects.items() if flag)
    console.print(_count_table("Longitudinal meta-behaviour", longitudinal, len(rows)))
    console.print(_count_table("Lateral meta-behaviour", lateral, len(rows)))
    console.print(_count_table("Navigation command", commands, len(rows)))
    console.print(_count_table("Critical objects marked yes", objects, len(rows)))

    encoded = [scaffold.encode(r) for r in responses]
    truncated = sum(e.truncated for e in encoded)
    slot = next(s for s in scaffold.slots if s.name == "explanation")
    lengths = sorted(sum(t != scaffold.null_id for t in e.ids[slot.start : slot.end]) for e in encoded)
    console.print(
        f"explanations cut to fit the {scaffold.explanation_budget}-token budget: {truncated} of {len(rows)} "
        f"({100 * truncated / len(rows):.2f}%); explanation tokens median {lengths[len(lengths) // 2]}, "
        f"max {lengths[-1]}"
    )
    console.print(_scaffold_table(scaffold))
    if json_out is not None:
        figures = {
            "samples": {s: len(per_split[s]) for s in SPLITS},
            "scenarios": {s: dict(by_split[s]) for s in SPLITS},
            "longitudinal": dict(longitudinal),
            "lateral": dict(lateral),
            "commands": dict(commands),
            "critical_objects": dict(objects),
            "explanations_truncated": truncated,
            "scaffold": [
                {"section": r.section, "positions": r.positions, "scaffold": r.scaffold, "values": r.values}
                for r in scaffold.table()
            ],
        }
        json_out.write_text(json.dumps(figures, indent=2))
        console.print(f"wrote {json_out}")


@tokenizer_app.command("train")
def tokenizer_train(
    data: Annotated[Path, typer.Option(help="Dataset folder whose train split is the corpus.")],
    out: Annotated[Path, typer.Option(help="Folder to save the tokenizer in.")],
    vocab_size: Annotated[int, typer.Option(min=300, help="BPE vocabulary size.")] = 1024,
) -> None:
    """Train the byte-level BPE on prompts and answers of a dataset's train split."""
    from fastddrive.data.sample import DrivingDataset
    from fastddrive.tokenizer import corpus_texts, train_tokenizer

    with user_errors():
        table = DrivingDataset.open(data).table("train", columns=["command", "history", "response"])
    tokenizer = train_tokenizer(corpus_texts(table.to_pylist()), vocab_size=vocab_size)
    tokenizer.save_pretrained(str(out))
    console.print(f"trained a {len(tokenizer)}-token tokenizer on {table.num_rows} samples; saved to {out}")


def _slot_kind(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "critical_objects":
        return "critical_objects.*"
    if parts[0] == "trajectory":
        return f"trajectory.*.{parts[-1]}"
    return name


@tokenizer_app.command("table")
def tokenizer_table(
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer folder (default: the embedded one).")] = None,
    explanation_budget: Annotated[int | None, typer.Option(help="Explanation token budget.")] = None,
    block_size: Annotated[int, typer.Option(min=1, help="Block size for the block count.")] = 32,
) -> None:
    """Print the scaffold table (paper 000 Table 1) and the slot budgets for a tokenizer."""
    from fastddrive.scaffold import DEFAULT_EXPLANATION_BUDGET, Scaffold
    from fastddrive.tokenizer import add_diffusion_tokens, default_tokenizer_path, load_tokenizer

    with user_errors():
        loaded = load_tokenizer(tokenizer or default_tokenizer_path())
    ids = add_diffusion_tokens(loaded)
    if ids.added:
        console.print(f"added {', '.join(ids.added)} (ids {ids.mask_id}, {ids.null_id}) to this tokenizer")
    scaffold = Scaffold(loaded, explanation_budget=explanation_budget or DEFAULT_EXPLANATION_BUDGET)
    console.print(_scaffold_table(scaffold))
    budgets = Counter((_slot_kind(s.name), s.budget) for s in scaffold.slots)
    console.print(
        "slot budgets: " + ", ".join(f"{name} {budget} x{n}" for (name, budget), n in sorted(budgets.items()))
    )
    console.print(f"blocks of at most {block_size}: {len(scaffold.blocks(block_size))}")


@app.command("train")
def train_command(
    preset: Annotated[
        str | None, typer.Option(help="A preset from fastddrive/configs (tiny-ar, tiny-sasd, ...).")
    ] = None,
    config: Annotated[Path | None, typer.Option(help="A YAML config file instead of a preset.")] = None,
    out: Annotated[Path | None, typer.Option(help="Output folder (overrides the config).")] = None,
    data: Annotated[Path | None, typer.Option(help="Dataset folder (overrides the config).")] = None,
    steps: Annotated[int | None, typer.Option(help="Training steps (overrides the config).")] = None,
    init_from: Annotated[str | None, typer.Option(help="Starting checkpoint (overrides the config).")] = None,
    resume: Annotated[bool, typer.Option(help="Continue from the last valid checkpoint in --out.")] = False,
) -> None:
    """Train with the AR or SASD recipe; checkpoints are atomic and --resume continues exactly."""
    from fastddrive.train.config import load_config
    from fastddrive.train.loop import train

    with user_errors():
        settings = load_config(
            preset,
            config,
            out=str(out) if out else None,
            data=str(data) if data else None,
            steps=steps,
            init_from=init_from,
        )
    progress = _progress()
    task = progress.add_task(settings.name, total=settings.steps, note="")

    def on_step(step: int, total: int, metrics: dict[str, float]) -> None:
        if not progress.live.is_started:
            progress.start()
            progress.update(task, completed=step - 1)
        note = f"loss {metrics['loss']:.3f} (noisy {metrics['noisy_loss']:.3f}, clean {metrics['clean_loss']:.3f})"
        if "val_ade5" in metrics:
            progress.console.print(
                f"step {step}: val loss {metrics['val_loss']:.3f}, greedy-AR ADE@3s {metrics['val_ade3']:.2f} m, "
                f"ADE@5s {metrics['val_ade5']:.2f} m, invalid {metrics['val_invalid']}"
            )
        progress.update(task, completed=step, note=note)

    try:
        with user_errors():
            report = train(settings, resume=resume, on_step=on_step, say=console.print)
    finally:
        progress.stop()
    console.print(
        f"trained {report.steps - report.resumed_from} steps in {report.seconds:.0f} s "
        f"({report.steps_per_second:.2f} steps/s); final model in {report.final}"
    )


@app.command("eval")
def eval_command(
    model: Annotated[str, typer.Option(help="'default', 'default-ar', or a local model folder.")] = "default",
    data: Annotated[Path, typer.Option(help="Dataset folder.")] = Path("runs/sim"),
    split: Annotated[str, typer.Option(help="train, val or test.")] = "test",
    limit: Annotated[int | None, typer.Option(help="Evaluate only the first N samples.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the figures as JSON.")] = None,
) -> None:
    """Greedy-AR accuracy on a split: ADE@3s/5s next to constant velocity, meta accuracy, critical-object F1."""
    import dataclasses
    from itertools import islice

    from fastddrive.data.sample import DrivingDataset
    from fastddrive.eval.accuracy import evaluate_greedy_ar
    from fastddrive.model import BlockDiffusionModel, model_path

    with user_errors():
        dataset = DrivingDataset.open(data)
        total = len(dataset.table(split, columns=["sample_id"]))
        loaded = BlockDiffusionModel.from_pretrained(model_path(model))
    n = min(total, limit) if limit else total
    with _progress() as progress:
        task = progress.add_task(f"greedy AR on {split}", total=n, note="")
        report = evaluate_greedy_ar(
            loaded, islice(dataset.samples(split), n), on_sample=lambda: progress.update(task, advance=1)
        )
    table = Table(title=f"{model} on {data} [{split}], {report.samples} samples, greedy AR")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("ADE@3s (m)", f"{report.ade3_m:.3f}"),
        ("ADE@5s (m)", f"{report.ade5_m:.3f}"),
        ("constant velocity ADE@3s (m)", f"{report.cv_ade3_m:.3f}"),
        ("constant velocity ADE@5s (m)", f"{report.cv_ade5_m:.3f}"),
        ("longitudinal accuracy", f"{report.longitudinal_accuracy:.3f}"),
        ("lateral accuracy", f"{report.lateral_accuracy:.3f}"),
        ("critical-object F1", f"{report.critical_object_f1:.3f}"),
        ("invalid answers", f"{report.invalid} of {report.samples}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    scenarios = Table(title="ADE@5s per scenario (m)")
    for column in ("scenario", "samples", "model", "constant velocity"):
        scenarios.add_column(column, justify="left" if column == "scenario" else "right")
    for name, row in report.by_scenario().items():
        scenarios.add_row(name, str(row["samples"]), f"{row['ade5_m']:.3f}", f"{row['cv_ade5_m']:.3f}")
    console.print(scenarios)
    if json_out is not None:
        json_out.write_text(json.dumps(dataclasses.asdict(report) | {"by_scenario": report.by_scenario()}, indent=2))
        console.print(f"wrote {json_out}")


def main() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars would break the rich progress
    app()


if __name__ == "__main__":
    main()
