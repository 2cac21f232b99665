"""The `fastddrive` command line."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
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
pvf_app = typer.Typer(help="Plan-Verify-Fill's offline calibration (paper 001 Appendix A.2).", no_args_is_help=True)
app.add_typer(data_app, name="data")
app.add_typer(tokenizer_app, name="tokenizer")
app.add_typer(pvf_app, name="pvf")
# Piped or logged output gets room for the wide tables instead of rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 160)


@contextmanager
def user_errors() -> Iterator[None]:
    """Known bad input becomes one clear line on stderr and exit status 2, not a traceback."""
    from fastddrive.data.build import OutputExists
    from fastddrive.data.highway import UnknownScenario
    from fastddrive.data.sample import DatasetError, SampleError
    from fastddrive.decode.planning_vocabulary import PlanningVocabularyError
    from fastddrive.decode.registry import DecoderError
    from fastddrive.drive import DriveError
    from fastddrive.eval.roofline import RooflineError
    from fastddrive.model_files import DeviceError, ModelFileError
    from fastddrive.random_init import UnknownPreset
    from fastddrive.schema import ResponseError
    from fastddrive.serve.loadtest import LoadTestError
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
        DecoderError,
        PlanningVocabularyError,
        RooflineError,
        UnknownPreset,
        ModelFileError,
        DeviceError,
        DriveError,
        LoadTestError,
    )
    try:
        yield
    except (*known, FileNotFoundError, IndexError) as err:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _progress(disable: bool = False) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=disable,
    )


def _check_demo_folder(out: Path) -> None:
    from fastddrive.outputs import check_demo_folder

    check_demo_folder(out)


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
            report = build_dataset(
                out,
                episodes,
                seed,
                names,
                workers,
                overwrite,
                on_start,
                on_episode,
                on_problem=lambda problem: console.print(f"rebuilding {problem}", markup=False, highlight=False),
            )
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


@data_app.command("verify")
def data_verify(
    path: Annotated[Path, typer.Argument(help="Dataset folder.")],
    quick: Annotated[bool, typer.Option(help="Check presence and size only, not the checksums.")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON.")] = None,
) -> None:
    """Every shard of a data set against its manifest: ok, missing, damaged or unrecorded (exit 1 if any)."""
    from fastddrive.data.verify import verify_dataset
    from fastddrive.outputs import check_outputs, write_json

    with user_errors():
        check_outputs(json_out)
        report = verify_dataset(path, checksums=not quick)
    for line in report.lines():
        console.print(line, markup=False, highlight=False)
    if json_out is not None:
        write_json(json_out, report.to_dict())
    if not report.ok:
        raise typer.Exit(1)


@data_app.command("wod-e2e")
def data_wod_e2e(
    src: Annotated[
        Path,
        typer.Option(help="Folder of release-format JSON files (training/validation/test) and TFRecords (raters)."),
    ],
    out: Annotated[Path, typer.Option(help="Output dataset folder.")],
    image_root: Annotated[Path | None, typer.Option(help="Root of the records' image paths (default: --src).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing dataset in --out.")] = False,
) -> None:
    """Convert WOD-E2E in the Fast-dDrive / dVLM-AD release format into a dataset (unrated val/test frames
    dropped as WOD-E2E requires; a malformed record is reported by file and id, the rest converted)."""
    from fastddrive.data.wod_e2e import convert_wod_e2e

    with user_errors(), _progress() as progress:
        task = progress.add_task("records", total=None, note="")
        report = convert_wod_e2e(
            src, out, image_root, overwrite=overwrite, on_item=lambda: progress.update(task, advance=1)
        )
    _report_conversion(out, report.samples, report.failures, report.seconds)
    console.print(
        f"unrated frames dropped: {sum(report.unrated.values())}; answers derived from the future: "
        f"{report.answers_derived}"
    )
    if report.failures:
        raise typer.Exit(1)


@data_app.command("nuscenes")
def data_nuscenes(
    dataroot: Annotated[Path, typer.Option(help="nuScenes root (the version folder, samples/, can_bus/).")],
    out: Annotated[Path, typer.Option(help="Output dataset folder.")],
    version: Annotated[str, typer.Option(help="Table folder: v1.0-mini, v1.0-trainval, v1.0-test, ...")] = "v1.0-mini",
    six_cameras: Annotated[bool, typer.Option(help="Tile the six cameras instead of CAM_FRONT alone.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing dataset in --out.")] = False,
) -> None:
    """Convert nuScenes v1.0 tables (and the CAN bus expansion) into a dataset: ego history, the future in
    the UniAD/VAD planning frame, the command by their rule, the other agents' boxes (data/nuscenes.py)."""
    from fastddrive.data.nuscenes import convert_nuscenes

    with user_errors(), _progress() as progress:
        task = progress.add_task("key frames", total=None, note="")
        report = convert_nuscenes(
            dataroot,
            version,
            out,
            six_cameras=six_cameras,
            overwrite=overwrite,
            on_start=lambda total: progress.update(task, total=total),
            on_item=lambda: progress.update(task, advance=1),
        )
    _report_conversion(out, report.samples, report.failures, report.seconds)
    skipped = ", ".join(f"{reason} {n}" for reason, n in report.skipped.items()) or "none"
    velocity = ", ".join(f"{source} {n}" for source, n in report.velocity_rows.items())
    console.print(f"{report.scenes} scenes; key frames skipped: {skipped}; history velocity rows from {velocity}")
    if report.failures:
        raise typer.Exit(1)


def _report_conversion(out: Path, samples: dict[str, int], failures: list, seconds: float) -> None:
    counts = ", ".join(f"{split} {n}" for split, n in samples.items())
    console.print(f"wrote {sum(samples.values())} samples ({counts}) in {seconds:.1f} s to {out}")
    for failure in failures:
        console.print(f"[red]failed:[/] {failure}", highlight=False, soft_wrap=True)


@data_app.command("export")
def data_export(
    data: Annotated[Path, typer.Option(help="A fastddrive dataset folder.")],
    out: Annotated[Path, typer.Option(help="Output folder.")],
    format: Annotated[str, typer.Option("--format", help="wod-e2e or nuscenes.")],
    split: Annotated[str | None, typer.Option(help="One split (default: all).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace what is in --out.")] = False,
) -> None:
    """Write a dataset in a real data set's layout (the adapters read it back; users point tools at it):
    nuScenes v1.0 tables, frames and CAN bus messages, or WOD-E2E release JSON and frames."""
    from fastddrive.data.sample import SPLITS, DatasetError

    with user_errors():
        if format not in ("wod-e2e", "nuscenes"):
            raise DatasetError(f"unknown --format {format!r}; known: wod-e2e, nuscenes")
        if split is not None and split not in SPLITS:
            raise DatasetError(f"unknown --split {split!r}; known: {', '.join(SPLITS)}")
        if format == "nuscenes" and overwrite:
            raise DatasetError("a nuScenes export needs an empty --out; --overwrite is not supported for it")
        with _progress() as progress:
            task = progress.add_task("samples", total=None, note="")
            advance = lambda: progress.update(task, advance=1)  # noqa: E731
            if format == "wod-e2e":
                from fastddrive.data.wod_e2e import export_wod_e2e

                report = export_wod_e2e(data, out, split, overwrite=overwrite, on_item=advance)
            else:
                from fastddrive.data.nuscenes import export_nuscenes

                report = export_nuscenes(
                    data,
                    out,
                    splits=SPLITS if split is None else (split,),
                    on_start=lambda total: progress.update(task, total=total),
                    on_item=advance,
                )
            written, seconds = report.samples, report.seconds
    counts = ", ".join(f"{name} {n}" for name, n in written.items())
    console.print(f"exported {sum(written.values())} samples ({counts}) in {seconds:.1f} s to {out}")


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
    from fastddrive.outputs import check_outputs
    from fastddrive.prompt import user_text
    from fastddrive.schema import render

    with user_errors():
        check_outputs(png)
        sample = DrivingDataset.open(path).sample(split, index)
    console.print(f"[bold]{sample.sample_id}[/]  scenario={sample.scenario}  t={sample.time_s:.2f} s", highlight=False)
    console.print(user_text(sample.command, sample.history), highlight=False)
    console.print_json(render(sample.response))
    if png is not None:
        console.print(f"wrote {draw_scene(sample, png)}")


@data_app.command("stats")
def data_stats(
    path: Annotated[Path, typer.Argument(help="Dataset folder.")],
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer folder (default: the embedded one).")] = None,
    explanation_budget: Annotated[int | None, typer.Option(help="Explanation token budget.")] = None,
    scaffold_tokenization: Annotated[
        str, typer.Option(help="pieces (each scaffold piece alone, the embedded models') or runs (maximal runs).")
    ] = "pieces",
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the figures as JSON.")] = None,
) -> None:
    """Counts per scenario, meta-behaviour distribution, explanation truncations, the scaffold table."""
    from fastddrive.data.sample import DrivingDataset
    from fastddrive.data.stats import dataset_stats
    from fastddrive.outputs import check_outputs, write_json
    from fastddrive.scaffold import DEFAULT_EXPLANATION_BUDGET, Scaffold
    from fastddrive.tokenizer import default_tokenizer_path, load_tokenizer

    with user_errors():
        check_outputs(json_out)
        dataset = DrivingDataset.open(path)
        scaffold = Scaffold(
            load_tokenizer(tokenizer or default_tokenizer_path()),
            explanation_budget=explanation_budget or DEFAULT_EXPLANATION_BUDGET,
            scaffold_tokenization=scaffold_tokenization,
        )
        stats = dataset_stats(dataset, scaffold)
    if not stats.samples:
        console.print(f"{path} holds no samples")
        raise typer.Exit(1)
    for renderable in stats.renderables():
        console.print(renderable)
    if json_out is not None:
        write_json(json_out, stats.to_json())
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
    scaffold_tokenization: Annotated[
        str, typer.Option(help="pieces (each scaffold piece alone, the embedded models') or runs (maximal runs).")
    ] = "pieces",
) -> None:
    """Print the scaffold table (paper 000 Table 1) and the slot budgets for a tokenizer."""
    from fastddrive.data.stats import scaffold_table
    from fastddrive.scaffold import DEFAULT_EXPLANATION_BUDGET, Scaffold
    from fastddrive.tokenizer import add_diffusion_tokens, default_tokenizer_path, load_tokenizer

    with user_errors():
        loaded = load_tokenizer(tokenizer or default_tokenizer_path())
        ids = add_diffusion_tokens(loaded)
        scaffold = Scaffold(
            loaded,
            explanation_budget=explanation_budget or DEFAULT_EXPLANATION_BUDGET,
            scaffold_tokenization=scaffold_tokenization,
        )
    if ids.added:
        console.print(f"added {', '.join(ids.added)} (ids {ids.mask_id}, {ids.null_id}) to this tokenizer")
    console.print(scaffold_table(scaffold))
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
    """Train with the AR, SASD or Jacobi Forcing recipe; checkpoints are atomic and --resume continues exactly."""
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
        noisy, clean = ("consistency", "AR") if settings.recipe == "jf" else ("noisy", "clean")
        note = f"loss {metrics['loss']:.3f} ({noisy} {metrics['noisy_loss']:.3f}, {clean} {metrics['clean_loss']:.3f}"
        note += f", labelled {metrics['labelled_loss']:.3f})" if "labelled_loss" in metrics else ")"
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


@app.command("trajectories")
def trajectories_command(
    out: Annotated[Path, typer.Option(help="Folder for the trajectory shards and their manifest.")],
    model: Annotated[str, typer.Option(help="The AR teacher: 'default-ar' or a local AR model folder.")] = "default-ar",
    data: Annotated[Path, typer.Option(help="Dataset folder.")] = Path("runs/sim"),
    split: Annotated[str, typer.Option(help="train, val or test.")] = "train",
    samples: Annotated[int, typer.Option(help="How many samples of the split (chosen by --seed).")] = 400,
    block_size: Annotated[int, typer.Option(help="Jacobi block size n.")] = 16,
    seed: Annotated[int, typer.Option(help="Seed of the sample choice and of each sample's initial guesses.")] = 0,
) -> None:
    """Collect the teacher's Jacobi trajectories for Jacobi Forcing (paper 003); a rerun resumes."""
    import fastddrive
    from fastddrive.train.trajectories import Trajectory, collect_trajectories, plan_collection

    with user_errors():
        plan = plan_collection(model, data, split, samples, block_size, seed, out)
        planner = fastddrive.load(model)
    progress = _progress()
    task = progress.add_task("trajectories", total=None, note="")
    totals = {"tokens": 0, "forwards": 0}

    def on_start(todo: int, done: int) -> None:
        if done:
            console.print(f"resuming: {done} of {todo + done} samples already collected")
        progress.update(task, total=todo)
        progress.start()

    def on_sample(trajectory: Trajectory) -> None:
        totals["tokens"] += len(trajectory.answer)
        totals["forwards"] += trajectory.forwards
        note = f"{totals['tokens'] / max(totals['forwards'], 1):.2f} tokens/forward"
        progress.update(task, advance=1, note=note)

    try:
        with user_errors():
            report = collect_trajectories(
                plan, planner.model, planner.scaffold, on_start, on_sample, say=progress.console.print
            )
    except KeyboardInterrupt:
        progress.stop()
        console.print(f"interrupted: the shards written so far are kept in {out}; rerun the same command to resume")
        raise typer.Exit(130) from None
    finally:
        progress.stop()
    console.print(
        f"collected {report.collected} trajectories in {report.seconds:.0f} s "
        f"({report.tokens / max(report.forwards, 1):.2f} tokens/forward after the prefill)"
        + (f", kept {report.skipped} already collected" if report.skipped else "")
        + f"; in {out}"
    )


@pvf_app.command("calibrate")
def pvf_calibrate(
    model: Annotated[str, typer.Option(help="'default' or a local block-diffusion model folder.")] = "default",
    data: Annotated[Path, typer.Option(help="Dataset folder.")] = Path("runs/sim"),
    split: Annotated[str, typer.Option(help="The calibration split: train, val or test.")] = "val",
    samples: Annotated[int | None, typer.Option(min=1, help="Calibrate on the first N scenes (default: all).")] = None,
    out: Annotated[
        Path | None, typer.Option(help="Where to write the vocabulary (default: pvf_vocabulary.json in the model).")
    ] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
) -> None:
    """Choose the planning vocabulary of `pvf`: run the base decoder on a split and keep the tokens whose
    drafts in the calibration band verify often and cut uncertainty (paper 001 Appendix A.2)."""
    from fastddrive.data.sample import DrivingDataset
    from fastddrive.eval.pvf_calibration import calibrate_split

    with user_errors():
        DrivingDataset.open(data).table(split)  # a bad folder or split fails here, before the model loads
        with _progress() as progress:
            task = progress.add_task("calibrating", total=None, note="scenes")
            vocabulary, path = calibrate_split(
                model,
                data,
                split,
                out=out,
                samples=samples,
                device=device,
                progress=lambda done, total: progress.update(task, completed=done, total=total),
            )
    table = Table(title=f"planning vocabulary of {model}: {len(vocabulary.tokens)} tokens")
    for column in ("token", "id", "events", "verifiable", "verified rate", "gain"):
        table.add_column(column, justify="left" if column == "token" else "right")
    for token in vocabulary.tokens:
        table.add_row(
            repr(token.text),
            str(token.id),
            str(token.events),
            str(token.verifiable),
            f"{token.verified_rate:.2f}",
            f"{token.gain:.3f}",
        )
    console.print(table)
    console.print(f"wrote {path}")


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
    from fastddrive.outputs import check_outputs, write_json

    with user_errors():
        check_outputs(json_out)
        specs = split_decoders(decoders)
        parsed = dict(zip(specs, (parse_decoder_spec(spec) for spec in specs), strict=True))
        dataset = DrivingDataset.open(data)
        total = len(dataset.table(split, columns=["sample_id"]))
        if total == 0:
            raise DatasetError(f"{data} has no {split} samples: nothing to evaluate")
        planner = fastddrive.load(model, device=device_of_process(device))
    n = min(total, limit) if limit else total
    main = is_main_process()
    with _progress(disable=not main) as progress, user_errors():

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


@app.command("plan")
def plan_command(
    model: Annotated[
        str, typer.Option(help="'default', 'default-ar', 'default-jf' or a local model folder.")
    ] = "default",
    data: Annotated[Path | None, typer.Option(help="Dataset folder to take the scene from.")] = None,
    split: Annotated[str, typer.Option(help="train, val or test (with --data).")] = "test",
    index: Annotated[int, typer.Option(help="Sample index in the split (with --data).")] = 0,
    image: Annotated[list[Path] | None, typer.Option(help="Camera image (PNG); repeat for several.")] = None,
    history: Annotated[
        str | None, typer.Option(help="Ego history: JSON text or a .json file, 7 rows of \\[x, y, vx, vy, ax, ay].")
    ] = None,
    command: Annotated[str | None, typer.Option(help="go_straight, go_left or go_right.")] = None,
    decoder: Annotated[str, typer.Option(help="A registered decoder (ar, fullseq, mdm, sd, selfspec, ...).")] = "ss",
    option: Annotated[list[str] | None, typer.Option(help="Decoder option KEY=VALUE (tau=0.5); repeatable.")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:1, ...")] = "cpu",
    dtype: Annotated[
        str | None, typer.Option(help="float32, bfloat16 or float16 (default: bfloat16 on a GPU).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the summary.")] = False,
) -> None:
    """Plan one scene: from a dataset (--data/--split/--index) or from --image/--history/--command."""
    import fastddrive
    from fastddrive.data.sample import DrivingDataset, SampleError
    from fastddrive.decode.registry import parse_options
    from fastddrive.inputs import read_history, read_image
    from fastddrive.outputs import finite_json

    with user_errors():
        options = parse_options(option or [], decoder)
        if data is not None:
            if image or history or command:
                raise SampleError("give either --data or --image/--history/--command, not both")
            scene = DrivingDataset.open(data).sample(split, index)
        else:
            if history is None or command is None:
                raise SampleError("without --data, --history and --command are required (and --image for a VLM)")
            scene = fastddrive.PlanInputs.checked(
                images=[read_image(p) for p in image or []], history=read_history(history), command=command
            )
        from fastddrive.eval.roofline import parse_dtype

        planner = fastddrive.load(model, device=device, dtype=parse_dtype(dtype) if dtype else None)
        if planner.model.is_vision and isinstance(scene, fastddrive.PlanInputs) and not scene.images:
            raise SampleError("this model reads images: give --image")
        result = planner.plan(scene, decoder, **options)
    if as_json:
        print(finite_json(result.to_json()))
        if result.response is None:  # the JSON says why (its "error"); the status says it failed
            raise typer.Exit(1)
        return
    table = Table(title=f"{decoder} on {model}")
    for column in ("NFE", "tokens", "tokens/NFE", "prefill ms", "decode ms", "tokens/s"):
        table.add_column(column, justify="right")
    table.add_row(
        str(result.nfe),
        str(result.tokens),
        f"{result.tokens_per_nfe:.2f}",
        f"{result.prefill_ms:.1f}",
        f"{result.decode_ms:.1f}",
        f"{result.tokens_per_s:.0f}",
    )
    console.print(table)
    console.print(result.text, highlight=False, soft_wrap=True)
    if result.response is None:
        Console(stderr=True).print(f"[bold red]the answer does not parse:[/] {result.error}", highlight=False)
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
    from fastddrive.outputs import check_outputs, write_json

    device = device_of_process(device)
    with user_errors():
        check_outputs(json_out, png)
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
    with _progress(disable=not main) as progress:
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
    from fastddrive.outputs import check_outputs, write_json

    with user_errors():
        check_outputs(json_out, png)
        counts = parse_tokens(tokens) if tokens else list(DEFAULT_TOKENS)
        loaded, name = roofline_model(model, random_init, device, dtype, cuda_graphs)
    with _progress() as progress:
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

    with user_errors():
        _check_demo_folder(out)
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
) -> None:
    """Serve the planner over HTTP: POST /v1/plan, the page at /, /docs, /healthz, /readyz, /metrics.

    One worker owns the model (on a thread, or in a process of its own with --model-process); SIGTERM stops
    accepting, finishes the requests in flight and exits 0."""
    from functools import partial

    import fastddrive
    from fastddrive.decode.registry import get_decoder
    from fastddrive.eval.roofline import parse_dtype
    from fastddrive.model_files import check_device, model_path
    from fastddrive.serve.app import create_app, run

    with user_errors():
        get_decoder(decoder)
        model_path(model)
        check_device(device)
        weights = parse_dtype(dtype) if dtype else None
        service = create_app(
            partial(fastddrive.load, model, device=device, dtype=weights),
            decoder,
            max_queue,
            timeout_s,
            data,
            isolated=model_process,
        )
    run(service, host, port, grace_s=timeout_s + 5)


@app.command("serve-bench")
def serve_bench_command(
    model: Annotated[str, typer.Option(help="'default' or a local model folder.")] = "default",
    decoders: Annotated[str, typer.Option(help="Comma-separated decoders.")] = "ss,ar",
    clients: Annotated[str, typer.Option(help="Comma-separated numbers of concurrent clients.")] = "1,4,16",
    requests: Annotated[int, typer.Option(min=2, help="Requests per decoder and number of clients.")] = 64,
    scenes: Annotated[int, typer.Option(min=1, help="Fresh simulator scenes the requests cycle through.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed of the fresh scenes.")] = 7,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the rows as JSON.")] = None,
) -> None:
    """The service under load (`fastddrive serve` on loopback) against `planner.plan` called directly:
    throughput, p50/p99 latency, and the overhead per request (medians): the service's own (JSON, validation,
    image decoding, hand-over to the model worker) and as a client sees it (its HTTP stack and loopback too)."""
    import fastddrive
    from fastddrive.decode.registry import get_decoder, split_decoders
    from fastddrive.eval.bench import bench_scenes
    from fastddrive.outputs import check_outputs, write_json
    from fastddrive.serve.loadtest import client_counts, serve_bench

    with user_errors():
        check_outputs(json_out)
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


@app.command("drive")
def drive_command(
    model: Annotated[
        str, typer.Option(help="'default', 'default-ar', 'default-jf' or a local model folder.")
    ] = "default",
    decoders: Annotated[str, typer.Option(help="Comma-separated decoders, options as sd:tau=0.0.")] = "ar,ss,sd,tts",
    scenarios: Annotated[str, typer.Option(help="Comma-separated scenarios.")] = (
        "highway,merge,exit,roundabout,intersection"
    ),
    episodes: Annotated[int, typer.Option(min=1, help="Episodes per scenario; every planner drives the same.")] = 20,
    seed: Annotated[int, typer.Option(help="Episode j of scenario s uses seed * 100000 + 5 j + (s's index).")] = 7,
    latency: Annotated[
        str, typer.Option(help="measured, zero, fixed:MS, or fixed:ar=MS,ss=MS,... one value per decoder.")
    ] = "measured",
    replan_s: Annotated[
        float, typer.Option("--replan-s", help="Simulated seconds between questions (a multiple of 0.25).")
    ] = 0.5,
    duration_s: Annotated[
        float | None, typer.Option("--duration-s", help="Episode length in simulated seconds (default 40, 25).")
    ] = None,
    references: Annotated[
        bool, typer.Option(help="Also drive the expert (in the seat and as a planner) and constant velocity.")
    ] = True,
    device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
    out: Annotated[Path, typer.Option(help="Per-episode results (a re-run resumes) and summary.png.")] = Path(
        "runs/drive"
    ),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the rows as JSON.")] = None,
    video: Annotated[Path | None, typer.Option(help="Write one GIF per episode into this folder.")] = None,
) -> None:
    """Closed-loop driving in highway-env, each decoder's latency charged to the simulation clock."""
    from fastddrive.drive.run import check_settings, run_drive, title
    from fastddrive.drive.summary import rows_table, scenario_table
    from fastddrive.outputs import check_outputs, write_json

    with user_errors():
        check_outputs(json_out)
        settings = check_settings(
            model=model,
            decoders=decoders,
            scenarios=scenarios,
            episodes=episodes,
            seed=seed,
            latency=latency,
            replan_s=replan_s,
            duration_s=duration_s,
            references=references,
            device=device,
            out=out,
            video=video,
        )
    progress = _progress()
    task = progress.add_task("episodes", total=None, note="")
    failed = []

    def on_start(todo: int, done: int) -> None:
        if done:
            console.print(f"resuming: {done} episode(s) already driven in {out}")
        progress.update(task, total=todo)
        progress.start()

    def on_episode(outcome) -> None:
        job = outcome.job
        if outcome.error:
            failed.append(job)
            last = escape(outcome.error.strip().splitlines()[-1])
            progress.console.print(f"[red]{job.label} on {job.scenario} (seed {job.seed}) failed:[/] {last}")
        note = f"{job.label} {job.scenario}" + (f", {len(failed)} failed" if failed else "")
        progress.update(task, advance=1, note=note)

    try:
        with user_errors():
            report = run_drive(settings, on_start=on_start, on_episode=on_episode)
    except KeyboardInterrupt:
        progress.stop()
        console.print(f"interrupted: finished episodes are kept in {out}; rerun the same command to resume")
        raise typer.Exit(130) from None
    finally:
        progress.stop()
    console.print(rows_table(report.rows, title(settings)))
    console.print(scenario_table(report.rows))
    console.print(f"{report.seconds:.0f} s; wrote {report.summary_png}" + (f" and GIFs in {video}" if video else ""))
    if json_out is not None:
        write_json(json_out, report.to_json())
        console.print(f"wrote {json_out}")
    if report.failures:
        console.print(f"[red]{len(report.failures)} episode(s) failed; rerun the same command to retry them[/]")
        raise typer.Exit(1)


def main() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars would break the rich progress
    app()


if __name__ == "__main__":
    main()
