"""What every command shares: the typer apps, the console, one-line errors for bad input, the progress bar."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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

app = typer.Typer(help="Fast block-diffusion driving planners.", no_args_is_help=True, add_completion=False)
data_app = typer.Typer(help="Build and inspect driving datasets.", no_args_is_help=True)
tokenizer_app = typer.Typer(help="Train and inspect tokenizers and their response scaffold.", no_args_is_help=True)
pvf_app = typer.Typer(help="Plan-Verify-Fill's offline calibration (paper 001 Appendix A.2).", no_args_is_help=True)
app.add_typer(data_app, name="data")
app.add_typer(tokenizer_app, name="tokenizer")
app.add_typer(pvf_app, name="pvf")
# Piped or logged output gets room for the wide tables instead of rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 160)

# Options that several commands share, with the same help and range.
EpisodesOption = Annotated[int, typer.Option(help="Number of episodes (one shard each), 1 to 100000.")]
EpisodeSeedOption = Annotated[
    int, typer.Option(help="Base seed, 0 to 92233720368546; episode i uses seed * 100000 + i (a 64-bit seed).")
]
ScenariosOption = Annotated[str, typer.Option(help="Comma-separated scenarios, or the group 'reactive'.")]
ReplanOption = Annotated[
    float, typer.Option("--replan-s", help="Simulated seconds between questions (a multiple of 0.25, at most 5).")
]
DurationOption = Annotated[
    float | None,
    typer.Option(
        "--duration-s", help="Episode length in simulated seconds, over 3.25 and at most 300 (default 40, 25)."
    ),
]
BuildOverwriteOption = Annotated[
    bool, typer.Option(help="Replace an existing dataset in --out (built beside it, swapped in once complete).")
]


@app.callback()
def settings(
    context: typer.Context,
    memory_budget: Annotated[
        str | None,
        typer.Option(
            help="What a command may plan to allocate: a share of the memory (0.5, the default) or an amount "
            "(8GiB); also FASTDDRIVE_MEMORY_BUDGET.",
        ),
    ] = None,
) -> None:
    """Fast block-diffusion driving planners."""
    from fastddrive.core.memory import BUDGET_ENV, machine_memory_bytes, parse_budget

    if memory_budget is not None:
        with user_errors():
            parse_budget(memory_budget, machine_memory_bytes())
        before = os.environ.get(BUDGET_ENV)
        os.environ[BUDGET_ENV] = memory_budget
        # A command run in-process (a test, a notebook) leaves the environment as it found it.
        context.call_on_close(lambda: _restore(BUDGET_ENV, before))


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@contextmanager
def user_errors() -> Iterator[None]:
    """Known bad input becomes one clear line on stderr and exit status 2, not a traceback."""
    from fastddrive.core.memory import MemoryBudgetError
    from fastddrive.core.outputs import OutputError
    from fastddrive.core.sample import SampleError
    from fastddrive.core.schema import ResponseError
    from fastddrive.core.tokenizer import MissingDiffusionTokens, TokenizerError
    from fastddrive.data.build import OutputExists
    from fastddrive.data.dataset import DatasetError
    from fastddrive.data.highway import UnknownScenario
    from fastddrive.decode.planning_vocabulary import PlanningVocabularyError
    from fastddrive.decode.registry import DecoderError
    from fastddrive.drive import DriveError
    from fastddrive.engine.model_check import ModelFileError
    from fastddrive.engine.model_files import DeviceError
    from fastddrive.engine.random_init import UnknownPreset
    from fastddrive.eval.roofline import RooflineError
    from fastddrive.eval.submission import SubmissionError
    from fastddrive.serve.guards import ListenError
    from fastddrive.serve.loadtest import LoadTestError
    from fastddrive.train.checkpoint import CheckpointError
    from fastddrive.train.config import ConfigError

    known = (
        OutputExists,
        UnknownScenario,
        DatasetError,
        SampleError,
        ResponseError,
        MissingDiffusionTokens,
        TokenizerError,
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
        ListenError,
        OutputError,
        MemoryBudgetError,
        SubmissionError,
    )
    try:
        yield
    except (*known, FileNotFoundError, IndexError) as err:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def first_few(items: Sequence[str], shown: int = 3) -> str:
    """The first `shown` items, comma-separated, with ', ...' when there are more: a long list in one line."""
    return ", ".join(items[:shown]) + (", ..." if len(items) > shown else "")


def progress_bar(disable: bool = False) -> Progress:
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
