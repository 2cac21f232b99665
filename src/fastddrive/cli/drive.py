"""`fastddrive drive`: closed-loop driving in the simulator."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from fastddrive.cli.common import (
    DurationOption,
    ReplanOption,
    app,
    console,
    first_few,
    progress_bar,
    user_errors,
)


@app.command("drive")
def drive_command(
    model: Annotated[
        str, typer.Option(help="'default', 'default-ar', 'default-jf' or a local model folder.")
    ] = "default",
    decoders: Annotated[str, typer.Option(help="Comma-separated decoders, options as sd:tau=0.0.")] = "ar,ss,sd,tts",
    scenarios: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated scenarios, or the group 'reactive'. "
            "Default: highway,merge,exit,roundabout,intersection; with --latency sweep:..., reactive.",
            show_default=False,
        ),
    ] = None,
    episodes: Annotated[
        int, typer.Option(min=1, max=20_000, help="Episodes per scenario; every planner drives the same.")
    ] = 20,
    seed: Annotated[
        int,
        typer.Option(
            min=0, help="Episode j of scenario s uses seed * 100000 + 5 j + (s's index); 0 to 92233720368546."
        ),
    ] = 7,
    latency: Annotated[
        str,
        typer.Option(
            help="measured, zero, fixed:MS, or fixed:ar=MS,ss=MS,... one value per decoder (MS: 0 to 60000); "
            "sweep:MS,MS,... drives the episodes once per value, charged to every decoder."
        ),
    ] = "measured",
    replan_s: ReplanOption = 0.5,
    duration_s: DurationOption = None,
    references: Annotated[
        bool, typer.Option(help="Also drive the expert (in the seat and as a planner) and constant velocity.")
    ] = True,
    held_out: Annotated[
        bool,
        typer.Option(
            "--held-out",
            help="Leave out, for every planner, the episodes the model was trained on (its fastddrive.json).",
        ),
    ] = False,
    device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
    workers: Annotated[
        int,
        typer.Option(
            help="Processes driving episodes side by side, 1 to twice the CPUs this process may use; each loads "
            "its own copy of the model. One process's results, but for the times taken; not with --latency measured."
        ),
    ] = 1,
    out: Annotated[
        Path, typer.Option(help="Folder of the per-episode results (a re-run resumes) and summary.png.")
    ] = Path("runs/drive"),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the rows as JSON.")] = None,
    video: Annotated[Path | None, typer.Option(help="Write one GIF per episode into this folder.")] = None,
    plot: Annotated[
        Path | None,
        typer.Option(help="Write a PNG: driving score and collision rate against the latency charged, per decoder."),
    ] = None,
    mark: Annotated[
        str | None,
        typer.Option(help="With --plot: mark these latencies, ar=MS,ss=MS,..., instead of the measured times."),
    ] = None,
    side_by_side: Annotated[
        str | None,
        typer.Option(help="With --video: also one GIF per episode of these two planners side by side, as ar,ss."),
    ] = None,
) -> None:
    """Closed-loop driving in highway-env, each decoder's latency charged to the simulation clock.

    Every setting and the places written (--out, --video, --json, --plot) are checked before anything is loaded
    or driven; an episode that fails is reported, the others complete, and the exit status is 1."""
    from fastddrive.core.outputs import check_file_destination, write_json
    from fastddrive.drive import DriveError
    from fastddrive.drive.latency import parse_named_ms
    from fastddrive.drive.run import training_episodes_driven
    from fastddrive.drive.summary import paired_table, rows_table, scenario_table
    from fastddrive.drive.sweep import check_pair, check_sweep, run_sweep, side_by_side_videos
    from fastddrive.drive.video import SIDE_BY_SIDE
    from fastddrive.engine.model_files import model_path

    with user_errors():
        for option, path, suffix in (("--json", json_out, ".json"), ("--plot", plot, ".png")):
            if path is not None:
                check_file_destination(path, option, suffixes=(suffix,), inputs=(model_path(model),), owned=(out,))
        runs = check_sweep(
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
            held_out=held_out,
            workers=workers,
        )
        if mark is not None and plot is None:
            raise DriveError("--mark needs --plot: it marks latencies on the latency curve")
        marks = None if mark is None else parse_named_ms(mark, list(runs[0].decoders), f"--mark {mark!r}")
        pair = None if side_by_side is None else check_pair(side_by_side, runs[0])
        trained_on = training_episodes_driven(runs[0])
    total = len(runs[0].scenarios) * runs[0].episodes
    if trained_on:
        console.print(
            f"[yellow]warning:[/] {len(trained_on)} of the {total} episodes to drive are among those "
            f"{escape(model)} was trained on ({_named(trained_on)}; its fastddrive.json): their scores are not "
            "held-out figures (--json lists them; --held-out leaves them out)",
            highlight=False,
            soft_wrap=True,
        )
    if skipped := runs[0].skipped:
        console.print(
            f"held out: {len(skipped)} of the {total} episodes left out, those {escape(model)} was trained on "
            f"({_named(skipped)}; --json lists them)",
            highlight=False,
            soft_wrap=True,
        )
    progress = progress_bar()
    task = progress.add_task("episodes", total=None, note="")
    failed = []

    def on_start(settings, todo: int, done: int) -> None:
        where = "episodes"
        if len(runs) > 1:  # a sweep: which latency is being driven
            where = (
                f"latency {settings.latency.describe(settings.decoders[0])} ({runs.index(settings) + 1}/{len(runs)})"
            )
        if done:
            progress.console.print(f"resuming: {done} episode(s) already driven in {out} ({where})")
        progress.update(task, description=where, total=todo, completed=0)
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
            report = run_sweep(runs, on_start=on_start, on_episode=on_episode)
    except KeyboardInterrupt:
        progress.stop()
        console.print(f"interrupted: finished episodes are kept in {out}; rerun the same command to resume")
        raise typer.Exit(130) from None
    finally:
        progress.stop()
    console.print(rows_table(report.rows, report.title))  # it has a latency column
    console.print(scenario_table(report.shown_rows))
    if pairs := report.paired:
        console.print(paired_table(pairs))
    console.print(f"{report.seconds:.0f} s; wrote {report.summary_png}" + (f" and GIFs in {video}" if video else ""))
    if pair is not None:
        videos = side_by_side_videos(report, pair)
        console.print(f"wrote {len(videos)} side-by-side video(s) of {pair[0]} and {pair[1]} in {video / SIDE_BY_SIDE}")
    if plot is not None:
        from fastddrive.drive.latency_curve import draw_latency_curve

        console.print(f"wrote {draw_latency_curve(report.rows, plot, marks, title=report.title)}")
    if json_out is not None:
        write_json(json_out, report.to_json())
        console.print(f"wrote {json_out}")
    if report.failures:
        console.print(
            f"[red]{len(report.failures)} episode(s) failed (above); the others are kept in {out}, and the same "
            "command drives only the failed ones again[/]"
        )
        raise typer.Exit(1)


def _named(episodes: Sequence[tuple[str, int]]) -> str:
    """The first few episodes, as 'lead-brake 2300000, cut-in 2300001, ...'."""
    return first_few([f"{name} {seed}" for name, seed in episodes])
