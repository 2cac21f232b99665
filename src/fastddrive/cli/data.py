"""The `fastddrive data` commands: build, convert, export, verify and inspect data sets."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fastddrive.cli.common import console, data_app, progress_bar, user_errors


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
        progress = progress_bar()
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
    from fastddrive.outputs import check_file_destination, write_json

    with user_errors():
        if json_out is not None:
            check_file_destination(json_out, "--json", suffixes=(".json",), inputs=(path,))
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

    with user_errors(), progress_bar() as progress:
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

    with user_errors(), progress_bar() as progress:
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
        with progress_bar() as progress:
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
    from fastddrive.outputs import check_file_destination
    from fastddrive.prompt import user_text
    from fastddrive.schema import render

    with user_errors():
        if png is not None:
            check_file_destination(png, "--png", suffixes=(".png",), inputs=(path,))
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
    from fastddrive.outputs import check_file_destination, write_json
    from fastddrive.scaffold import DEFAULT_EXPLANATION_BUDGET, Scaffold
    from fastddrive.tokenizer import default_tokenizer_path, load_tokenizer

    with user_errors():
        if json_out is not None:
            check_file_destination(json_out, "--json", suffixes=(".json",), inputs=(path, tokenizer))
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
