"""`fastddrive import-official`: an official Fast-dDrive or Fast-dVLM release folder as a fastddrive model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fastddrive.cli.common import app, console, user_errors


@app.command("import-official")
def import_official_command(
    src: Annotated[Path, typer.Argument(help="The release folder (config.json, safetensors, tokenizer).")],
    out: Annotated[Path, typer.Argument(help="The fastddrive model folder to write (a new or empty folder).")],
    tokenizer: Annotated[Path | None, typer.Option(help="A Qwen2.5-VL tokenizer folder, when SRC holds none.")] = None,
) -> None:
    """Convert a release folder: config to plain Qwen2.5-VL, weights renamed only (safetensors; a pickle is never
    opened, remote code never run), |<MASK>| and <|NULL|> checked, the release's pixels and fastddrive.json.
    Anything it cannot map is refused in one line (exit status 2) before anything is written."""
    from fastddrive.engine.official import import_official

    with user_errors():
        import_official(src, out, tokenizer, say=lambda line: console.print(line, highlight=False, soft_wrap=True))
