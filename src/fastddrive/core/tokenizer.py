"""Tokenizers: train the embedded byte-level BPE, load any local one, add the diffusion tokens.

The embedded tokenizer uses Qwen2's exact pre-tokenization (NFC, the Qwen2 split regex that isolates
every digit, byte-level BPE) and is saved as a `Qwen2Tokenizer`, the class a real Qwen2.5-VL
checkpoint uses, so both load through `AutoTokenizer.from_pretrained(local_dir)`.
`qwen25vl_tokenizer` rebuilds the real Qwen2.5-VL tokenizer offline from its BPE ranks (`qwen.tiktoken`).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen2Tokenizer

from fastddrive.core.outputs import OutputError, check_folder_destination, staged_folder

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
# Qwen2.5-VL's added tokens, ids 151643.. in this order (its tokenizer_config.json); the first 14 are special.
QWEN25VL_ADDED_TOKENS: tuple[str, ...] = (
    END_OF_TEXT,
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
QWEN25VL_SPECIAL_COUNT = 14
QWEN25VL_BPE_RANKS = 151_643
# What `save_pretrained` writes for a tokenizer: a folder holding only these may be replaced by a new one.
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
    }
)


class MissingDiffusionTokens(ValueError):
    """A tokenizer (and so a checkpoint) that was never given |<MASK>| and <|NULL|>."""


class TokenizerError(ValueError):
    """A tokenizer folder whose files are damaged: the message (one line) names the file."""


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


def check_tokenizer_destination(out: Path | str, option: str, inputs: Iterable[Path | str | None] = ()) -> Path:
    """`out` may receive a tokenizer: a folder (`outputs.check_folder_destination`) that is new, empty or holds
    only tokenizer files, since saving replaces it whole. Checked before training."""
    out = check_folder_destination(out, option, inputs=inputs)
    if out.is_dir():
        others = sorted(p.name for p in out.iterdir() if p.name not in TOKENIZER_FILES)
        if others:
            raise OutputError(
                f"{option} {out}: it holds {others[0]}, which is not a tokenizer file; give a new or empty folder"
            )
    return out


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out: Path | str) -> None:
    """Save atomically: the files are written to a folder beside `out`, flushed, and swapped in whole."""
    with staged_folder(out) as staging:
        tokenizer.save_pretrained(str(staging))
        for file in staging.iterdir():
            with file.open("rb") as handle:
                os.fsync(handle.fileno())


def default_tokenizer_path() -> Path:
    """The tokenizer that ships inside the package (trained by `fastddrive tokenizer train`)."""
    return Path(str(files("fastddrive") / "assets" / "tokenizer"))


def corpus_texts(rows: Iterable[Mapping[str, Any]], vocabulary_repeats: int = 20) -> Iterator[str]:
    """Training texts from dataset rows (command, history, response): prompts and answers.

    The schema's own vocabulary (every class and behaviour name) is added `vocabulary_repeats` times, so
    that values a dataset happens not to contain (reverse, overtake, ...) still get compact tokens.
    """
    import numpy as np

    from fastddrive.core.prompt import SYSTEM_PROMPT, user_text
    from fastddrive.core.schema import CRITICAL_OBJECT_CLASSES, LATERAL_BEHAVIORS, LONGITUDINAL_BEHAVIORS

    yield SYSTEM_PROMPT
    for _ in range(vocabulary_repeats):
        yield from (f'"{word}"' for word in (*CRITICAL_OBJECT_CLASSES, *LONGITUDINAL_BEHAVIORS, *LATERAL_BEHAVIORS))
    for row in rows:
        history = np.asarray(row["history"], dtype=float).reshape(7, 6)
        yield user_text(row["command"], history)
        yield row["response"]


def _json_object(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise TokenizerError(f"{file} is not UTF-8 text; it must be a JSON object") from None
    except (ValueError, RecursionError) as err:
        raise TokenizerError(f"{file} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{file} is not a JSON object")
    return value


def check_tokenizer_files(path: Path) -> None:
    """The files a tokenizer loads from are there and have the shape transformers reads: one line naming the
    file otherwise (transformers' own errors name neither the file nor the problem: "'added_tokens'")."""
    if not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path} holds no tokenizer (tokenizer_config.json is missing)")
    _json_object(path / "tokenizer_config.json")
    file = path / "tokenizer.json"
    if file.is_file():
        backend = _json_object(file)
        for key, kind in (("model", dict), ("added_tokens", list)):
            if not isinstance(backend.get(key), kind):
                what = "object" if kind is dict else "list"
                raise TokenizerError(f"{file} is not a tokenizer: its {key!r} entry is missing or not a JSON {what}")
    elif not (path / "vocab.json").is_file() or not (path / "merges.txt").is_file():
        raise TokenizerError(f"{path} holds no tokenizer.json (nor vocab.json and merges.txt)")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local folder, after `check_tokenizer_files`; never reaches the network."""
    path = Path(path)
    check_tokenizer_files(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - whatever transformers makes of damaged files, they are damaged
        raise TokenizerError(f"{path}: the tokenizer could not be loaded: {str(err).splitlines()[0]}") from None
    if len(tokenizer) == 0:
        raise TokenizerError(f"{path}: the tokenizer has an empty vocabulary")
    return tokenizer


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


def read_bpe_ranks(path: str | Path) -> dict[bytes, int]:
    """A tiktoken BPE ranks file (one `base64(token) rank` per line) as {token bytes: rank}."""
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def bpe_merges(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merges that rebuild BPE ranks, in rank order (as transformers' `TikTokenConverter` recovers them):
    every split of a token into two tokens, ordered by the token's rank and then by the ranks of its halves."""
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, ranks[a], ranks[b], a, b) for a, b in splits]
    return [(a, b) for *_, a, b in sorted(merges)]


def qwen25vl_tokenizer(ranks_path: str | Path, diffusion_tokens: bool = True) -> Qwen2Tokenizer:
    """The real Qwen2.5-VL tokenizer rebuilt offline from its BPE ranks file `qwen.tiktoken`.

    Byte-level BPE over the 151,643 ranks with Qwen2's NFC normalization and split regex (one digit per
    token), the 22 added tokens at ids 151643-151664, `<|im_end|>` as eos and `<|endoftext|>` as pad, as in
    Qwen2.5-VL's tokenizer_config.json; then |<MASK>| and <|NULL|> (151665, 151666) as `add_diffusion_tokens`
    gives them to any checkpoint (paper 000 section 3.2). Nothing is fetched.
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # byte -> character of byte-level BPE

    ranks = read_bpe_ranks(ranks_path)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{ranks_path}: the BPE ranks are not 0..{len(ranks) - 1} without gaps")
    byte_char = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte_char[b] for b in token)

    vocab = {text(t): r for t, r in ranks.items()}
    vocab |= {t: len(ranks) + k for k, t in enumerate(QWEN25VL_ADDED_TOKENS)}
    merges = [(text(a), text(b)) for a, b in bpe_merges(ranks)]
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>", pad_token=END_OF_TEXT, errors="replace"
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=k < QWEN25VL_SPECIAL_COUNT, normalized=False)
            for k, t in enumerate(QWEN25VL_ADDED_TOKENS)
        ]
    )
    extra = list(QWEN25VL_ADDED_TOKENS[1:QWEN25VL_SPECIAL_COUNT])
    tokenizer.add_special_tokens({"additional_special_tokens": extra}, replace_extra_special_tokens=False)
    if diffusion_tokens:
        add_diffusion_tokens(tokenizer)
    return tokenizer
