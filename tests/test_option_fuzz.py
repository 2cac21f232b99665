"""Property tests of the decoder option parser (issue 32, item 7): any text or value for any option of any
decoder is either a typed value inside the option's declared range or one DecoderError line, never another
exception; every value inside a range survives the trip through the command line's text."""

import json
import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fastddrive.decode import DECODERS, DecoderError
from fastddrive.decode.options import MIN_SAMPLING_TEMPERATURE, OPTIONS, Note
from fastddrive.decode.registry import check_options, parse_decoder_spec, parse_options

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
OPTION_NAMES = sorted({(decoder, key) for decoder, model in OPTIONS.items() for key in model.model_fields})
options_of_decoders = st.sampled_from(OPTION_NAMES)

# Text a user might type, and text built to break a parser: numbers of every form, JSON, deep nesting, huge ints.
texts = st.one_of(
    st.text(max_size=40),
    st.integers().map(str),
    st.floats().map(repr),
    st.sampled_from(["nan", "-inf", "1e999", "1e-310", "0x10", "1_000", " 7 ", "+3", "true", "No", "null", "[]"]),
    st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=8).map(json.dumps),
    st.integers(min_value=1, max_value=3000).map(lambda n: "[" * n),
    st.integers(min_value=4000, max_value=6000).map(lambda n: "9" * n),
)
# Values the API might be handed: every JSON type, numpy scalars, other numbers, odd containers.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**300, max_value=10**400),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=10),
    st.complex_numbers(),
    st.fractions(),
    st.decimals(),
    st.integers(min_value=-(2**62), max_value=2**62).map(np.int64),
    st.floats(width=32).map(np.float32),
    st.booleans().map(np.bool_),
    hnp.arrays(st.sampled_from([np.int64, np.float64, np.bool_, object]), hnp.array_shapes(min_dims=0, max_dims=2)),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.lists(inner, max_size=5).map(tuple),
        st.dictionaries(st.text(max_size=5), inner, max_size=3),
        st.frozensets(st.integers(), max_size=3),
    ),
    max_leaves=10,
)


def _bounds(field) -> dict[str, float]:
    return {kind: getattr(m, kind) for m in field.metadata for kind in ("ge", "gt", "le", "lt") if hasattr(m, kind)}


def _in_range(decoder: str, key: str, value: object) -> None:
    """`value` is of the option's declared type and inside its declared range."""
    field = OPTIONS[decoder].model_fields[key]
    kind = field.annotation
    if kind is float:
        assert type(value) is float and math.isfinite(value)
    elif kind is int:
        assert type(value) is int
    elif kind is bool:
        assert type(value) is bool
    elif kind == list[int] | None:
        assert value is None or (type(value) is list and all(type(t) is int and t >= 0 for t in value))
    else:
        assert value is None or (type(value) is str and value.strip())
    bounds = _bounds(field)
    if "ge" in bounds:
        assert value >= bounds["ge"]
    if "gt" in bounds:
        assert value > bounds["gt"]
    if "le" in bounds:
        assert value <= bounds["le"]
    if any(isinstance(m, Note) for m in field.metadata):  # a temperature: greedy, or one that samples
        assert value == 0 or value >= MIN_SAMPLING_TEMPERATURE


def _typed_or_refused(decoder: str, key: str, call) -> None:
    try:
        typed = call()
    except DecoderError as err:
        message = str(err)
        assert "\n" not in message and f"decoder {decoder!r}" in message, message
        assert len(message) < 400, message  # a huge value is cut, never written out whole
        return
    assert list(typed) == [key]
    _in_range(decoder, key, typed[key])
    assert check_options(decoder, typed) == typed  # typed values pass again, unchanged


@FUZZ
@given(option=options_of_decoders, text=texts)
def test_any_text_for_any_option_is_a_typed_value_in_range_or_one_decoder_error(option, text):
    decoder, key = option
    _typed_or_refused(decoder, key, lambda: parse_options([f"{key}={text}"], decoder))
    if ":" not in text:  # what `eval --decoders` and `bench --decoders` parse
        try:
            expected = parse_options([f"{key}={text.rstrip()}"], decoder)
        except DecoderError:
            with pytest.raises(DecoderError):
                parse_decoder_spec(f"{decoder}:{key}={text}")
        else:
            assert parse_decoder_spec(f"{decoder}:{key}={text}") == (decoder, expected)


@FUZZ
@given(option=options_of_decoders, value=values)
def test_any_value_for_any_option_is_a_typed_value_in_range_or_one_decoder_error(option, value):
    decoder, key = option
    _typed_or_refused(decoder, key, lambda: check_options(decoder, {key: value}))


@FUZZ
@given(decoder=st.sampled_from(sorted(DECODERS)), key=st.text(max_size=12), value=texts)
def test_an_option_a_decoder_does_not_take_is_one_decoder_error(decoder, key, value):
    if key in OPTIONS[decoder].model_fields:
        return
    with pytest.raises(DecoderError, match="takes no option|KEY=VALUE"):
        parse_options([f"{key}={value}"], decoder)
    with pytest.raises(DecoderError, match="takes no option"):
        check_options(decoder, {key: value})


def _valid(field) -> st.SearchStrategy:
    """Any value inside a field's declared type and range."""
    kind, bounds = field.annotation, _bounds(field)
    if kind is bool:
        return st.booleans()
    if kind is int:
        return st.integers(min_value=bounds.get("ge", 0), max_value=bounds.get("le", 2**63 - 1))
    if kind is float:
        low = bounds.get("ge", bounds.get("gt"))
        floats = st.floats(low, bounds["le"], exclude_min="gt" in bounds, allow_nan=False, allow_subnormal=False)
        if any(isinstance(m, Note) for m in field.metadata):
            return st.one_of(st.just(0.0), st.floats(MIN_SAMPLING_TEMPERATURE, bounds["le"]))
        return floats
    if kind == list[int] | None:
        return st.one_of(st.none(), st.lists(st.integers(0, 2**31 - 1), max_size=20))
    return st.one_of(st.none(), st.text(min_size=1, max_size=20).filter(lambda t: t.strip() and "\0" not in t))


def _as_text(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value)
    if value is None or isinstance(value, list):
        return json.dumps(value)
    return str(value)


@FUZZ
@given(data=st.data(), option=options_of_decoders)
def test_every_value_in_range_survives_the_command_line(data, option):
    decoder, key = option
    if key in ("plan_low", "plan_high"):  # one end alone may empty the band (refused apart, tested apart)
        return
    field = OPTIONS[decoder].model_fields[key]
    value = data.draw(_valid(field))
    if field.annotation == str | None and value is None:
        assert check_options(decoder, {key: None}) == {key: None}
        return
    text = value.strip() if isinstance(value, str) else _as_text(value)
    parsed = parse_options([f"{key}={text}"], decoder)
    assert parsed == {key: text if isinstance(value, str) else value}
    assert check_options(decoder, {key: value}) == {key: value}


def test_numbers_python_cannot_convert_are_refused_in_one_line():
    """An int past the largest float, a fraction of one, an int with more digits than repr writes, a list that
    never ends: each was another exception than DecoderError, or hung."""
    for decoder, key, value in [
        ("sd", "tau", 10**400),
        ("sd", "tau", Fraction(10**400, 3)),
        ("sd", "tau", Decimal("0.5")),
        ("sd", "block_size", 10**5000),
        ("ss", "drafts", range(10**15)),
        ("ss", "drafts", "[" * 100_000),
        ("ss", "drafts", "[" + "9" * 5000 + "]"),
        ("pvf", "vocabulary", "a\0b"),
        ("ss", "drafts", np.array(5)),
        ("ss", "drafts", np.zeros((2, 2), int)),
        ("sd", "tau", np.zeros((3, 3))),
    ]:
        with pytest.raises(DecoderError, match=f"option {key}:"):
            check_options(decoder, {key: value})
