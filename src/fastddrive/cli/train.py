"""`fastddrive train` and `fastddrive trajectories` (the Jacobi Forcing teacher's trajectories)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fastddrive.cli.common import app, console, progress_bar, user_errors


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
    resume: Annotated[
        bool,
        typer.Option(
            help="Continue from the last valid checkpoint in --out (a damaged one is reported and the one before "
            "it used); refused if it was trained on another data set or config."
        ),
    ] = False,
    resume_with_changes: Annotated[
        bool,
        typer.Option(
            "--resume-with-changes",
            help="Resume (as --resume) although the data set or the config differ from those the checkpoint "
            "was trained with; the changes are listed.",
        ),
    ] = False,
    estimate_only: Annotated[
        bool, typer.Option("--estimate-only", help="Print the memory estimate per process and stop.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="With --estimate-only: the estimate as JSON.")] = False,
    ignore_memory_estimate: Annotated[
        bool,
        typer.Option(
            "--ignore-memory-estimate", help="Train although the estimate exceeds the memory budget of the device."
        ),
    ] = False,
) -> None:
    """Train with the AR, SASD or Jacobi Forcing recipe; checkpoints are atomic and checksummed, --resume continues
    exactly. Stops at the first non-finite loss (exit status 2), keeping the last checkpoint. The memory a process
    will hold is estimated and printed first; a run over the device's budget is refused (exit status 2)."""
    import json

    from fastddrive.train.config import load_config
    from fastddrive.train.loop import train, training_memory

    with user_errors():
        settings = load_config(
            preset,
            config,
            out=str(out) if out else None,
            data=str(data) if data else None,
            steps=steps,
            init_from=init_from,
        )
        if estimate_only:
            estimate = training_memory(settings)
            console.print_json(json.dumps(estimate.to_json())) if as_json else console.print(estimate.line())
            return
    progress = progress_bar()
    task = progress.add_task(settings.name, total=settings.steps, note="")

    def on_step(step: int, total: int, metrics: dict[str, float]) -> None:
        if not progress.live.is_started:
            progress.start()
            progress.update(task, completed=step - 1)
        noisy, clean = ("consistency", "AR") if settings.recipe == "jf" else ("noisy", "clean")
        note = f"loss {metrics['loss']:.3f} ({noisy} {metrics['noisy_loss']:.3f}, {clean} {metrics['clean_loss']:.3f}"
        note += f", labelled {metrics['labelled_loss']:.3f})" if "labelled_loss" in metrics else ")"
        if "tokens_per_s" in metrics:
            note += (
                f" | {metrics['tokens_per_s']:.0f} tok/s, {metrics['samples_per_s']:.2f} samples/s, "
                f"peak {metrics['peak_memory_gib']:.1f} GiB"
            )
        if "val_ade5" in metrics:
            progress.console.print(
                f"step {step}: val loss {metrics['val_loss']:.3f}, greedy-AR ADE@3s {metrics['val_ade3']:.2f} m, "
                f"ADE@5s {metrics['val_ade5']:.2f} m, invalid {metrics['val_invalid']}"
            )
        progress.update(task, completed=step, note=note)

    try:
        with user_errors():
            report = train(
                settings,
                resume=resume or resume_with_changes,
                on_step=on_step,
                say=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True),
                allow_changes=resume_with_changes,
                check_memory=not ignore_memory_estimate,
            )
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
    progress = progress_bar()
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
