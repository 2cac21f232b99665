"""The decoder registry: names to functions, option checking, and the measured run of one decoder.

A decoder is `fn(model, prompt, scaffold, **options) -> Decoded`; `decode` wraps it with the
measurements every decoder reports (forward calls, prefill and decode wall time) and rebuilds the answer.
The CLI, the planner and the benchmark only go through `decode`.

Options are declared with their types and ranges in `decode.options`; `check_options` (which `decode`
calls before touching the model) refuses unknown options and bad values with one `DecoderError` line.
The command line's text (`--option tau=0.5`, `sd:tau=0.0:block_size=16`) is parsed by the same check,
strictly; `parse_options(pairs, decoder)` and `parse_decoder_spec` do it before any model is loaded.
With the model at hand, and still before its first forward, `decode` also checks the token ids of `drafts`
against the model's vocabulary and the answer's length (`check_drafts`), and the decode's estimated memory
against the budget (`decode.footprint`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase

from fastddrive.core.scaffold import Scaffold
from fastddrive.core.schema import DrivingResponse, ResponseError, parse
from fastddrive.decode.ar import ar_decode, ar_jump_decode
from fastddrive.decode.footprint import ModelSizes, check_decode_memory
from fastddrive.decode.fullseq import full_sequence_decode
from fastddrive.decode.jacobi import jacobi_decode
from fastddrive.decode.jacobi_mr import jacobi_mr_decode
from fastddrive.decode.mdm import mdm_decode, section_diffusion_decode
from fastddrive.decode.meter import ForwardMeter, synchronize
from fastddrive.decode.options import OPTIONS, OptionValueError, validate_options
from fastddrive.decode.pvf import pvf_decode
from fastddrive.decode.quadratic import quadratic_speculative_decode
from fastddrive.decode.result import Decoded, DecodeResult
from fastddrive.decode.speculative import scaffold_speculative_decode, self_speculative_decode
from fastddrive.decode.state import FREE_SLACK
from fastddrive.decode.tts import trajectory_rollouts_decode
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs

DecoderFn = Callable[..., Decoded]

DECODERS: dict[str, DecoderFn] = {
    "ar": ar_decode,
    "ar-jump": ar_jump_decode,
    "fullseq": full_sequence_decode,
    "jacobi": jacobi_decode,
    "jacobi-mr": jacobi_mr_decode,
    "mdm": mdm_decode,
    "pvf": pvf_decode,
    "sd": section_diffusion_decode,
    "selfspec": self_speculative_decode,
    "selfspec-quad": quadratic_speculative_decode,
    "ss": scaffold_speculative_decode,
    "tts": trajectory_rollouts_decode,
}
LOSSLESS = ("ar-jump", "ss", "selfspec", "selfspec-quad", "jacobi", "jacobi-mr")  # token-for-token equal to greedy `ar`
ON_AR_MODELS = (
    "ar",
    "jacobi",
    "jacobi-mr",
)  # decoders that need only the AR head (the others need a block-diffusion model)


class DecoderError(ValueError):
    """An unknown decoder, an option it does not take, a value outside the option's type or range, an empty
    decoder list, or a model it cannot run on."""


def decoder_options(name: str) -> dict[str, object]:
    """The options a decoder takes, with their defaults, as `decode.options` declares them (`OPTIONS`)."""
    get_decoder(name)
    return {key: field.default for key, field in OPTIONS[name].model_fields.items()}


def get_decoder(name: str) -> DecoderFn:
    """The decoder function registered as `name`; an unknown name is a DecoderError listing the decoders."""
    if name not in DECODERS:
        raise DecoderError(f"unknown decoder {name!r}; decoders: {', '.join(DECODERS)}")
    return DECODERS[name]


def check_runs_on(kind: str, name: str) -> None:
    """DecoderError unless decoder `name` exists and runs on a checkpoint of `kind` (`CheckpointInfo.kind`:
    an autoregressive checkpoint has no MDM head)."""
    get_decoder(name)
    if kind == "autoregressive" and name not in ON_AR_MODELS:
        raise DecoderError(
            f"decoder {name!r} needs a block-diffusion checkpoint; this one is an AR model"
            f" (these run on it: {', '.join(ON_AR_MODELS)})"
        )


def check_options(name: str, options: dict[str, object]) -> dict[str, object]:
    """The options given for decoder `name`, converted to their declared types and checked against their
    ranges (text is parsed strictly, see `decode.options`). DecoderError, one line, names the first option
    `name` does not take (with those it does) or whose value is wrong (with the range it takes)."""
    known = decoder_options(name)
    for key in options:
        if key not in known:
            takes = ", ".join(known) or "no options"
            raise DecoderError(f"decoder {name!r} takes no option {key!r} (it takes: {takes})")
    try:
        return validate_options(name, options)
    except OptionValueError as err:
        raise DecoderError(str(err)) from None


def check_drafts(name: str, options: dict[str, object], vocab_size: int, answer_length: int, kind: str) -> None:
    """DecoderError (one line: the option, the first bad id and the vocabulary size, or the length) when the
    `drafts` of decoder `name` hold an id outside a vocabulary of `vocab_size` tokens, or do not fit an answer
    of `answer_length` positions: `ss` drafts one id per position; `jacobi` and `jacobi-mr` start from at most
    the answer's positions (an AR model writing freely may take FREE_SLACK more), the rest from their own
    guesses. A model would index its embedding with them: checked before the first forward."""
    drafts = options.get("drafts")
    if drafts is None:
        return
    bad = next((t for t in drafts if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise DecoderError(
            f"decoder {name!r} option drafts: token id {bad} is outside the model's vocabulary of {vocab_size}"
            f" tokens (ids 0..{vocab_size - 1})"
        )
    if name == "ss" and len(drafts) != answer_length:
        raise DecoderError(
            f"decoder 'ss' option drafts: got {len(drafts)} ids, expected one per answer position ({answer_length})"
        )
    longest = answer_length + (FREE_SLACK if kind == "autoregressive" else 0)
    if len(drafts) > longest:
        raise DecoderError(
            f"decoder {name!r} option drafts: got {len(drafts)} ids, more than the answer's {longest} positions"
        )


def vocabulary_size(model: BlockDiffusionModel) -> int:
    """How many token ids the model reads: the rows of its input embedding."""
    return model.text_model.embed_tokens.weight.shape[0]


def parse_options(pairs: list[str], decoder: str | None = None) -> dict[str, object]:
    """['tau=0.5', 'fuse_draft=false'] -> {'tau': '0.5', 'fuse_draft': 'false'}: the text of each KEY=VALUE,
    which `check_options` (and so `decode`) converts by the option's declared type.

    With `decoder`, the options are checked for it at once and come back typed ({'tau': 0.5, 'fuse_draft':
    False}): the command line calls it so before loading any model. A pair without '=' or a key given twice
    is a DecoderError."""
    options: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise DecoderError(f"a decoder option is KEY=VALUE, got {pair!r}")
        if key in options:
            raise DecoderError(f"decoder option {key!r} is given twice ({key}={options[key]} and {pair})")
        options[key] = value
    if decoder is None:
        return options
    get_decoder(decoder)
    return check_options(decoder, options)


def parse_decoder_spec(spec: str) -> tuple[str, dict[str, object]]:
    """'sd' or 'sd:tau=0.0:block_size=16' -> ('sd', {'tau': 0.0, 'block_size': 16}): checked and typed."""
    name, *pairs = spec.strip().split(":")
    get_decoder(name)
    return name, parse_options(pairs, name)


def split_decoders(text: str) -> list[str]:
    """'ar, sd:tau=0.0' -> ['ar', 'sd:tau=0.0']: the decoder specs of a comma-separated list, stripped.

    DecoderError when the list is empty or names a decoder nowhere (',', 'ar,,sd', 'ar,') and when a spec
    is given twice (its results would be reported once): nothing asked for is skipped in silence."""
    specs = [spec.strip() for spec in text.split(",")]
    known = ", ".join(DECODERS)
    if not any(specs):
        raise DecoderError(f"the decoder list {text!r} names no decoder; give a comma-separated list of: {known}")
    if not all(specs):
        raise DecoderError(f"the decoder list {text!r} has an empty name; give a comma-separated list of: {known}")
    twice = sorted({spec for spec in specs if specs.count(spec) > 1})
    if twice:
        raise DecoderError(f"the decoder list {text!r} names {twice[0]!r} twice")
    return specs


def decode(
    name: str, model: BlockDiffusionModel, prompt: PromptInputs, scaffold: Scaffold, **options: object
) -> DecodeResult:
    """Run decoder `name` on one prompt and measure it."""
    fn = get_decoder(name)
    options = check_options(name, options)
    kind = model.info.kind
    check_runs_on(kind, name)
    check_drafts(name, options, vocabulary_size(model), len(scaffold), kind)
    check_decode_memory(
        name,
        options,
        ModelSizes.of_model(model),
        prompt.input_ids.shape[1],
        len(scaffold),
        model.device,
        free=kind == "autoregressive",
    )
    meter = ForwardMeter()
    began = time.perf_counter()
    with meter.watch(model):
        decoded = fn(model, prompt, scaffold, **options)
    synchronize(model.device)
    ended = time.perf_counter()
    first_end = meter.first_end or ended
    text, response, error, tokens = _answer(model, scaffold, decoded)
    return DecodeResult(
        decoder=name,
        token_ids=decoded.token_ids,
        text=text,
        response=response,
        nfe=meter.calls,
        fed_tokens=meter.fed_after_prefill,
        tokens=tokens,
        accepted_per_step=decoded.accepted_per_step,
        prefill_ms=1000 * (first_end - began),
        decode_ms=1000 * (ended - first_end),
        error=error,
        extra=decoded.extra,
        image_sizes_px=model.image_sizes_px(prompt),
    )


def free_text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """The text of ids an AR model wrote freely, every token as written (special ones included)."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _answer(
    model: BlockDiffusionModel, scaffold: Scaffold, decoded: Decoded
) -> tuple[str, DrivingResponse | None, str | None, int]:
    """(text, response or None, why it does not parse or None, real tokens) of a decoder's ids."""
    ids = decoded.token_ids
    free = model.info.kind == "autoregressive"
    text = free_text(model.tokenizer, ids) if free else scaffold.text(ids)
    tokens = len(ids) if free else sum(t != scaffold.null_id for t in ids)
    try:
        response = parse(text) if free else scaffold.decode(ids)
    except (ResponseError, ValueError) as err:
        return text, None, str(err), tokens
    return text, response, None, tokens
