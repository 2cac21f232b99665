import json

import pytest
import torch
from transformers import AutoModelForImageTextToText, Qwen2_5_VLForConditionalGeneration
from typer.testing import CliRunner

from fastddrive.cli import app
from fastddrive.core.memory import MemoryBudgetError
from fastddrive.decode.footprint import ModelSizes
from fastddrive.engine.random_init import architecture_config, random_init_model
from fastddrive.eval.roofline import (
    MAX_SWEEP_TOKENS,
    RooflineError,
    check_sweep,
    forward_sweep,
    measure_roofline,
    roofline_model,
    sweep_bytes,
    weight_bytes,
)

# The 3B preset at CPU-test sizes; the head size stays 128, as its mRoPE sections need.
SHRINK = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "intermediate_size": 256,
    "vocab_size": 1024,
    "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2},
}
runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def shrunk():
    return random_init_model("qwen2.5-vl-3b", "cpu", torch.float32, shrink=SHRINK)


def test_the_shrunk_preset_keeps_the_3b_architecture(shrunk, tokenizer):
    assert isinstance(shrunk.core, Qwen2_5_VLForConditionalGeneration)
    config = shrunk.core.config
    assert config.text_config.rope_parameters["mrope_section"] == [16, 24, 24]
    assert config.text_config.rope_parameters["rope_theta"] == 1_000_000.0
    assert config.vision_config.fullatt_block_indexes == [7, 15, 23, 31]
    assert config.vision_config.window_size == 112 and config.vision_config.out_hidden_size == 128
    assert config.tie_word_embeddings and shrunk.core.lm_head.weight is shrunk.text_model.embed_tokens.weight
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert config.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert shrunk.info.extra == {"random_init": "qwen2.5-vl-3b"} and shrunk.info.kind == "block-diffusion"
    assert shrunk.info.mask_token_id == tokenizer.convert_tokens_to_ids("|<MASK>|")
    assert {p.dtype for p in shrunk.core.parameters()} == {torch.float32}


def test_the_full_3b_config_has_the_published_parameter_count():
    config = architecture_config("qwen2.5-vl-3b")
    assert (config.text_config.hidden_size, config.text_config.num_hidden_layers) == (2048, 36)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    language = sum(p.numel() for p in model.model.language_model.parameters())
    assert total == pytest.approx(3.75e9, rel=0.02)
    assert language == pytest.approx(3.09e9, rel=0.02)


def test_a_head_size_that_does_not_fit_mrope_is_refused():
    with pytest.raises(ValueError, match="mrope_section"):
        architecture_config("qwen2.5-vl-3b", {"hidden_size": 64, "num_attention_heads": 4})


def test_forward_sweep_gives_one_row_per_token_count(shrunk):
    counts = (1, 3, 8)
    rows, setup_s = forward_sweep(shrunk, counts, repeats=3, warmup=1)
    assert [r.tokens for r in rows] == list(counts)
    assert all(0 < r.p10_ms <= r.median_ms <= r.p90_ms for r in rows)
    assert setup_s > 0  # the prefill and one warm-up per count, timed apart from the repeats


def test_weight_bytes_counts_the_decoder_and_the_tied_head_once(shrunk):
    parameters = list(shrunk.text_model.parameters())
    assert weight_bytes(shrunk) == sum(p.numel() * p.element_size() for p in parameters)


def test_an_untied_input_embedding_is_left_out_of_weight_bytes():
    model = random_init_model("qwen2.5-vl-3b", "cpu", torch.float32, shrink=SHRINK | {"tie_word_embeddings": False})
    embed, head = model.text_model.embed_tokens.weight, model.core.lm_head.weight
    assert embed is not head
    decoder = sum(p.numel() * 4 for p in model.text_model.parameters())
    assert weight_bytes(model) == decoder - embed.numel() * 4 + head.numel() * 4


def test_roofline_command_writes_json_and_png(tmp_path):
    figures, png = tmp_path / "roofline.json", tmp_path / "roofline.png"
    result = _run("roofline", "--model", "default", "--tokens", "1,4", "--repeats", 3, "--json", figures, "--png", png)
    assert result.exit_code == 0, result.output
    assert "floor" in result.output and "x floor" in result.output
    data = json.loads(figures.read_text())
    assert [r["tokens"] for r in data["rows"]] == [1, 4]
    assert all(r["median_ms"] > 0 for r in data["rows"])
    assert data["bandwidth_bytes_per_s"] > 0 and data["floor_ms"] > 0 and data["weight_bytes"] > 0
    assert data["model"] == "default" and data["random_init"] is None and data["dtype"] == "float32"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--random-init", "nope"), "unknown architecture preset 'nope'"),
        (("--dtype", "float7"), "unknown dtype 'float7'"),
        (("--model", "default", "--random-init", "qwen2.5-vl-3b"), "not both"),
        (("--tokens", "1,x"), "--tokens"),
    ],
)
def test_bad_roofline_settings_are_one_line_and_status_2(args, needle):
    result = _run("roofline", *args)
    assert result.exit_code == 2
    assert needle in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("tokens", "needle"),
    [
        ("100000000", "--tokens must be up to 64 distinct comma-separated integers in [1, 8192], got '100000000'"),
        ("0", "integers in [1, 8192], got '0'"),
        ("4,4", "distinct"),
        (",".join(["1"] * 65), "up to 64"),
        ("9" * 5000, "--tokens must be"),
    ],
)
def test_token_counts_past_their_bounds_are_refused_before_the_model_loads(no_model, tokens, needle):
    """`--tokens 100000000` allocated 26 GB (issue 32)."""
    result = _run("roofline", "--tokens", tokens)
    assert result.exit_code == 2, result.output
    assert needle in " ".join(result.output.split()) and "Traceback" not in result.output


@pytest.fixture
def no_model(monkeypatch):
    """Loading or building any model fails the test: bad settings are refused before."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("fastddrive.eval.roofline.load_model", refuse)
    monkeypatch.setattr("fastddrive.eval.roofline.random_init_model", refuse)


def test_repeats_and_warmup_have_upper_bounds(shrunk):
    for repeats, warmup, needle in [(10**6, 3, "--repeats must be an integer in [1, 10000]"), (5, -1, "--warmup")]:
        with pytest.raises(RooflineError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            check_sweep([1, 2], repeats, warmup)
        with pytest.raises(RooflineError, match="--"):
            measure_roofline(shrunk, [1, 2], repeats, warmup, on_forward=lambda: pytest.fail("a forward was timed"))
    with pytest.raises(RooflineError, match=f"integers in \\[1, {MAX_SWEEP_TOKENS}\\]"):
        measure_roofline(shrunk, [MAX_SWEEP_TOKENS + 1], on_forward=lambda: pytest.fail("a forward was timed"))


def test_a_sweep_over_the_memory_budget_is_refused_before_the_model_loads(no_model, monkeypatch):
    monkeypatch.setenv("FASTDDRIVE_MEMORY_BUDGET", "256MiB")
    message = r"the roofline sweep \(--tokens up to 8192\) would allocate about .* over the memory budget of 256.0 MiB"
    with pytest.raises(MemoryBudgetError, match=message):
        roofline_model(None, "qwen2.5-vl-3b", "cpu", None, False, tokens=[1, 8192])
    with pytest.raises(MemoryBudgetError, match=message):
        roofline_model("default", None, "cpu", None, False, tokens=[1, 8192])


def test_a_sweep_over_the_memory_budget_is_refused_before_it_is_measured(shrunk, monkeypatch):
    monkeypatch.setenv("FASTDDRIVE_MEMORY_BUDGET", "64MiB")  # below the bandwidth copy's two buffers
    with pytest.raises(
        MemoryBudgetError, match=r"the roofline sweep \(--tokens up to 4\) would allocate about 512.0 MiB"
    ):
        measure_roofline(shrunk, [1, 4], 3, 1, on_forward=lambda: pytest.fail("a forward was timed"))


def test_the_sweep_estimate_grows_with_the_widest_forward(shrunk):
    copy = 2 * 256 * 1024**2
    assert sweep_bytes(ModelSizes.of_model(shrunk), [1, 8192], "cpu") == copy  # the copy's buffers are the most
    sizes = ModelSizes.from_config(architecture_config("qwen2.5-vl-3b").to_dict(), 4)
    assert sweep_bytes(sizes, [8192], "cpu", 300) > sweep_bytes(sizes, [4096], "cpu", 300) > copy
    logits = 8192 * sizes.vocab * 2 * 4  # the widest forward's logits and their pick
    assert logits < sweep_bytes(sizes, [8192], "cpu", 300) < 2 * logits
