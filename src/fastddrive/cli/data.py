"""The `fastddrive data` commands: build, convert, export, verify and inspect data sets."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from fastddrive.cli.common import (
    BuildOverwriteOption,
    DurationOption,
    EpisodeSeedOption,
    EpisodesOption,
    ReplanOption,
    ScenariosOption,
    console,
    data_app,
    progress_bar,
    user_errors,
)

if TYPE_CHECKING:
    from fastddrive.data.build import BuildReport

MAX_EXPLANATION_BUDGET = 4096  # tokens: the scaffold holds that many positions for the explanation


class _Counter:
    """A progress bar shown from the first thing it counts, so that a refusal before any work is one line."""

    def __init__(self, description: str) -> None:
        self.progress = progress_bar()
        self.task = self.progress.add_task(description, total=None, note="")
        self.shown = False

    def _show(self) -> None:
        if not self.shown:
            self.progress.start()
            self.shown = True

    def total(self, total: int) -> None:
        self._show()
        self.progress.update(self.task, total=total)

    def advance(self, note: str = "") -> None:
        self._show()
        self.progress.update(self.task, advance=1, note=note)

    def add(self, count: int) -> None:
        self._show()
        self.progress.update(self.task, advance=count)

    def stop(self) -> None:
        if self.shown:  # a progress bar that never showed prints nothing, not even a line break
            self.progress.stop()
            self.shown = False

    def __enter__(self) -> _Counter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@data_app.command("highway")
def data_highway(
    out: Annotated[Path, typer.Option(help="Output dataset folder.")],
    episodes: EpisodesOption = 100,
    seed: EpisodeSeedOption = 0,
    scenarios: ScenariosOption = ("highway,merge,exit,roundabout,intersection"),
    workers: Annotated[int, typer.Option(help="Worker processes, 1 to twice the CPUs this process may use.")] = 1,
    overwrite: BuildOverwriteOption = False,
) -> None:
    """Simulate seeded highway-env episodes with the IDM/MOBIL expert and write a dataset."""
    from fastddrive.data.build import build_dataset

    names = [s.strip() for s in scenarios.split(",") if s.strip()]
    _build_episodes(
        out,
        overwrite,
        workers,
        lambda on_start, on_episode, on_problem: build_dataset(
            out, episodes, seed, names, workers, overwrite, on_start, on_episode, on_problem=on_problem
        ),
    )


def _build_episodes(out: Path, overwrite: bool, workers: int, build: Callable[..., BuildReport]) -> None:
    """Run `build(on_start, on_episode, on_problem)` (data/build.py's callbacks) with a progress bar and ETA, and
    report the episodes written, resumed and failed (exit 1) or an interrupt (exit 130)."""
    from fastddrive.data.build import WORKER_DIED, EpisodeResult, build_folder

    with user_errors(), _Counter("episodes") as counter:
        written = {"samples": 0, "failed": 0}
        into = build_folder(out, overwrite)
        where = str(out) if into == out else f"the replacement being built in {into} ({out} is unchanged)"

        def on_start(todo: int, done: int) -> None:
            if done:
                console.print(f"resuming: {done} of {todo + done} episodes already written in {where}")
            counter.total(todo)

        def on_episode(result: EpisodeResult) -> None:
            written["samples"] += result.samples
            if result.error:
                written["failed"] += 1
                last = escape(result.error.strip().splitlines()[-1])
                counter.progress.console.print(
                    f"[red]episode {result.job.index} ({result.job.scenario}, {result.job.shard}) failed:[/] {last}",
                    highlight=False,
                )
            note = f"{written['samples']} samples" + (f", {written['failed']} failed" if written["failed"] else "")
            counter.advance(note)

        try:
            report = build(
                on_start,
                on_episode,
                lambda problem: console.print(f"rebuilding {problem}", markup=False, highlight=False),
            )
        except KeyboardInterrupt:
            counter.stop()
            console.print(f"interrupted: the episodes written so far are kept in {where}; rerun to resume")
            raise typer.Exit(130) from None
    console.print(
        f"wrote {report.samples} samples from {report.episodes - report.skipped} episodes in {report.seconds:.1f} s "
        f"({report.samples_per_second:.2f} samples/s, {workers} worker(s)) to {report.staged or out}"
    )
    if report.failed:
        died = sum(r.error.startswith(WORKER_DIED) for r in report.failed if r.error)
        why = f" ({died} in a worker process that died)" if died else ""
        kept = f"; {out} is unchanged until the replacement in {report.staged} is complete" if report.staged else ""
        console.print(
            f"[red]{len(report.failed)} episode(s) failed{why}; the others are written{kept}. The same command "
            "resumes and simulates only the failed ones again (once their cause is fixed)[/]",
            highlight=False,
        )
        raise typer.Exit(1)


@data_app.command("dagger")
def data_dagger(
    out: Annotated[Path, typer.Option(help="Output dataset folder.")],
    model: Annotated[
        str, typer.Option(help="The planner that drives: 'default', 'default-ar', 'default-jf' or a model folder.")
    ] = "default",
    decoder: Annotated[str, typer.Option(help="Its decoder, options as sd:tau=0.0.")] = "ss",
    episodes: EpisodesOption = 100,
    seed: EpisodeSeedOption = 1,
    scenarios: ScenariosOption = ("highway,merge,exit,roundabout,intersection"),
    workers: Annotated[
        int, typer.Option(help="Worker processes (each loads the model), 1 to twice the CPUs this process may use.")
    ] = 1,
    replan_s: ReplanOption = 0.5,
    duration_s: DurationOption = None,
    latency: Annotated[
        str, typer.Option(help="zero or fixed:MS (0 to 60000), charged to the simulation clock as in `drive`.")
    ] = "zero",
    device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
    overwrite: BuildOverwriteOption = False,
) -> None:
    """DAgger's data: the planner drives seeded episodes; each state it is asked about becomes a sample with the
    frame, history and command it saw and the expert's answer from there (its 5 s rollout, the data's labels).
    Merge it with the data so far (`data merge`) and retrain: one DAgger round (docs/training.md)."""
    from fastddrive.drive.dagger import build_dagger, check_dagger_settings

    with user_errors():
        settings = check_dagger_settings(
            model=model,
            decoder=decoder,
            episodes=episodes,
            seed=seed,
            scenarios=scenarios,
            replan_s=replan_s,
            duration_s=duration_s,
            latency=latency,
            device=device,
            workers=workers,
        )
    _build_episodes(
        out,
        overwrite,
        workers,
        lambda on_start, on_episode, on_problem: build_dagger(
            out, settings, workers, overwrite, on_start, on_episode, on_problem
        ),
    )


@data_app.command("merge")
def data_merge(
    sources: Annotated[list[Path], typer.Argument(help="Two or more dataset folders.")],
    out: Annotated[Path, typer.Option(help="Output dataset folder: their union.")],
    overwrite: Annotated[
        bool, typer.Option(help="Replace an existing dataset in --out (swapped in once the merge is whole).")
    ] = False,
) -> None:
    """The union of data sets as one (DAgger's aggregate D <- D u D_i): every shard copied, checked, into its split;
    refused if a source is incomplete or damaged, or two sources hold the same sample."""
    from fastddrive.data.merge import merge_datasets

    with user_errors(), _Counter("shards") as counter:
        report = merge_datasets(sources, out, overwrite, on_start=counter.total, on_shard=lambda _: counter.advance())
    counts = ", ".join(f"{split} {n}" for split, n in report.samples.items())
    console.print(
        f"merged {sum(report.samples.values())} samples ({counts}) from {len(sources)} data sets, {report.shards} "
        f"shards, in {report.seconds:.1f} s to {out}"
    )


@data_app.command("verify")
def data_verify(
    path: Annotated[Path, typer.Argument(help="Dataset folder.")],
    quick: Annotated[bool, typer.Option(help="Check presence and size only, not the checksums.")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON.")] = None,
) -> None:
    """Every shard of a data set against its manifest: ok, missing, damaged or unrecorded (exit 1 if any)."""
    from fastddrive.core.outputs import check_file_destination, write_json
    from fastddrive.data.verify import verify_dataset

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
        typer.Option(
            help="Folder of release-format JSON files (training/validation/test) with TFRecords (raters), or of "
            "raw WOD-E2E TFRecords alone (training.tfrecord-*, validation.tfrecord-*, test.tfrecord-*)."
        ),
    ],
    out: Annotated[Path, typer.Option(help="Output dataset folder.")],
    image_root: Annotated[Path | None, typer.Option(help="Root of the records' image paths (default: --src).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing dataset in --out (once converted).")] = False,
    shard: Annotated[
        str, typer.Option(help="I/N: convert every N-th raw TFRecord file from the I-th (N machines, one folder).")
    ] = "0/1",
    workers: Annotated[
        int | None, typer.Option(min=1, max=512, help="Processes converting raw TFRecord files (default: every CPU).")
    ] = None,
) -> None:
    """Convert WOD-E2E into a dataset: the Fast-dDrive / dVLM-AD release format, or raw TFRecords (the three front
    cameras, the history from past_states, the command from intent; file by file on every CPU, resumed when run
    again after an interruption). Val and test frames without raters or a logged future are kept and marked; a
    malformed or corrupt record is reported by file and id (or byte offset), the rest converted."""
    from fastddrive.data.build import usable_cpus
    from fastddrive.data.wod_e2e import convert_wod_e2e

    with user_errors():
        index, count = _shard(shard)
    with user_errors(), _Counter("records") as counter:
        report = convert_wod_e2e(
            src,
            out,
            image_root,
            overwrite=overwrite,
            on_item=counter.add,
            on_total=counter.total,
            shard=(index, count),
            workers=workers or usable_cpus(),
        )
    _report_conversion(out, report.samples, report.failures, report.seconds, report.kept)
    console.print(
        f"val/test frames kept without raters: {sum(report.unrated.values())}; answers derived from the future: "
        f"{report.answers_derived}"
    )
    if report.failures:
        raise typer.Exit(1)


def _shard(text: str) -> tuple[int, int]:
    """`--shard I/N` as (I, N); a DatasetError naming the value unless 0 <= I < N."""
    from fastddrive.data.dataset import DatasetError

    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if match is None or not int(match[1]) < int(match[2]):
        raise DatasetError(f"--shard must be I/N with 0 <= I < N, got {text!r}")
    return int(match[1]), int(match[2])


@data_app.command("nuscenes")
def data_nuscenes(
    dataroot: Annotated[Path, typer.Option(help="nuScenes root (the version folder, samples/, can_bus/).")],
    out: Annotated[Path, typer.Option(help="Output dataset folder.")],
    version: Annotated[str, typer.Option(help="Table folder: v1.0-mini, v1.0-trainval, v1.0-test, ...")] = "v1.0-mini",
    six_cameras: Annotated[bool, typer.Option(help="Tile the six cameras instead of CAM_FRONT alone.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing dataset in --out (once converted).")] = False,
) -> None:
    """Convert nuScenes v1.0 tables (and the CAN bus expansion) into a dataset: ego history, the future in
    the UniAD/VAD planning frame, the command by their rule, the other agents' boxes (data/nuscenes.py)."""
    from fastddrive.data.nuscenes import convert_nuscenes

    with user_errors(), _Counter("key frames") as counter:
        report = convert_nuscenes(
            dataroot,
            version,
            out,
            six_cameras=six_cameras,
            overwrite=overwrite,
            on_start=counter.total,
            on_item=counter.advance,
        )
    _report_conversion(out, report.samples, report.failures, report.seconds, report.kept)
    skipped = ", ".join(f"{reason} {n}" for reason, n in report.skipped.items()) or "none"
    velocity = ", ".join(f"{source} {n}" for source, n in report.velocity_rows.items())
    console.print(f"{report.scenes} scenes; key frames skipped: {skipped}; history velocity rows from {velocity}")
    if report.failures:
        raise typer.Exit(1)


def _report_conversion(out: Path, samples: dict[str, int], failures: list, seconds: float, kept: bool) -> None:
    counts = ", ".join(f"{split} {n}" for split, n in samples.items())
    verb = "converted" if kept else "wrote"
    console.print(f"{verb} {sum(samples.values())} samples ({counts}) in {seconds:.1f} s{'' if kept else f' to {out}'}")
    for failure in failures:
        console.print(f"[red]failed:[/] {failure}", highlight=False, soft_wrap=True)
    if kept:
        console.print(
            f"[red]{len(failures)} failure(s): {out} still holds the complete dataset it held (a conversion with "
            "failures does not replace one); fix the source, or convert into another --out to keep this one[/]",
            highlight=False,
        )


@data_app.command("export")
def data_export(
    data: Annotated[Path, typer.Option(help="A fastddrive dataset folder.")],
    out: Annotated[Path, typer.Option(help="Output folder.")],
    format: Annotated[str, typer.Option("--format", help="wod-e2e or nuscenes.")],
    split: Annotated[str | None, typer.Option(help="One split (default: all).")] = None,
    overwrite: Annotated[
        bool, typer.Option(help="Replace an earlier export in --out (swapped in once the new one is whole).")
    ] = False,
) -> None:
    """Write a dataset in a real data set's layout (the adapters read it back; users point tools at it):
    nuScenes v1.0 tables, frames and CAN bus messages, or WOD-E2E release JSON and frames."""
    from fastddrive.data.dataset import SPLITS, DatasetError

    with user_errors():
        if format not in ("wod-e2e", "nuscenes"):
            raise DatasetError(f"unknown --format {format!r}; known: wod-e2e, nuscenes")
        if split is not None and split not in SPLITS:
            raise DatasetError(f"unknown --split {split!r}; known: {', '.join(SPLITS)}")
        with _Counter("samples") as counter:
            if format == "wod-e2e":
                from fastddrive.data.wod_e2e import export_wod_e2e

                report = export_wod_e2e(data, out, split, overwrite=overwrite, on_item=counter.advance)
            else:
                from fastddrive.data.nuscenes import export_nuscenes

                report = export_nuscenes(
                    data,
                    out,
                    splits=SPLITS if split is None else (split,),
                    overwrite=overwrite,
                    on_start=counter.total,
                    on_item=counter.advance,
                )
            written, seconds = report.samples, report.seconds
    counts = ", ".join(f"{name} {n}" for name, n in written.items())
    console.print(f"exported {sum(written.values())} samples ({counts}) in {seconds:.1f} s to {out}")


@data_app.command("show")
def data_show(
    path: Annotated[Path, typer.Argument(help="Dataset folder.")],
    split: Annotated[str, typer.Option(help="train, val or test.")] = "test",
    index: Annotated[int, typer.Option(help="Sample index within the split, 0 to its sample count - 1.")] = 0,
    png: Annotated[Path | None, typer.Option(help="Write the frame with history and future here.")] = None,
) -> None:
    """Print one sample's target JSON; optionally draw it."""
    from fastddrive.core.outputs import check_file_destination
    from fastddrive.core.prompt import user_text
    from fastddrive.core.schema import render
    from fastddrive.data.dataset import DrivingDataset
    from fastddrive.eval.plots import draw_scene

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
    explanation_budget: Annotated[
        int | None, typer.Option(help=f"Explanation token budget, 1 to {MAX_EXPLANATION_BUDGET} (default 32).")
    ] = None,
    scaffold_tokenization: Annotated[
        str, typer.Option(help="pieces (each scaffold piece alone, the embedded models') or runs (maximal runs).")
    ] = "pieces",
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the figures as JSON.")] = None,
) -> None:
    """Counts per scenario, meta-behaviour distribution, explanation truncations, the scaffold table; an
    incomplete data set is said to be so (its figures cover what is written)."""
    from fastddrive.core.outputs import check_file_destination, write_json
    from fastddrive.core.scaffold import DEFAULT_EXPLANATION_BUDGET, SCAFFOLD_TOKENIZATIONS, Scaffold
    from fastddrive.core.tokenizer import default_tokenizer_path, load_tokenizer
    from fastddrive.data.dataset import DrivingDataset
    from fastddrive.data.episodes import DataSettingsError
    from fastddrive.data.stats import dataset_stats

    with user_errors():
        if explanation_budget is not None and not 1 <= explanation_budget <= MAX_EXPLANATION_BUDGET:
            raise DataSettingsError(
                f"--explanation-budget {explanation_budget} is out of range: give 1 to {MAX_EXPLANATION_BUDGET} tokens"
            )
        if scaffold_tokenization not in SCAFFOLD_TOKENIZATIONS:
            raise DataSettingsError(
                f"unknown --scaffold-tokenization {scaffold_tokenization!r}; known: {', '.join(SCAFFOLD_TOKENIZATIONS)}"
            )
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
        unfinished = f" (incomplete data set: {stats.unfinished})" if stats.unfinished else ""
        console.print(f"{path} holds no samples{unfinished}", markup=False, highlight=False)
        raise typer.Exit(1)
    for renderable in stats.renderables():
        console.print(renderable)
    if json_out is not None:
        write_json(json_out, stats.to_json())
        console.print(f"wrote {json_out}")
