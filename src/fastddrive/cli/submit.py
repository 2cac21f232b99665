"""`fastddrive submit` and `submit-check`: the WOD-E2E challenge archive of a split, and its check
(eval/submission.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fastddrive.cli.common import app, console, progress_bar, user_errors


@app.command("submit")
def submit_command(
    out: Annotated[Path, typer.Option(help="The archive to write: a .tar.gz of E2EDChallengeSubmission shards.")],
    account_name: Annotated[str, typer.Option(help="The challenge account's name (required).")] = "",
    method_name: Annotated[str, typer.Option(help="The method's unique name (required).")] = "",
    authors: Annotated[list[str] | None, typer.Option(help="An author (repeat for each; required).")] = None,
    affiliation: Annotated[str, typer.Option(help="The authors' affiliation (required).")] = "",
    description: Annotated[str, typer.Option(help="What the method is (required).")] = "",
    method_link: Annotated[str, typer.Option(help="A link to the method (paper, code).")] = "",
    uses_public_model_pretraining: Annotated[
        bool | None,
        typer.Option(
            "--uses-public-model-pretraining/--no-uses-public-model-pretraining",
            help="Whether the method starts from publicly released models (required).",
        ),
    ] = None,
    num_model_parameters: Annotated[str, typer.Option(help="The model's size, as 3B or 250M (required).")] = "",
    public_model_names: Annotated[
        list[str] | None, typer.Option(help="A public model the method starts from (repeat for each).")
    ] = None,
    model: Annotated[str, typer.Option(help="'default', 'default-ar' or a local model folder.")] = "default",
    data: Annotated[Path, typer.Option(help="Dataset folder (fastddrive data wod-e2e).")] = Path("runs/wod-e2e"),
    split: Annotated[str, typer.Option(help="The split to submit: test (the challenge's) or val.")] = "test",
    decoder: Annotated[str, typer.Option(help="Decoder, options as ss:block_size=32.")] = "ss",
    device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
) -> None:
    """Plan every frame of a split and write the WOD-E2E challenge archive: each answer's 5 waypoints upsampled to
    20 points at 0.25-5 s by the evaluator's JMT, an answer that does not parse replaced by constant velocity
    from the frame's history (counted). Missing required metadata is refused before planning. Interrupted, the
    same command picks up where it stopped; data parallel under `accelerate launch --num_processes N -m
    fastddrive.cli submit ...`."""
    import fastddrive
    from fastddrive.core.outputs import OutputError, check_file_destination
    from fastddrive.data.dataset import DatasetError, DrivingDataset
    from fastddrive.decode.registry import parse_decoder_spec
    from fastddrive.eval.parallel import device_of_process, is_main_process
    from fastddrive.eval.submission import SubmissionMetadata, plan_submission

    with user_errors():
        metadata = SubmissionMetadata(
            account_name,
            method_name,
            tuple(authors or ()),
            affiliation,
            description,
            method_link,
            uses_public_model_pretraining,
            num_model_parameters,
            tuple(public_model_names or ()),
        )
        metadata.check()
        if not out.name.endswith(".tar.gz"):
            raise OutputError(f"--out {out}: the challenge takes a .tar.gz; give a name ending so")
        check_file_destination(out, "--out", suffixes=(".gz",), inputs=(data,))
        name, options = parse_decoder_spec(decoder)
        dataset = DrivingDataset.open(data)
        if split not in ("train", "val", "test"):
            raise DatasetError(f"unknown --split {split!r}; known: train, val, test")
        planner = fastddrive.load(model, device=device_of_process(device))
        total = len(dataset.table(split, columns=["sample_id"]))
    settings = {"model": model, "data": str(data.resolve()), "split": split, "decoder": decoder}
    main = is_main_process()
    with progress_bar(disable=not main) as progress, user_errors():
        task = progress.add_task(f"{name} on {split}", total=total, note="")
        report = plan_submission(
            planner,
            dataset,
            split,
            name,
            options,
            metadata,
            out,
            settings,
            on_sample=lambda: progress.update(task, advance=1),
        )
    if report is None:
        return
    console.print(
        f"wrote {report.path}: {report.frames} frames in {len(report.shards)} shard(s), {report.fallbacks} given "
        f"constant velocity (answers that do not parse), {report.resumed} taken from an interrupted run, "
        f"{report.seconds:.1f} s"
    )
    for line in report.failures:
        console.print(f"[red]failed:[/] {line}", highlight=False)
    if report.failures:
        raise typer.Exit(1)


@app.command("submit-check")
def submit_check_command(
    archive: Annotated[Path, typer.Argument(help="A challenge archive (.tar.gz) to check.")],
    data: Annotated[Path, typer.Option(help="Dataset folder whose split the archive must cover.")],
    split: Annotated[str, typer.Option(help="The split.")] = "test",
) -> None:
    """Check an archive against a split: one 20-point finite prediction per frame, named by the frame, the
    submission type and required metadata set; the first problem is named (exit status 2)."""
    from fastddrive.data.dataset import DrivingDataset
    from fastddrive.eval.submission import check_submission

    with user_errors():
        names = [str(n) for n in DrivingDataset.open(data).table(split, columns=["sample_id"])["sample_id"].to_pylist()]
        count = check_submission(archive, names)
    console.print(f"{archive}: {count} predictions, one per frame of {split}; metadata complete")
