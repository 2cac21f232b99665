"""The token-level response template: frozen scaffold, value slots, NULL padding, section-aligned blocks.

Paper 000 section 3.2 ("Scaffold Construction and Section-Aligned Blocks"), DESIGN section 4. For a
given tokenizer the response text of `schema.render_pieces` is tokenized piecewise: scaffold pieces
(keys, quotes, braces, the decimal point) once, each value slot separately with a fixed token budget
padded with <|NULL|>. Every response then has the same length and the same scaffold ids, so a decoder
only predicts value positions and whatever it writes rebuilds into valid JSON.

`scaffold_tokenization` says how the scaffold text is cut: "pieces" (the default, and what the embedded
checkpoints were trained on) tokenizes each scaffold piece alone; "runs" tokenizes every maximal run of
adjacent scaffold pieces as one text, so BPE merges across piece boundaries (`"` + `,` -> `",`) as it does in
the whole JSON text, and the scaffold ids come as close to the tokenization of the whole answer as fixed value
slots allow. "release" is the official checkpoint's layout (`core.release_answer`): the release's answer text
tokenized as one text, value positions found by character offsets, a 192-token explanation, meta-behaviour
phrases, and blocks counted over value positions. A checkpoint must be decoded with the layout it was trained
with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from fastddrive.core.release_answer import META_TOKEN_LIMIT, parse_release, release_pieces, release_slot_choices
from fastddrive.core.schema import (
    LATERAL_BEHAVIORS,
    LONGITUDINAL_BEHAVIORS,
    SECTIONS,
    DrivingResponse,
    Piece,
    ResponseError,
    SpecialTokenText,
    from_slot_values,
    render_pieces,
    slot_choices,
)
from fastddrive.core.schema import example_response as _example_response
from fastddrive.core.tokenizer import diffusion_token_ids

DEFAULT_EXPLANATION_BUDGET = 32  # the longest simulator explanation is 20 tokens; the release uses 192
DEFAULT_BLOCK_SIZE = 32
ScaffoldTokenization = Literal["pieces", "runs", "release"]
SCAFFOLD_TOKENIZATIONS: tuple[str, ...] = ("pieces", "runs", "release")
# a meta phrase of 3 tokens, the quotes around it and the `},` after it (release_pieces)
RELEASE_META_BUDGET = META_TOKEN_LIMIT + 3
DEFAULT_SCAFFOLD_TOKENIZATION: ScaffoldTokenization = "pieces"  # the embedded checkpoints' scaffold ids


class SlotOverflow(ValueError):
    """A value that needs more tokens than its slot's budget."""


class LayoutError(ValueError):
    """A tokenizer that merges text across the cuts of the release layout, so that its scaffold ids would not
    be the same in every answer."""


@dataclass(frozen=True)
class Slot:
    """One value slot: `budget` consecutive positions from `start`, unused ones holding <|NULL|>."""

    name: str
    section: str
    start: int
    budget: int

    @property
    def end(self) -> int:
        return self.start + self.budget


@dataclass(frozen=True)
class Block:
    """Positions [start, end) of one block; a block never spans two sections."""

    start: int
    end: int
    section: str

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class EncodedResponse:
    """Target ids of a response, and the response they encode (the explanation possibly cut)."""

    ids: list[int]
    response: DrivingResponse
    truncated: bool


@dataclass(frozen=True)
class SectionCount:
    """One row of the paper's Table 1: positions of a section and how many the model predicts."""

    section: str
    positions: int
    scaffold: int
    values: int

    @property
    def value_share(self) -> float:
        return self.values / self.positions


class Scaffold:
    """The response template of one tokenizer (computed once; immutable).

    `explanation_budget` is the token budget of the free-text explanation; every other slot gets the
    largest token count of any text it can hold (the release's meta phrases `RELEASE_META_BUDGET`), unless
    `budgets` overrides it by slot name. `scaffold_tokenization` is "pieces" (each scaffold piece alone), "runs"
    (maximal runs of adjacent scaffold pieces together; a token spanning two sections counts in the one it starts
    in) or "release" (the release's text as one; `core.release_answer`).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        explanation_budget: int = DEFAULT_EXPLANATION_BUDGET,
        budgets: Mapping[str, int] | None = None,
        scaffold_tokenization: ScaffoldTokenization = DEFAULT_SCAFFOLD_TOKENIZATION,
    ) -> None:
        if scaffold_tokenization not in SCAFFOLD_TOKENIZATIONS:
            raise ValueError(
                f"scaffold_tokenization must be one of {SCAFFOLD_TOKENIZATIONS}, got {scaffold_tokenization!r}"
            )
        self.tokenizer = tokenizer
        self.scaffold_tokenization = scaffold_tokenization
        self.release = scaffold_tokenization == "release"
        self.pieces_of = release_pieces if self.release else render_pieces
        self.choices_of = release_slot_choices if self.release else slot_choices
        self.special_texts = tuple(tokenizer.get_added_vocab())
        ids = diffusion_token_ids(tokenizer)
        self.mask_id, self.null_id = ids.mask_id, ids.null_id
        overrides = dict(budgets or {})
        overrides.setdefault("explanation", explanation_budget)
        if self.release:
            for slot in ("future_meta_behavior.longitudinal", "future_meta_behavior.lateral"):
                overrides.setdefault(slot, RELEASE_META_BUDGET)

        template: list[int] = []
        sections: list[int] = []
        is_value: list[bool] = []
        slots: list[Slot] = []
        longest: dict[tuple[str, ...], int] = {}
        self._scaffold_runs: list[list[int]] = []  # the ids of every scaffold run, in order (release encode checks)
        for run, tokens in self._tokenized(self.pieces_of(_example_response())):
            piece = run[0]
            if piece.slot is None:
                self._scaffold_runs.append([token for token, _ in tokens])
                for token, section in tokens:
                    template.append(token)
                    sections.append(SECTIONS.index(section))
                    is_value.append(False)
            else:
                budget = overrides.pop(piece.slot, None)
                if budget is None:
                    choices = self.choices_of(piece.slot)
                    if choices not in longest:
                        longest[choices] = max(len(self._tokens(c)) for c in choices)
                    budget = longest[choices]
                if budget < 1:
                    raise ValueError(f"slot {piece.slot!r} needs a budget of at least 1 token, got {budget}")
                slots.append(Slot(piece.slot, piece.section, len(template), budget))
                template += [self.mask_id] * budget
                is_value += [True] * budget
                sections += [SECTIONS.index(piece.section)] * budget
        if overrides:
            raise KeyError(f"budgets name unknown slots: {', '.join(sorted(overrides))}")

        self.template_ids = np.asarray(template, dtype=np.int64)
        self.is_value = np.asarray(is_value, dtype=bool)
        self.section_index = np.asarray(sections, dtype=np.int64)
        self.slots: tuple[Slot, ...] = tuple(slots)
        self.explanation_budget = explanation_budget
        self._masks: dict[tuple[int, str], torch.Tensor] = {}
        if (np.diff(self.section_index) < 0).any():
            raise AssertionError("sections are not contiguous in the rendered template")

    def __len__(self) -> int:
        return len(self.template_ids)

    def _tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _tokenized(self, pieces: Sequence[Piece]) -> list[tuple[list[Piece], list[tuple[int, str]]]]:
        """The pieces grouped into runs (a value slot alone; scaffold pieces alone, or adjacent ones together),
        each with the (id, section) of its tokens: a slot's own tokens in "pieces" and "runs" (its text alone),
        in "release" the tokens of the whole text that start in the run (LayoutError where one reaches past)."""
        runs = _runs(pieces, joined=self.scaffold_tokenization != "pieces")
        if not self.release:
            return [(run, self._scaffold_tokens(run) if run[0].slot is None else []) for run in runs]
        text = "".join(p.text for p in pieces)
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        piece_ends = np.cumsum([len(p.text) for p in pieces])
        run_ends = np.cumsum([sum(len(p.text) for p in run) for run in runs])
        out: list[tuple[list[Piece], list[tuple[int, str]]]] = [(run, []) for run in runs]
        for token, (start, end) in zip(encoding.input_ids, encoding.offset_mapping, strict=True):
            k = int(np.searchsorted(run_ends, start, side="right"))
            if end > run_ends[k]:
                raise LayoutError(
                    f"this tokenizer merges {text[start:end]!r} across a cut of the release layout: its scaffold "
                    "ids would differ between answers"
                )
            out[k][1].append((token, pieces[int(np.searchsorted(piece_ends, start, side="right"))].section))
        return out

    def _slot_ids(self, response: DrivingResponse) -> dict[str, list[int]]:
        """The ids of every value slot of `response`, unpadded (LayoutError where the release layout's scaffold
        ids would come out other than the template's)."""
        pieces = self.pieces_of(response)
        if not self.release:
            return {p.slot: self._tokens(p.text) for p in pieces if p.slot is not None}
        out, scaffold_runs = {}, iter(self._scaffold_runs)
        for run, tokens in self._tokenized(pieces):
            ids = [token for token, _ in tokens]
            if run[0].slot is not None:
                out[run[0].slot] = ids
            elif ids != next(scaffold_runs):
                raise LayoutError(f"the scaffold text {run[0].text!r} tokenizes differently in this answer")
        return out

    def _scaffold_tokens(self, run: Sequence[Piece]) -> list[tuple[int, str]]:
        """(id, section) of each token of a run of scaffold pieces tokenized as one text."""
        if len(run) == 1:
            return [(t, run[0].section) for t in self._tokens(run[0].text)]
        encoding = self.tokenizer("".join(p.text for p in run), add_special_tokens=False, return_offsets_mapping=True)
        ends = np.cumsum([len(p.text) for p in run])
        sections = [
            run[int(np.searchsorted(ends, start, side="right"))].section for start, _ in encoding.offset_mapping
        ]
        return list(zip(encoding.input_ids, sections, strict=True))

    def _refuse_special_text(self, explanation: str) -> None:
        """Raise SpecialTokenText if the explanation slot text holds one of the tokenizer's added tokens."""
        if found := next((t for t in self.special_texts if t in explanation), None):
            raise SpecialTokenText(
                f"explanation: contains {found!r}, the text of a special token of this tokenizer, "
                "which the token scaffold cannot carry as text"
            )

    @staticmethod
    def _refuse_free_meta(response: DrivingResponse) -> None:
        """ResponseError for a meta-behaviour phrase kept verbatim from a release answer: only the release layout
        has room for free text there."""
        meta = response.future_meta_behavior
        for what, value, known in (
            ("longitudinal", meta.longitudinal, LONGITUDINAL_BEHAVIORS),
            ("lateral", meta.lateral, LATERAL_BEHAVIORS),
        ):
            if value not in known:
                raise ResponseError(
                    f"future_meta_behavior.{what}: {value!r} is a phrase outside the vocabulary, which only the "
                    "release layout carries"
                )

    def _text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @cached_property
    def section_spans(self) -> dict[str, tuple[int, int]]:
        """Positions [start, end) of each section."""
        spans = {}
        for k, name in enumerate(SECTIONS):
            where = np.flatnonzero(self.section_index == k)
            spans[name] = (int(where[0]), int(where[-1]) + 1)
        return spans

    @cached_property
    def allowed_ids(self) -> list[np.ndarray | None]:
        """Per position, the token ids its slot can hold there (<|NULL|> where a shorter value pads), or
        None (scaffold and the free-text explanation). MDM decoders keep their drafts inside these."""
        allowed: list[np.ndarray | None] = [None] * len(self)
        per_choices: dict[tuple[str, ...], list[np.ndarray]] = {}
        for slot in self.slots:
            choices = self.choices_of(slot.name)
            if choices is None:
                continue
            if choices not in per_choices:
                tokenized = [self._tokens(c) for c in choices]
                per_choices[choices] = [
                    np.unique([t[j] if j < len(t) else self.null_id for t in tokenized]) for j in range(slot.budget)
                ]
            allowed[slot.start : slot.end] = per_choices[choices]
        return allowed

    def allowed_mask(self, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """`allowed_ids` as a boolean (positions, vocab_size) tensor, True where a token may stand; cached."""
        key = (vocab_size, str(device))
        if key not in self._masks:
            mask = torch.ones(len(self), vocab_size, dtype=torch.bool)
            for position, allowed in enumerate(self.allowed_ids):
                if allowed is not None:
                    mask[position] = False
                    mask[position, torch.as_tensor(allowed)] = True
            self._masks[key] = mask.to(device)
        return self._masks[key]

    def blocks(self, block_size: int = DEFAULT_BLOCK_SIZE) -> list[Block]:
        """Section-aligned blocks: each section cut into consecutive blocks of at most `block_size` positions,
        or in the release layout of at most `block_size` value positions (the scaffold before a value joins
        its block, the scaffold closing a section the section's last block)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        out = []
        for name, (start, end) in self.section_spans.items():
            if not self.release:
                out += [Block(s, min(s + block_size, end), name) for s in range(start, end, block_size)]
                continue
            values = start + np.flatnonzero(self.is_value[start:end])
            cuts = [start, *(int(p) + 1 for p in values[block_size - 1 : -1 : block_size]), end]
            out += [Block(a, b, name) for a, b in zip(cuts, cuts[1:], strict=False)]
        return out

    def encode(self, response: DrivingResponse) -> EncodedResponse:
        """Target ids of `response` in this layout.

        An explanation longer than its budget is cut at a word boundary (`truncated`); any other
        value that does not fit raises SlotOverflow naming the slot. An explanation holding a special token's
        text raises SpecialTokenText.
        """
        ids = self.template_ids.copy()
        truncated = False
        self._refuse_special_text(response.explanation)
        if not self.release:
            self._refuse_free_meta(response)
        values = self._slot_ids(response)
        for slot in self.slots:
            tokens = values[slot.name]
            if len(tokens) > slot.budget:
                if slot.name != "explanation":
                    text, need = self._text(tokens), len(tokens)
                    raise SlotOverflow(f"slot {slot.name!r}: {text!r} needs {need} tokens, budget is {slot.budget}")
                tokens = self._fit_words(response, slot.budget)
                truncated = True
            ids[slot.start : slot.start + len(tokens)] = tokens
            ids[slot.start + len(tokens) : slot.end] = self.null_id
        ids_list = ids.tolist()
        encoded = self.decode(ids_list) if truncated else response
        return EncodedResponse(ids_list, encoded, truncated)

    def _fit_words(self, response: DrivingResponse, budget: int) -> list[int]:
        """Slot ids of the longest word prefix of the explanation that fits the budget."""
        words = response.explanation.split(" ")
        lo, hi = 0, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self._explanation_ids(response, " ".join(words[:mid]))) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return self._explanation_ids(response, " ".join(words[:lo]))

    def _explanation_ids(self, response: DrivingResponse, explanation: str) -> list[int]:
        return self._slot_ids(response.model_copy(update={"explanation": explanation}))["explanation"]

    def slot_texts(self, ids: Sequence[int]) -> dict[str, str]:
        """The text of every value slot in `ids`, NULL padding stripped."""
        self._check_length(ids)
        return {s.name: self._text([t for t in ids[s.start : s.end] if t != self.null_id]) for s in self.slots}

    def decode(self, ids: Sequence[int]) -> DrivingResponse:
        """Rebuild the response from a full id sequence; raises ResponseError naming a bad slot (a
        SpecialTokenText where the explanation holds a special token)."""
        if self.release:
            response = parse_release(self.text(ids))
            self._refuse_special_text(response.explanation)
            return response
        texts = self.slot_texts(ids)
        self._refuse_special_text(texts["explanation"])
        return from_slot_values(texts)

    def text(self, ids: Sequence[int]) -> str:
        """The response text of a full id sequence, NULL padding stripped."""
        self._check_length(ids)
        return self._text([t for t in ids if t != self.null_id])

    def _check_length(self, ids: Sequence[int]) -> None:
        if len(ids) != len(self):
            raise ResponseError(f"expected {len(self)} response ids for this scaffold, got {len(ids)}")

    def table(self) -> list[SectionCount]:
        """The paper's Table 1 for this tokenizer: positions, scaffold and values per section, then all."""
        rows = []
        for k, name in enumerate(SECTIONS):
            in_section = self.section_index == k
            values = int((self.is_value & in_section).sum())
            rows.append(SectionCount(name, int(in_section.sum()), int(in_section.sum()) - values, values))
        values = int(self.is_value.sum())
        rows.append(SectionCount("all", len(self), len(self) - values, values))
        return rows


def _runs(pieces: Sequence[Piece], joined: bool) -> list[list[Piece]]:
    """The pieces grouped for tokenization: each alone, or (`joined`) adjacent scaffold pieces together."""
    runs: list[list[Piece]] = []
    for piece in pieces:
        if joined and runs and piece.slot is None and runs[-1][-1].slot is None:
            runs[-1].append(piece)
        else:
            runs.append([piece])
    return runs
