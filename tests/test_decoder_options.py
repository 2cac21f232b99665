"""Decoder options are declared with types and ranges and checked before any work (issue 16, item 1): the
command line's text strictly, the API's values alike, one DecoderError line naming decoder, option and range.
Every number has an upper bound too (issue 32, item 2)."""

import inspect
import math
import re

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
    # upper bounds (issue 32): each of these allocated gigabytes before
    ("tts", "rollouts", "100000"),
    ("selfspec-quad", "block_size", "100000"),
    ("selfspec-quad", "block_size", "129"),
    ("jacobi-mr", "max_blocks", "1000000"),
    ("jacobi-mr", "candidates", "1000000"),
    ("jacobi-mr", "block_size", "1025"),
    ("sd", "block_size", "100000"),
    ("ss", "block_size", "1025"),
    ("selfspec", "block_size", "1025"),
    ("jacobi", "block_size", "1000000"),
    ("tts", "rollout_window", "1025"),
    ("pvf", "width", "65"),
    ("pvf", "reveal", "1025"),
    ("tts", "temperature", "101"),
    ("ar", "temperature", "1e-310"),
    ("ss", "drafts", "[4294967296]"),
    ("ss", "drafts", "[" * 5000),
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
    ("tts", "rollouts", 100_000),
    ("selfspec-quad", "block_size", 100_000),
    ("jacobi-mr", "max_blocks", 10**6),
    ("jacobi-mr", "candidates", 10**6),
    ("tts", "temperature", 10**400),
    pytest.param("sd", "block_size", 10**5000, id="sd-block_size-5001 digits"),  # more than repr() writes
    ("ss", "drafts", list(range(2000))),
    ("ss", "drafts", range(10**12)),
]
RANGES = {
    "tau": "[0, 1]",
    "block_size": "an integer in [",
    "seed": "[0, 2^63 - 1]",
    "rollouts": "[1, 256]",
    "rollout_window": "[1, 1024]",
    "temperature": "[0, 100] (0 is greedy; a sampling temperature is at least 0.001)",
    "max_blocks": "[1, 64]",
    "candidates": "[0, 64]",
    "width": "[1, 64]",
    "reveal": "[0, 1024]",
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
    monkeypatch.setattr("fastddrive.engine.random_init.random_init_model", refuse, raising=False)


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


# --- refused before the costly work: range, vocabulary, memory (issue 32) ------------------------------------


@pytest.fixture
def frame(tmp_path):
    from PIL import Image

    path = tmp_path / "frame.png"
    Image.fromarray(np.zeros((224, 448, 3), np.uint8)).save(path)
    return path


def _plan_cli(scene, frame, *args):
    history = str(scene.history.tolist())
    return _cli("plan", "--history", history, "--command", scene.command, "--image", frame, *args)


def _one_line(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return " ".join(result.output.split())


def test_plan_refuses_a_value_past_its_upper_bound_before_loading(no_model, scene, frame):
    output = _one_line(_plan_cli(scene, frame, "--decoder", "tts", "--option", "rollouts=100000"))
    assert "decoder 'tts' option rollouts: got '100000', expected an integer in [1, 256]" in output


def test_plan_refuses_a_decode_over_the_memory_budget_before_loading(no_model, scene, frame, monkeypatch):
    monkeypatch.setenv("FASTDDRIVE_MEMORY_BUDGET", "64MiB")
    output = _one_line(_plan_cli(scene, frame, "--decoder", "tts", "--option", "rollouts=256"))
    assert "decoder 'tts' with rollouts=256 would allocate about" in output
    assert "over the memory budget of 64.0 MiB" in output


def test_plan_refuses_drafts_outside_the_vocabulary_before_loading(no_model, scene, frame):
    output = _one_line(_plan_cli(scene, frame, "--decoder", "ss", "--option", "drafts=[3, 900]"))
    assert "decoder 'ss' option drafts: token id 900 is outside the model's vocabulary of 815 tokens" in output


def test_plan_lists_each_option_with_its_range(no_model):
    result = _cli("plan", "--decoder", "jacobi-mr", "--show-options")
    assert result.exit_code == 0, result.output
    assert "max_blocks" in result.output and "[1, 64]" in result.output and "candidates" in result.output


@pytest.fixture
def no_forward(planner, monkeypatch):
    """Any forward of the planner's model (the prefill included) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model ran a forward")

    monkeypatch.setattr(planner.model, "prefill", refuse)
    monkeypatch.setattr(planner.model, "forward", refuse)


@pytest.mark.parametrize(
    ("decoder", "drafts", "message"),
    [
        ("ss", [815] * 261, "decoder 'ss' option drafts: token id 815 is outside the model's vocabulary of 815 tokens"),
        ("jacobi", [0, 2**31 - 1], "token id 2147483647 is outside the model's vocabulary of 815 tokens (ids 0..814)"),
        ("jacobi-mr", [7] * 10 + [10**6], "token id 1000000 is outside"),
        ("ss", [0] * 10, "decoder 'ss' option drafts: got 10 ids, expected one per answer position (261)"),
        ("jacobi", [0] * 262, "decoder 'jacobi' option drafts: got 262 ids, more than the answer's 261 positions"),
    ],
)
def test_drafts_outside_the_vocabulary_or_the_answer_are_refused_before_any_forward(
    planner, scene, no_forward, decoder, drafts, message
):
    with pytest.raises(DecoderError, match=re.escape(message)):
        planner.plan(scene, decoder, drafts=drafts)
    with pytest.raises(DecoderError, match=re.escape(message)):
        planner.facts.check_options(decoder, {"drafts": drafts})  # what a service checks before it queues


def test_a_decode_over_the_memory_budget_is_refused_before_any_forward(planner, scene, no_forward, monkeypatch):
    from fastddrive.core.memory import MemoryBudgetError

    monkeypatch.setenv("FASTDDRIVE_MEMORY_BUDGET", "32MiB")
    with pytest.raises(MemoryBudgetError, match=r"decoder 'selfspec-quad' with block_size=64 would allocate about"):
        planner.plan(scene, "selfspec-quad", block_size=64)
    with pytest.raises(MemoryBudgetError, match=r"decoder 'tts' with rollouts=200 would allocate about .* 32.0 MiB"):
        planner.facts.check_memory("tts", {"rollouts": 200})
