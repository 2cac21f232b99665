"""The `fastddrive` command line: one module per command group, each a thin shell over library functions."""

from __future__ import annotations

from fastddrive.cli import data, drive, evaluate, models, plan, pvf, serve, submit, tokenizer, train  # noqa: F401
from fastddrive.cli.common import app


def main() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars would break the rich progress
    app()


__all__ = ["app", "main"]
