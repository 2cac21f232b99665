"""`fastddrive drive`: closed-loop driving in the simulator."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from fastddrive.cli.common import app, console, progress_bar, user_errors


@app.command("drive")
def drive_command(
    model: Annotated[
        str, typer.Option(help="'default', 'default-ar', 'default-jf' or a local model folder.")
    ] = "default",
    decoders: Annotated[str, typer.Option(help="Comma-separated decoders, options as sd:tau=0.0.")] = "ar,ss,sd,tts",
    scenarios: Annotated[str, typer.Option(help="Comma-separated scenarios.")] = (
        "highway,merge,exit,roundabout,intersection"
    ),
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
        typer.Option(help="measured, zero, fixed:MS, or fixed:ar=MS,ss=MS,... one value per decoder (MS: 0 to 60000)."),
    ] = "measured",
    replan_s: Annotated[
        float, typer.Option("--replan-s", help="Simulated seconds between questions (a multiple of 0.25, at most 5).")
    ] = 0.5,
    duration_s: Annotated[
        float | None,
        typer.Option(
            "--duration-s", help="Episode length in simulated seconds, over 3.25 and at most 300 (default 40, 25)."
        ),
    ] = None,
    references: Annotated[
        bool, typer.Option(help="Also drive the expert (in the seat and as a planner) and constant velocity.")
    ] = True,
    device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
    out: Annotated[
        Path, typer.Option(help="Folder of the per-episode results (a re-run resumes) and summary.png.")
    ] = Path("runs/drive"),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the rows as JSON.")] = None,
    video: Annotated[Path | None, typer.Option(help="Write one GIF per episode into this folder.")] = None,
) -> None:
    """Closed-loop driving in highway-env, each decoder's latency charged to the simulation clock.

    Every setting and the places written (--out, --video, --json) are checked before anything is loaded or
    driven; an episode that fails is reported, the others complete, and the exit status is 1."""
    from fastddrive.core.outputs import check_file_destination, write_json
    from fastddrive.drive.run import check_settings, run_drive, title
    from fastddrive.drive.summary import rows_table, scenario_table
    from fastddrive.engine.model_files import model_path

    with user_errors():
        if json_out is not None:
            check_file_destination(json_out, "--json", suffixes=(".json",), inputs=(model_path(model),), owned=(out,))
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
    progress = progress_bar()
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
        console.print(
            f"[red]{len(report.failures)} episode(s) failed (above); the others are kept in {out}, and the same "
            "command drives only the failed ones again[/]"
        )
        raise typer.Exit(1)
