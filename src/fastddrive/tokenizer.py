"""Tokenizers: train the embedded byte-level BPE, load any local one, add the diffusion tokens.

The embedded tokenizer uses Qwen2's exact pre-tokenization (NFC, the Qwen2 split regex that isolates
every digit, byte-level BPE) and is saved as a `Qwen2Tokenizer`, the class a real Qwen2.5-VL
checkpoint uses, so both load through `AutoTokenizer.from_pretrained(local_dir)`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen2Tokenizer

# Qwen2's pre-tokenizer regex: `\p{N}` alone keeps every digit its own token.
QWEN2_SPLIT_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
END_OF_TEXT = "<|endoftext|>"
CHAT_TOKENS: tuple[str, ...] = (
    END_OF_TEXT,
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
)
MASK_TOKEN = "|<MASK>|"
NULL_TOKEN = "<|NULL|>"
DEFAULT_VOCAB_SIZE = 1024


class MissingDiffusionTokens(ValueError):
    """A tokenizer (and so a checkpoint) that was never given |<MASK>| and <|NULL|>."""


@dataclass(frozen=True)
class DiffusionTokenIds:
    """Ids of the two tokens block diffusion needs, and which of them were newly added."""

    mask_id: int
    null_id: int
    added: tuple[str, ...] = ()


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, diffusion_tokens: bool = True
) -> Qwen2Tokenizer:
    """Train a byte-level BPE on `texts` with Qwen2's pre-tokenization and special tokens.

    `diffusion_tokens=False` leaves out |<MASK>| and <|NULL|>, as in a real Qwen2.5-VL tokenizer.
    """
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    special = [*CHAT_TOKENS, MASK_TOKEN, NULL_TOKEN] if diffusion_tokens else list(CHAT_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    vocab = backend.get_vocab()
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=_merges(backend), errors="replace")
    tokenizer.add_special_tokens({"additional_special_tokens": special[1:]})
    return tokenizer


def _merges(backend: Tokenizer) -> list[tuple[str, str]]:
    merges = json.loads(backend.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]


def default_tokenizer_path() -> Path:
    """The tokenizer that ships inside the package (trained by `fastddrive tokenizer train`)."""
    return Path(str(files("fastddrive") / "assets" / "tokenizer"))


def corpus_texts(rows: Iterable[Mapping[str, Any]], vocabulary_repeats: int = 20) -> Iterator[str]:
    """Training texts from dataset rows (command, history, response): prompts and answers.

    The schema's own vocabulary (every class and behaviour name) is added `vocabulary_repeats` times, so
    that values a dataset happens not to contain (reverse, overtake, ...) still get compact tokens.
    """
    import numpy as np

    from fastddrive.prompt import SYSTEM_PROMPT, user_text
    from fastddrive.schema import CRITICAL_OBJECT_CLASSES, LATERAL_BEHAVIORS, LONGITUDINAL_BEHAVIORS

    yield SYSTEM_PROMPT
    for _ in range(vocabulary_repeats):
        yield from (f'"{word}"' for word in (*CRITICAL_OBJECT_CLASSES, *LONGITUDINAL_BEHAVIORS, *LATERAL_BEHAVIORS))
    for row in rows:
        history = np.asarray(row["history"], dtype=float).reshape(7, 6)
        yield user_text(row["command"], history)
        yield row["response"]


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local folder; never reaches the network."""
    path = Path(path)
    if not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path} holds no tokenizer (tokenizer_config.json is missing)")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def add_diffusion_tokens(tokenizer: PreTrainedTokenizerBase) -> DiffusionTokenIds:
    """Add |<MASK>| and <|NULL|> as special tokens to any HF tokenizer; report their ids.

    A real Qwen2.5-VL tokenizer lacks both; the caller must then resize the model's embeddings.
    """
    vocab = tokenizer.get_vocab()
    missing = tuple(t for t in (MASK_TOKEN, NULL_TOKEN) if t not in vocab)
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": list(missing)}, replace_extra_special_tokens=False)
    return DiffusionTokenIds(*_ids(tokenizer), added=missing)


def diffusion_token_ids(tokenizer: PreTrainedTokenizerBase) -> DiffusionTokenIds:
    """Ids of |<MASK>| and <|NULL|>; raises MissingDiffusionTokens if the tokenizer lacks them."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in (MASK_TOKEN, NULL_TOKEN) if t not in vocab]
    if missing:
        raise MissingDiffusionTokens(
            f"tokenizer has no {' or '.join(missing)} token: this checkpoint was never trained for block "
            "diffusion (train it with fastddrive first, which adds them)"
        )
    return DiffusionTokenIds(*_ids(tokenizer))


def _ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int]:
    vocab = tokenizer.get_vocab()
    return vocab[MASK_TOKEN], vocab[NULL_TOKEN]
