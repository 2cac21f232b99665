"""The `fastddrive tokenizer` commands: train a tokenizer, print its scaffold table."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated

import typer

from fastddrive.cli.common import console, tokenizer_app, user_errors


@tokenizer_app.command("train")
def tokenizer_train(
    data: Annotated[Path, typer.Option(help="Dataset folder whose train split is the corpus.")],
    out: Annotated[
        Path, typer.Option(help="Folder to save the tokenizer in: new, empty or a tokenizer folder (replaced whole).")
    ],
    vocab_size: Annotated[int, typer.Option(min=300, max=200_000, help="BPE vocabulary size.")] = 1024,
) -> None:
    """Train the byte-level BPE on prompts and answers of a dataset's train split."""
    from fastddrive.core.tokenizer import check_tokenizer_destination, corpus_texts, save_tokenizer, train_tokenizer
    from fastddrive.data.dataset import DrivingDataset

    with user_errors():
        check_tokenizer_destination(out, "--out", inputs=(data,))
        table = DrivingDataset.open(data).table("train", columns=["command", "history", "response"])
    tokenizer = train_tokenizer(corpus_texts(table.to_pylist()), vocab_size=vocab_size)
    with user_errors():
        save_tokenizer(tokenizer, out)
    console.print(f"trained a {len(tokenizer)}-token tokenizer on {table.num_rows} samples; saved to {out}")


def _slot_kind(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "critical_objects":
        return "critical_objects.*"
    if parts[0] == "trajectory":
        return f"trajectory.*.{parts[-1]}"
    return name


@tokenizer_app.command("table")
def tokenizer_table(
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer folder (default: the embedded one).")] = None,
    explanation_budget: Annotated[int | None, typer.Option(help="Explanation token budget.")] = None,
    block_size: Annotated[int, typer.Option(min=1, help="Block size for the block count.")] = 32,
    scaffold_tokenization: Annotated[
        str, typer.Option(help="pieces (each scaffold piece alone, the embedded models') or runs (maximal runs).")
    ] = "pieces",
) -> None:
    """Print the scaffold table (paper 000 Table 1) and the slot budgets for a tokenizer."""
    from fastddrive.core.scaffold import DEFAULT_EXPLANATION_BUDGET, Scaffold
    from fastddrive.core.tokenizer import add_diffusion_tokens, default_tokenizer_path, load_tokenizer
    from fastddrive.data.stats import scaffold_table

    with user_errors():
        loaded = load_tokenizer(tokenizer or default_tokenizer_path())
        ids = add_diffusion_tokens(loaded)
        scaffold = Scaffold(
            loaded,
            explanation_budget=explanation_budget or DEFAULT_EXPLANATION_BUDGET,
            scaffold_tokenization=scaffold_tokenization,
        )
    if ids.added:
        console.print(f"added {', '.join(ids.added)} (ids {ids.mask_id}, {ids.null_id}) to this tokenizer")
    console.print(scaffold_table(scaffold))
    budgets = Counter((_slot_kind(s.name), s.budget) for s in scaffold.slots)
    console.print(
        "slot budgets: " + ", ".join(f"{name} {budget} x{n}" for (name, budget), n in sorted(budgets.items()))
    )
    console.print(f"blocks of at most {block_size}: {len(scaffold.blocks(block_size))}")
