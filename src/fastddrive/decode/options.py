"""Every decoder's options, declared with their types and ranges, and checked before any work.

One pydantic model per decoder (`OPTIONS`). A value is taken either as a Python value of its type or as
the text the command line gives (`--option tau=0.5`, `sd:tau=0.0:block_size=16`), parsed strictly:

- a number: a decimal literal (`0.5`, `1`, `1e-3`); not `abc`, `nan` or `inf`; never a bool;
- an integer: an integer literal (`16`, `-1`); not `8.5` or `abc`; never a bool or a float;
- a bool: `true/false`, `yes/no` or `1/0` (any case) as text, True or False as a value; not `maybe`;
- token ids: a JSON list of at most MAX_ANSWER_TOKENS integers in [0, 2^31 - 1] (`[1, 2, 3]`), `null` for
  none (the model's own vocabulary is checked before decoding, `registry.check_drafts`);
- a path: non-empty text (the decoder reads the file, and names it when it is missing or damaged).

Every number has a lower bound (the one the decoder itself would refuse later, after the model has loaded
and the prompt is prefilled) and an upper bound (issue 32: a value no real use reaches, above which memory or
time grows without purpose: a block past the longest answer is the whole answer). `validate_options` refuses
a value outside them at once with a `ValueError` naming the decoder, the option, what it got and the range
it takes, in one line (the registry re-raises it as `DecoderError`). What is left of memory growth within
the ranges (rollouts, a quadratic block) is estimated against the memory budget before decoding
(`decode.footprint`).
"""

from __future__ import annotations

import itertools
import json
import math
import numbers
import os
import re
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from fastddrive.core.scaffold import DEFAULT_BLOCK_SIZE
from fastddrive.decode.jacobi import DEFAULT_JACOBI_BLOCK
from fastddrive.decode.jacobi_mr import DEFAULT_MR_BLOCK
from fastddrive.decode.lockstep import DEFAULT_WINDOW
from fastddrive.decode.mdm import DEFAULT_TAU
from fastddrive.decode.planning_vocabulary import VOCABULARY_FILE
from fastddrive.decode.pvf import DEFAULT_FUSE_WRITE, DEFAULT_PLAN_BAND, DEFAULT_REVEAL, DEFAULT_TAU_AR, DEFAULT_WIDTH
from fastddrive.decode.quadratic import DEFAULT_QUAD_BLOCK_SIZE
from fastddrive.decode.tts import DEFAULT_ROLLOUTS, DEFAULT_TEMPERATURE

TRUE_TEXT = ("true", "yes", "1")
FALSE_TEXT = ("false", "no", "0")
MAX_SEED = 2**63 - 1  # torch and numpy both take it, and `tts`'s seed + rollout index stays in torch's range
# The longest answer of any layout is 421 positions (the release's 192-token explanation; 261 by default): a
# block, window, reveal count or draft longer than an answer is the whole answer, so 1024 never limits a use.
MAX_ANSWER_TOKENS = 1024
# `selfspec-quad` feeds block_size^2 tokens per forward: 128^2 = 16,384, 32 times the roofline's widest forward
# (512), where every forward is long past compute-bound; the paper's blocks are a few tokens.
MAX_QUAD_BLOCK_SIZE = 128
MAX_ROLLOUTS = 256  # `tts` rows of one cache: 64 times the paper's 4 rollouts
MAX_WIDTH = 64  # `pvf` branches verified in one forward: 16 times the paper's batch of 4
MAX_BLOCKS = 64  # `jacobi-mr` blocks in flight (the paper's K = 2)
MAX_CANDIDATES = 64  # `jacobi-mr` recycled n-grams per forward (the paper's 4; its pool keeps 4 per key)
# A temperature past 100 samples uniformly for any logits a model writes; one below 1e-3 is greedy in effect, and
# below about 1e-307 logits / temperature overflow to inf and the softmax to NaN (a silently random token).
MAX_TEMPERATURE = 100.0
MIN_SAMPLING_TEMPERATURE = 1e-3
MAX_TOKEN_ID = 2**31 - 1  # past any vocabulary; the model's own size is checked before decoding

_FLOAT_TEXT = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_INT_TEXT = re.compile(r"[+-]?\d+")


class OptionValueError(ValueError):
    """A decoder option value outside its type or range; the message is one line."""


# --- strict conversions: a Python value of the type, or the command line's text -------------------------


def _number(value: Any) -> float:
    if isinstance(value, str):
        if not _FLOAT_TEXT.fullmatch(value.strip()):
            raise ValueError("not a number")
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError("not a number")
    try:
        value = float(value)
    except OverflowError:  # an integer or fraction past the largest float
        raise ValueError("not a finite number") from None
    if not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


def _integer(value: Any) -> int:
    if isinstance(value, str):
        if not _INT_TEXT.fullmatch(value.strip()):
            raise ValueError("not an integer")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError("not an integer")
    return int(value)


def _boolean(value: Any) -> bool:
    if isinstance(value, str):
        text = value.strip().lower()
        if text in TRUE_TEXT:
            return True
        if text in FALSE_TEXT:
            return False
        raise ValueError("not a boolean")
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError("not a boolean")


def _token_ids(value: Any) -> list[int] | None:
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("null", "none"):
            return None
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):  # not JSON, an integer of more digits than Python reads, too deep
            raise ValueError("not a JSON list") from None
    if value is None:
        return None
    if isinstance(value, np.ndarray) and value.ndim != 1:
        raise ValueError("not a list")
    if not isinstance(value, (Sequence, np.ndarray)) or isinstance(value, (str, bytes, bytearray)):
        raise ValueError("not a list")
    ids = list(itertools.islice(value, MAX_ANSWER_TOKENS + 1))  # never more than one past the limit
    if len(ids) > MAX_ANSWER_TOKENS:
        raise ValueError("too many ids")
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise ValueError("not token ids")
    return [int(t) for t in ids]


def _vocabulary_path(value: Any) -> str | None:
    # Only the form: the decoder reads the file when planning is on, naming it if missing or damaged.
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError("not a path")
    text = str(value)
    if not text.strip() or "\0" in text:  # no file system takes a NUL in a name
        raise ValueError("not a path")
    return text


def _greedy_or_sampling(value: float) -> float:
    if 0 < value < MIN_SAMPLING_TEMPERATURE:
        raise ValueError("too small to sample with")
    return value


@dataclass(frozen=True)
class Note:
    """Words added to an option's range where its bounds do not say all (`expected`)."""

    text: str


Number = Annotated[float, BeforeValidator(_number)]
Integer = Annotated[int, BeforeValidator(_integer)]
Boolean = Annotated[bool, BeforeValidator(_boolean)]
Unit = Annotated[Number, Field(ge=0.0, le=1.0)]  # a confidence threshold
Temperature = Annotated[
    Number,
    Field(ge=0.0, le=MAX_TEMPERATURE),
    AfterValidator(_greedy_or_sampling),
    Note(f"0 is greedy; a sampling temperature is at least {MIN_SAMPLING_TEMPERATURE:g}"),
]
Count = Annotated[Integer, Field(ge=1, le=MAX_ANSWER_TOKENS)]  # positions of an answer: a block, a window
BlockSize = Count
Seed = Annotated[Integer, Field(ge=0, le=MAX_SEED)]
TokenIds = Annotated[list[int] | None, BeforeValidator(_token_ids)]
VocabularyPath = Annotated[str | None, BeforeValidator(_vocabulary_path)]


# --- the declarations ---------------------------------------------------------------------------------------


class DecoderOptions(BaseModel):
    """The options of one decoder: field names, order and defaults are its keyword-only parameters'."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ArOptions(DecoderOptions):
    """`ar`, `ar-jump`: greedy at temperature 0, else sampled with `seed`."""

    temperature: Temperature = 0.0
    seed: Seed = 0


class FullSequenceOptions(DecoderOptions):
    """`fullseq`."""

    tau: Unit = DEFAULT_TAU


class DiffusionOptions(DecoderOptions):
    """`mdm`, `sd`."""

    tau: Unit = DEFAULT_TAU
    block_size: BlockSize = DEFAULT_BLOCK_SIZE


class SelfSpeculativeOptions(DecoderOptions):
    """`selfspec`: a sliding window of the last committed token and block_size - 1 drafts."""

    block_size: Annotated[Integer, Field(ge=2, le=MAX_ANSWER_TOKENS)] = DEFAULT_BLOCK_SIZE


class QuadraticOptions(DecoderOptions):
    """`selfspec-quad`: block_size groups of block_size tokens per forward."""

    block_size: Annotated[Integer, Field(ge=2, le=MAX_QUAD_BLOCK_SIZE)] = DEFAULT_QUAD_BLOCK_SIZE


class ScaffoldSpeculativeOptions(DecoderOptions):
    """`ss`: `drafts` must also hold one id per response position (checked when the scaffold is known)."""

    block_size: BlockSize = DEFAULT_BLOCK_SIZE
    fuse_draft: Boolean = True
    drafts: TokenIds = None


class RolloutOptions(DecoderOptions):
    """`tts`: rollout r samples with seed + r."""

    rollouts: Annotated[Integer, Field(ge=1, le=MAX_ROLLOUTS)] = DEFAULT_ROLLOUTS
    temperature: Temperature = DEFAULT_TEMPERATURE
    block_size: BlockSize = DEFAULT_BLOCK_SIZE
    seed: Seed = 0
    fuse_draft: Boolean = True
    rollout_drafts: Boolean = False
    rollout_window: Count = DEFAULT_WINDOW


class JacobiOptions(DecoderOptions):
    """`jacobi`."""

    block_size: BlockSize = DEFAULT_JACOBI_BLOCK
    seed: Seed = 0
    drafts: TokenIds = None


class MultiBlockJacobiOptions(DecoderOptions):
    """`jacobi-mr`."""

    block_size: BlockSize = DEFAULT_MR_BLOCK
    max_blocks: Annotated[Integer, Field(ge=1, le=MAX_BLOCKS)] = 2
    spawn_ratio: Annotated[Number, Field(gt=0.0, le=1.0)] = 0.85
    candidates: Annotated[Integer, Field(ge=0, le=MAX_CANDIDATES)] = 4
    seed: Seed = 0
    drafts: TokenIds = None


class PlanVerifyFillOptions(DecoderOptions):
    """`pvf`: the planning band [plan_low, plan_high) must not be empty."""

    tau: Unit = DEFAULT_TAU
    width: Annotated[Integer, Field(ge=1, le=MAX_WIDTH)] = DEFAULT_WIDTH
    plan_low: Unit = DEFAULT_PLAN_BAND[0]
    plan_high: Unit = DEFAULT_PLAN_BAND[1]
    tau_ar: Unit = DEFAULT_TAU_AR
    reveal: Annotated[Integer, Field(ge=0, le=MAX_ANSWER_TOKENS)] = DEFAULT_REVEAL
    planning: Boolean = True
    fallback: Boolean = True
    vocabulary: VocabularyPath = None
    block_size: BlockSize = DEFAULT_BLOCK_SIZE
    fuse_write: Boolean = DEFAULT_FUSE_WRITE

    @model_validator(mode="after")
    def _band(self) -> PlanVerifyFillOptions:
        if not self.plan_low < self.plan_high:
            raise ValueError(
                f"options plan_low, plan_high: got {self.plan_low:g} and {self.plan_high:g}, expected"
                " 0 <= plan_low < plan_high <= 1 (a non-empty planning band)"
            )
        return self


OPTIONS: dict[str, type[DecoderOptions]] = {
    "ar": ArOptions,
    "ar-jump": ArOptions,
    "fullseq": FullSequenceOptions,
    "jacobi": JacobiOptions,
    "jacobi-mr": MultiBlockJacobiOptions,
    "mdm": DiffusionOptions,
    "pvf": PlanVerifyFillOptions,
    "sd": DiffusionOptions,
    "selfspec": SelfSpeculativeOptions,
    "selfspec-quad": QuadraticOptions,
    "ss": ScaffoldSpeculativeOptions,
    "tts": RolloutOptions,
}


# --- checking and describing ----------------------------------------------------------------------------------


def validate_options(name: str, options: dict[str, object]) -> dict[str, object]:
    """The options given for decoder `name` (known to take them all), converted to their types and checked
    against their ranges; OptionValueError (one line) names the first that is wrong."""
    model = OPTIONS[name]
    try:
        checked = model.model_validate(options)
    except ValidationError as err:
        error = err.errors(include_url=False)[0]
        if not error["loc"]:  # a range across options
            raise OptionValueError(f"decoder {name!r} {error['ctx']['error']}") from None
        key = str(error["loc"][0])
        raise OptionValueError(
            f"decoder {name!r} option {key}: got {_shown(options[key])}, expected {expected(model.model_fields[key])}"
        ) from None
    return {key: getattr(checked, key) for key in options}


def option_table(name: str) -> list[tuple[str, str, object]]:
    """(option, what it takes, default) of every option of decoder `name`, in its signature's order."""
    return [(key, expected(field), field.default) for key, field in OPTIONS[name].model_fields.items()]


def expected(field: FieldInfo) -> str:
    """What a field takes, in words: 'a number in [0, 1]', 'an integer >= 1', ..."""
    words = {
        float: "a number",
        int: "an integer",
        bool: "a boolean (true/false, yes/no, 1/0)",
        list[int] | None: f"a JSON list of at most {MAX_ANSWER_TOKENS} token ids in [0, 2^31 - 1], or null",
        str | None: f"the path of a planning vocabulary file, or of a folder holding {VOCABULARY_FILE}",
    }[field.annotation]
    bound = {kind: getattr(m, kind) for m in field.metadata for kind in ("ge", "gt", "le", "lt") if hasattr(m, kind)}
    shown = {kind: "2^63 - 1" if value == MAX_SEED else f"{value:g}" for kind, value in bound.items()}
    low = f"[{shown['ge']}" if "ge" in bound else f"({shown['gt']}" if "gt" in bound else None
    high = f"{shown['le']}]" if "le" in bound else f"{shown['lt']})" if "lt" in bound else None
    notes = "".join(f" ({m.text})" for m in field.metadata if isinstance(m, Note))
    if low and high:
        return f"{words} in {low}, {high}{notes}"
    for kind, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if kind in bound:
            return f"{words} {sign} {shown[kind]}{notes}"
    return words + notes


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


def _shown(value: object, limit: int = 60) -> str:
    """A short repr of what was given: a long list, text or number is cut (never written out whole), and a value
    whose repr fails is named by its type."""
    try:
        text = " ".join(_REPR.repr(value).split())  # one line, whatever the repr (an array's has several)
    except Exception:  # noqa: BLE001 - any object may come through the API; its repr is only for the message
        text = f"a value of type {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
