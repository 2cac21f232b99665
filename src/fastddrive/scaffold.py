"""The token-level response template: frozen scaffold, value slots, NULL padding, section-aligned blocks.

Paper 000 section 3.2 ("Scaffold Construction and Section-Aligned Blocks"), DESIGN section 4. For a
given tokenizer the response text of `schema.render_pieces` is tokenized piecewise: scaffold pieces
(keys, quotes, braces, the decimal point) once, each value slot separately with a fixed token budget
padded with <|NULL|>. Every response then has the same length and the same scaffold ids, so a decoder
only predicts value positions and whatever it writes rebuilds into valid JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from fastddrive.schema import SECTIONS, DrivingResponse, ResponseError, from_slot_values, render_pieces, slot_choices
from fastddrive.schema import example_response as _example_response
from fastddrive.tokenizer import diffusion_token_ids

DEFAULT_EXPLANATION_BUDGET = 32  # the longest simulator explanation is 20 tokens; the release uses 192
DEFAULT_BLOCK_SIZE = 32


class SlotOverflow(ValueError):
    """A value that needs more tokens than its slot's budget."""


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
    largest token count of any text it can hold, unless `budgets` overrides it by slot name.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        explanation_budget: int = DEFAULT_EXPLANATION_BUDGET,
        budgets: Mapping[str, int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        ids = diffusion_token_ids(tokenizer)
        self.mask_id, self.null_id = ids.mask_id, ids.null_id
        overrides = dict(budgets or {})
        overrides.setdefault("explanation", explanation_budget)

        template: list[int] = []
        sections: list[int] = []
        is_value: list[bool] = []
        slots: list[Slot] = []
        longest: dict[tuple[str, ...], int] = {}
        for piece in render_pieces(_example_response()):
            section = SECTIONS.index(piece.section)
            if piece.slot is None:
                piece_ids = self._tokens(piece.text)
                template += piece_ids
                is_value += [False] * len(piece_ids)
            else:
                budget = overrides.pop(piece.slot, None)
                if budget is None:
                    choices = slot_choices(piece.slot)
                    if choices not in longest:
                        longest[choices] = max(len(self._tokens(c)) for c in choices)
                    budget = longest[choices]
                if budget < 1:
                    raise ValueError(f"slot {piece.slot!r} needs a budget of at least 1 token, got {budget}")
                slots.append(Slot(piece.slot, piece.section, len(template), budget))
                template += [self.mask_id] * budget
                is_value += [True] * budget
                piece_ids = [self.mask_id] * budget
            sections += [section] * len(piece_ids)
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
            choices = slot_choices(slot.name)
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
        """Section-aligned blocks: each section cut into consecutive blocks of at most `block_size`."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        out = []
        for name, (start, end) in self.section_spans.items():
            out += [Block(s, min(s + block_size, end), name) for s in range(start, end, block_size)]
        return out

    def encode(self, response: DrivingResponse) -> EncodedResponse:
        """Target ids of `response` in this layout.

        An explanation longer than its budget is cut at a word boundary (`truncated`); any other
        value that does not fit raises SlotOverflow naming the slot.
        """
        ids = self.template_ids.copy()
        truncated = False
        values = {p.slot: p.text for p in render_pieces(response) if p.slot is not None}
        for slot in self.slots:
            tokens = self._tokens(values[slot.name])
            if len(tokens) > slot.budget:
                if slot.name != "explanation":
                    raise SlotOverflow(
                        f"slot {slot.name!r}: {values[slot.name]!r} needs {len(tokens)} tokens, budget is {slot.budget}"
                    )
                tokens = self._fit_words(response.explanation, slot.budget)
                truncated = True
            ids[slot.start : slot.start + len(tokens)] = tokens
            ids[slot.start + len(tokens) : slot.end] = self.null_id
        ids_list = ids.tolist()
        encoded = self.decode(ids_list) if truncated else response
        return EncodedResponse(ids_list, encoded, truncated)

    def _fit_words(self, explanation: str, budget: int) -> list[int]:
        """Tokens of the longest word prefix of the explanation that fits the budget."""
        words = explanation.split(" ")
        lo, hi = 0, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self._escaped_tokens(" ".join(words[:mid]))) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return self._escaped_tokens(" ".join(words[:lo]))

    def _escaped_tokens(self, explanation: str) -> list[int]:
        probe = _example_response().model_copy(update={"explanation": explanation})
        text = next(p.text for p in render_pieces(probe) if p.slot == "explanation")
        return self._tokens(text)

    def slot_texts(self, ids: Sequence[int]) -> dict[str, str]:
        """The text of every value slot in `ids`, NULL padding stripped."""
        self._check_length(ids)
        return {s.name: self._text([t for t in ids[s.start : s.end] if t != self.null_id]) for s in self.slots}

    def decode(self, ids: Sequence[int]) -> DrivingResponse:
        """Rebuild the response from a full id sequence; raises ResponseError naming a bad slot."""
        return from_slot_values(self.slot_texts(ids))

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
