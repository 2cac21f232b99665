"""Decoder options are declared with types and ranges and checked before any work (issue 16, item 1): the
command line's text strictly, the API's values alike, one DecoderError line naming decoder, option and range."""

import inspect
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from fastddrive.cli import app
from fastddrive.decode import DECODERS, DecoderError, decode
from fastddrive.decode.options import OPTIONS, option_table
from fastddrive.decode.registry import check_options, parse_decoder_spec, parse_options, split_decoders

# (decoder, option, the command line's text): every bad value of the issue, and a few more of each kind.
BAD_TEXT = [
    ("sd", "tau", "abc"),
    ("sd", "block_size", "8.5"),
    ("ss", "block_size", "8.5"),
    ("ar", "seed", "abc"),
    ("tts", "seed", "abc"),
    ("sd", "tau", "2.0"),
    ("sd", "tau", "-1"),
    ("fullseq", "tau", "1.5"),
    ("sd", "tau", "NaN"),
    ("sd", "tau", "nan"),
    ("sd", "tau", "inf"),
    ("sd", "tau", ""),
    ("sd", "block_size", "0"),
    ("mdm", "block_size", "0"),
    ("selfspec", "block_size", "1"),
    ("selfspec-quad", "block_size", "1"),
    ("tts", "rollouts", "0"),
    ("tts", "temperature", "-1"),
    ("ar", "temperature", "-1"),
    ("ar", "seed", "-1"),
    ("ss", "fuse_draft", "maybe"),
    ("tts", "fuse_draft", "maybe"),
    ("tts", "rollout_drafts", "maybe"),
    ("tts", "rollout_drafts", "auto"),
    ("tts", "rollout_window", "0"),
    ("ss", "fuse_draft", "2"),
    ("pvf", "planning", "maybe"),
    ("pvf", "width", "0"),
    ("pvf", "tau_ar", "1.1"),
    ("pvf", "reveal", "-1"),
    ("jacobi", "block_size", "0"),
    ("jacobi-mr", "max_blocks", "0"),
    ("jacobi-mr", "spawn_ratio", "0"),
    ("jacobi-mr", "candidates", "-1"),
    ("ss", "drafts", "[1, -2]"),
    ("ss", "drafts", "[1.5]"),
    ("ss", "drafts", "abc"),
    ("pvf", "vocabulary", ""),
]
# (decoder, option, a Python value): the same through the API.
BAD_VALUES = [
    ("sd", "tau", "abc"),
    ("sd", "block_size", 8.5),
    ("ar", "seed", "abc"),
    ("sd", "tau", 2.0),
    ("sd", "tau", -1),
    ("sd", "tau", math.nan),
    ("sd", "tau", True),
    ("sd", "block_size", 0),
    ("sd", "block_size", True),
    ("tts", "rollouts", 0),
    ("tts", "temperature", -1),
    ("ss", "fuse_draft", "maybe"),
    ("ss", "fuse_draft", 2),
    ("ss", "fuse_draft", None),
    ("tts", "rollout_drafts", 2),
    ("tts", "rollout_drafts", None),
    ("tts", "rollout_window", 0),
    ("ss", "drafts", [1, -2]),
    ("ss", "drafts", 7),
    ("jacobi-mr", "spawn_ratio", 0.0),
]
RANGES = {
    "tau": "[0, 1]",
    "block_size": ">=",
    "seed": "[0, 2^63 - 1]",
    "rollouts": ">= 1",
    "rollout_window": ">= 1",
    "temperature": ">= 0",
    "fuse_draft": "true/false",
    "planning": "true/false",
    "spawn_ratio": "(0, 1]",
    "drafts": "token ids",
}


def _names_it(message: str, decoder: str, option: str) -> None:
    assert "\n" not in message
    assert f"decoder {decoder!r}" in message and f"option {option}:" in message, message
    if option in RANGES:
        assert RANGES[option] in message, message


@pytest.fixture(scope="module")
def planner():
    from fastddrive.planner import load

    return load("default")


@pytest.fixture(scope="module")
def scene():
    from fastddrive.data.highway import episode_samples

    return episode_samples("merge", 90_000, max_duration_s=9)[0]


@pytest.mark.parametrize(("decoder", "option", "text"), BAD_TEXT)
def test_the_parse_layer_refuses_bad_text_naming_the_option_and_its_range(decoder, option, text):
    with pytest.raises(DecoderError) as parsed:
        parse_options([f"{option}={text}"], decoder)
    _names_it(str(parsed.value), decoder, option)
    if ":" not in text:
        with pytest.raises(DecoderError) as spec:
            parse_decoder_spec(f"{decoder}:{option}={text}")
        assert str(spec.value) == str(parsed.value)  # what `eval --decoders` and `bench --decoders` call


@pytest.mark.parametrize(("decoder", "option", "value"), BAD_VALUES)
def test_the_api_refuses_bad_values_before_touching_the_model(decoder, option, value):
    with pytest.raises(DecoderError) as err:
        decode(decoder, None, None, None, **{option: value})  # no model, prompt or scaffold is ever read
    _names_it(str(err.value), decoder, option)


@pytest.mark.parametrize(("decoder", "option", "value"), BAD_VALUES[:12])
def test_planner_plan_refuses_bad_values(planner, scene, decoder, option, value):
    with pytest.raises(DecoderError) as err:
        planner.plan(scene, decoder, **{option: value})
    _names_it(str(err.value), decoder, option)


def test_every_option_of_every_decoder_refuses_text_of_another_type():
    for decoder in DECODERS:
        for option, takes, _ in option_table(decoder):
            if takes.startswith("the path"):  # any text is a path
                continue
            with pytest.raises(DecoderError) as err:
                parse_options([f"{option}=abc"], decoder)
            _names_it(str(err.value), decoder, option)


def test_the_pvf_planning_band_must_not_be_empty():
    for options in (["plan_low=0.9", "plan_high=0.8"], ["plan_low=0.95"], ["plan_high=0.5"]):
        with pytest.raises(DecoderError, match=r"decoder 'pvf' options plan_low, plan_high: .*plan_low < plan_high"):
            parse_options(options, "pvf")
    assert parse_options(["plan_low=0.2", "plan_high=0.3"], "pvf") == {"plan_low": 0.2, "plan_high": 0.3}


@pytest.mark.parametrize(
    ("decoder", "pairs", "expected"),
    [
        ("ss", ["fuse_draft=False"], {"fuse_draft": False}),
        ("ss", ["fuse_draft=no"], {"fuse_draft": False}),
        ("ss", ["fuse_draft=0"], {"fuse_draft": False}),
        ("ss", ["fuse_draft=false"], {"fuse_draft": False}),
        ("ss", ["fuse_draft=TRUE"], {"fuse_draft": True}),
        ("ss", ["fuse_draft=Yes"], {"fuse_draft": True}),
        ("ss", ["fuse_draft=1"], {"fuse_draft": True}),
        ("ss", ["block_size=16", "drafts=[1, 2, 3]"], {"block_size": 16, "drafts": [1, 2, 3]}),
        ("ss", ["drafts=null"], {"drafts": None}),
        ("sd", ["tau=0.5", "block_size=16"], {"tau": 0.5, "block_size": 16}),
        ("sd", ["tau=0", "block_size=1"], {"tau": 0.0, "block_size": 1}),
        ("sd", ["tau=1"], {"tau": 1.0}),
        ("sd", ["tau=.25"], {"tau": 0.25}),
        ("sd", ["tau=1e-3"], {"tau": 0.001}),
        ("ar", ["temperature=0", "seed=7"], {"temperature": 0.0, "seed": 7}),
        ("tts", ["rollouts=1", "temperature=1.5", "seed=3"], {"rollouts": 1, "temperature": 1.5, "seed": 3}),
        ("tts", ["rollout_drafts=yes"], {"rollout_drafts": True}),
        ("tts", ["rollout_drafts=no", "rollout_window=1"], {"rollout_drafts": False, "rollout_window": 1}),
        ("selfspec-quad", ["block_size=2"], {"block_size": 2}),
        ("jacobi-mr", ["spawn_ratio=1", "candidates=0"], {"spawn_ratio": 1.0, "candidates": 0}),
        ("pvf", ["planning=no", "reveal=0"], {"planning": False, "reveal": 0}),
    ],
)
def test_good_text_parses_to_the_declared_types(decoder, pairs, expected):
    parsed = parse_options(pairs, decoder)
    assert parsed == expected
    assert [type(v) for v in parsed.values()] == [type(v) for v in expected.values()]
    assert parse_decoder_spec(":".join([decoder, *pairs])) == (decoder, expected)
    assert check_options(decoder, parse_options(pairs)) == expected  # text first, checked later: the same


def test_api_values_are_kept_and_converted():
    assert check_options("sd", {"tau": 1, "block_size": np.int64(8)}) == {"tau": 1.0, "block_size": 8}
    assert check_options("ss", {"fuse_draft": np.bool_(False), "drafts": (4, 5)}) == {
        "fuse_draft": False,
        "drafts": [4, 5],
    }
    assert type(check_options("sd", {"tau": 1})["tau"]) is float
    assert check_options("pvf", {"vocabulary": None}) == {"vocabulary": None}


def test_a_vocabulary_is_a_path_read_by_the_decoder(tmp_path):
    """Only its form is checked up front: `pvf` reads the file (naming it) only when planning is on."""
    path = tmp_path / "vocabulary.json"
    assert parse_options([f"vocabulary={path}"], "pvf") == {"vocabulary": str(path)}
    assert check_options("pvf", {"vocabulary": path}) == {"vocabulary": str(path)}
    with pytest.raises(DecoderError, match="decoder 'pvf' option vocabulary: got 3, expected the path"):
        check_options("pvf", {"vocabulary": 3})


def test_text_options_reach_the_decoder_as_their_values(planner, scene):
    """`fuse_draft=False` and `no` were taken as true (issue 16): now they cost what False costs."""
    off = planner.plan(scene, "ss", fuse_draft=False).nfe
    on = planner.plan(scene, "ss", fuse_draft=True).nfe
    assert off != on
    for text in ("False", "no", "0", "false"):
        assert planner.plan(scene, "ss", **parse_options([f"fuse_draft={text}"])).nfe == off, text
    assert planner.plan(scene, "ss", **parse_options(["fuse_draft=yes"], "ss")).nfe == on


def test_unknown_options_and_malformed_pairs_are_still_refused():
    with pytest.raises(DecoderError, match=r"'ss' takes no option 'tau' \(it takes: block_size, fuse_draft, drafts\)"):
        parse_options(["tau=0.5"], "ss")
    with pytest.raises(DecoderError, match=r"'ss' takes no option 'tau'"):
        decode("ss", None, None, None, tau=0.5)
    with pytest.raises(DecoderError, match="KEY=VALUE"):
        parse_options(["tau"], "sd")
    with pytest.raises(DecoderError, match="given twice"):
        parse_options(["tau=0.5", "tau=0.7"], "sd")
    with pytest.raises(DecoderError, match="unknown decoder 'beam'"):
        parse_options(["tau=0.5"], "beam")
    with pytest.raises(DecoderError, match="unknown decoder ''"):
        parse_decoder_spec(":tau=0.5")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (",", "names no decoder"),
        (" , ", "names no decoder"),
        ("", "names no decoder"),
        ("ar,,sd", "has an empty name"),
        ("ar,", "has an empty name"),
        (",ar", "has an empty name"),
        ("ar,sd,ar", "names 'ar' twice"),
    ],
)
def test_an_empty_decoder_list_or_name_is_refused(text, message):
    with pytest.raises(DecoderError, match=message):
        split_decoders(text)


def test_a_decoder_list_splits_into_its_specs():
    assert split_decoders("ar, sd:tau=0.0 ,ss") == ["ar", "sd:tau=0.0", "ss"]
    assert [parse_decoder_spec(s) for s in split_decoders("ar,sd:tau=0.0")] == [("ar", {}), ("sd", {"tau": 0.0})]


def test_every_decoder_declares_exactly_its_keyword_options():
    """Names, order and defaults of each declaration are the decoder's signature's, and the defaults pass."""
    assert set(OPTIONS) == set(DECODERS)
    for name, fn in DECODERS.items():
        signature = {
            p.name: p.default
            for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }
        assert [(key, default) for key, _, default in option_table(name)] == list(signature.items()), name
        assert check_options(name, signature) == signature, name


# --- the command line: refused before any model loads -----------------------------------------------------------

runner = CliRunner()


@pytest.fixture
def no_model(monkeypatch):
    """Loading any model fails the test loudly (an AssertionError, not exit status 2)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("fastddrive.planner.load_model", refuse)
    monkeypatch.setattr("fastddrive.random_init.random_init_model", refuse, raising=False)


def _cli(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert not isinstance(result.exception, AssertionError), "a model was loaded before the options were checked"
    return result


@pytest.mark.parametrize(("decoder", "option", "text"), [row for row in BAD_TEXT if ":" not in row[2]][:12])
@pytest.mark.parametrize("command", ["bench", "eval"])
def test_the_command_line_refuses_bad_options_before_loading_a_model(
    no_model, tmp_path, command, decoder, option, text
):
    result = _cli(command, "--data", tmp_path, "--decoders", f"ar,{decoder}:{option}={text}")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    _names_it(" ".join(result.output.split()), decoder, option)


def test_the_loader_guard_works(no_model, tmp_path):
    """The guard above can fail: good options reach the loader, which it turns into an AssertionError."""
    result = runner.invoke(app, ["bench", "--decoders", "sd:tau=0.5", "--scenes", "1"])
    assert isinstance(result.exception, AssertionError)


@pytest.mark.parametrize(
    ("command", "decoders"),
    [
        ("eval", ","),
        ("eval", "ar,,sd"),
        ("bench", ","),
        ("bench", "ar,,sd"),
    ],
)
def test_the_command_line_refuses_an_empty_decoder_list(no_model, tmp_path, command, decoders):
    result = _cli(command, "--data", tmp_path, "--decoders", decoders)
    assert result.exit_code == 2 and ("names no decoder" in result.output or "empty name" in result.output), (
        result.output
    )


def test_plan_refuses_bad_options_before_loading_a_model(no_model, scene):
    history = str(scene.history.tolist())
    result = _cli("plan", "--history", history, "--command", scene.command, "--decoder", "sd", "--option", "tau=2.0")
    assert result.exit_code == 2 and "option tau:" in result.output
