"""`fastddrive pvf calibrate`: Plan-Verify-Fill's planning vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from fastddrive.cli.common import console, progress_bar, pvf_app, user_errors


@pvf_app.command("calibrate")
def pvf_calibrate(
    model: Annotated[str, typer.Option(help="'default' or a local block-diffusion model folder.")] = "default",
    data: Annotated[Path, typer.Option(help="Dataset folder.")] = Path("runs/sim"),
    split: Annotated[str, typer.Option(help="The calibration split: train, val or test.")] = "val",
    samples: Annotated[
        int | None, typer.Option(min=1, max=100_000, help="Calibrate on the first N scenes (default: all).")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Where to write the vocabulary (a .json file, or a folder for pvf_vocabulary.json); default: the "
            "model's folder, which a model shipped in the package ('default', ...) never is: give --out for one."
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, ...")] = "cpu",
) -> None:
    """Choose the planning vocabulary of `pvf`: run the base decoder on a split and keep the tokens whose
    drafts in the calibration band verify often and cut uncertainty (paper 001 Appendix A.2)."""
    from fastddrive.eval.pvf_calibration import calibrate_split

    progress = progress_bar()
    task = progress.add_task("calibrating", total=None, note="scenes")

    def advance(done: int, total: int) -> None:
        progress.start()  # at the first scene: every check and the model load came before
        progress.update(task, completed=done, total=total)

    try:
        with user_errors():
            vocabulary, path = calibrate_split(
                model, data, split, out=out, samples=samples, device=device, progress=advance
            )
    finally:
        if progress.live.is_started:  # stopping a bar never shown would print an empty line
            progress.stop()
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
