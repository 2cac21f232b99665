"""`fastddrive import-official` (issue 34): a synthetic official-layout folder (tiny Qwen2.5-VL dimensions, the real
Qwen2.5 vocabulary and its 151,936 embedding rows, the release's config and tensor names under both prefixes, the
head tied) is imported, its tensors equal the source's under the name mapping, and the imported folder loads and
decodes losslessly; anything unmappable is refused in one line."""

import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from typer.testing import CliRunner

from fastddrive.cli import app
from fastddrive.core.tokenizer import qwen25vl_tokenizer
from fastddrive.decode import DECODERS, decode
from fastddrive.decode.speculative import ss_nfe_floor
from fastddrive.engine.official import RELEASE_MASK_ID, RELEASE_NULL_ID, OfficialImportError, import_official, rename
from fastddrive.planner import PlanInputs, load
from model_fixtures import with_oracle
from qwen_tokenizer import qwen_tiktoken_path

VOCAB_ROWS = 151_936
LEGACY = ((re.compile(r"^model\.language_model\."), "model."), (re.compile(r"^model\.visual\."), "visual."))


def _release(root, prefixes: str, model_type: str = "fast_dllm_qwen2_5_vl", seed: int = 0):
    """A release-shaped folder: config with the release's keys, weights under `prefixes` names, its tokenizer."""
    tokenizer = qwen25vl_tokenizer(qwen_tiktoken_path(), diffusion_tokens=False)
    vocab = tokenizer.get_vocab()
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": VOCAB_ROWS,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": vocab["<|endoftext|>"],
            "eos_token_id": vocab["<|im_end|>"],
            "pad_token_id": vocab["<|endoftext|>"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 32,
            "fullatt_block_indexes": [1],
            "window_size": 112,
        },
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    root.mkdir(parents=True)
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    if prefixes == "legacy":
        state = {_legacy(k): v for k, v in state.items()}  # lm_head kept: the release saves it, equal to embed
    else:
        state.pop("lm_head.weight")
    save_file(state, str(root / "model.safetensors"))
    raw = config.to_dict()
    raw |= {"model_type": model_type, "architectures": ["Fast_dLLM_Qwen2_5_VLForConditionalGeneration"]}
    raw["auto_map"] = {"AutoModelForCausalLM": "modeling.Fast_dLLM_Qwen2_5_VLForConditionalGeneration"}
    raw["text_config"] |= {"bd_size": 32, "use_block_causal_mask": True, "complementary_mask": True}
    (root / "config.json").write_text(json.dumps(raw))
    tokenizer.save_pretrained(str(root))
    return root, state


def _legacy(name: str) -> str:
    for pattern, target in LEGACY:
        name = pattern.sub(target, name)
    return name


@pytest.fixture(scope="module", params=["legacy", "current"])
def imported(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"official-{request.param}")
    src, state = _release(base / "release", request.param)
    said = []
    report = import_official(src, base / "out", say=said.append)
    return src, base / "out", state, report, said


def test_the_imported_tensors_equal_the_sources_under_the_name_mapping(imported):
    _, out, state, report, said = imported
    written = load_file(str(out / "model.safetensors"))
    expected = {rename(k): v for k, v in state.items() if rename(k) != "lm_head.weight"}
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], expected[k]) for k in expected)
    assert report.head == "tied" and report.tokens_added == ["|<MASK>|", "<|NULL|>"]
    assert report.release_settings == {"bd_size": 32, "use_block_causal_mask": True, "complementary_mask": True}
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl" and "auto_map" not in config
    assert "bd_size" not in config["text_config"]
    info = json.loads((out / "fastddrive.json").read_text())
    assert (info["mask_token_id"], info["null_token_id"], info["block_size"]) == (RELEASE_MASK_ID, RELEASE_NULL_ID, 32)
    assert said and said[0].startswith("imported fast_dllm_qwen2_5_vl")


# The two layouts differ only in the tensor names the import maps (the test above checks each against the same
# source weights), so what is read from the written folder is tested on one of them.
@pytest.mark.parametrize("imported", ["current"], indirect=True)
def test_the_imported_folder_plans_and_the_lossless_decoders_give_ars_ids(imported):
    planner = load(imported[1])
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (900, 1600, 3), dtype=np.uint8) for _ in range(3)]  # the three front cameras
    scene = {"images": frames, "history": np.zeros((7, 6)), "command": "go_left"}
    reference = planner.plan(decoder="ar", **scene)
    assert reference.image_sizes_px == [(588, 308)] * 3  # 1600 x 900 resized to at most the release's 200,704 px
    for decoder in ("ar-jump", "ss", "jacobi"):
        assert planner.plan(decoder=decoder, **scene).token_ids == reference.token_ids, decoder
    # Acceptance exercised: oracle drafts take ss's NFE floor, corrupted ones cost forwards, never ids.
    oracle = planner.plan(decoder="ss", drafts=reference.token_ids, **scene)
    assert oracle.token_ids == reference.token_ids and oracle.nfe == ss_nfe_floor(planner.scaffold)
    corrupted = list(reference.token_ids)
    corrupted[5::7] = [planner.scaffold.null_id] * len(corrupted[5::7])
    noisy = planner.plan(decoder="ss", drafts=corrupted, **scene)
    assert noisy.token_ids == reference.token_ids and noisy.nfe > oracle.nfe


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda root: _edit_config(root, extra=7), "key 'extra' is not a Qwen2.5-VL setting"),
        (lambda root: _edit_config(root, model_type="llama"), "model_type 'llama' is not an official release's"),
        (lambda root: _retensor(root, "model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3)), "up_proj"),
        (lambda root: _retensor(root, "model.mystery.weight", torch.zeros(2)), "mystery"),
        (lambda root: (root / "model.safetensors").rename(root / "pytorch_model.bin"), "never pickles"),
    ],
)
def test_what_cannot_be_mapped_is_refused_in_one_line_before_anything_is_written(tmp_path, change, words):
    src, _ = _release(tmp_path / "release", "legacy")
    change(src)
    result = CliRunner().invoke(app, ["import-official", str(src), str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("error:") and words in " ".join(result.output.split()), result.output
    assert not (tmp_path / "out").exists()
    with pytest.raises(OfficialImportError if "model_type" in words or "key" in words else ValueError):
        import_official(src, tmp_path / "out2", say=lambda _: None)


def _edit_config(root, **changes):
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps(config | changes))


def _retensor(root, name, value):
    state = load_file(str(root / "model.safetensors"))
    state[name] = value
    save_file(state, str(root / "model.safetensors"))


# Qwen2.5-VL's chat template (the same as Qwen2-VL's; its public chat_template.json), for the release's prompt.
QWEN25VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_release_prompt_is_what_the_chat_template_gives_for_the_releases_user_turn(imported):
    import jinja2

    from fastddrive.core.release_prompt import prompt_text, release_chat_text

    history = np.array([[-3.0 + 0.5 * k, 0.1 * k, 5.0, 0.0, 0.2, -0.1] for k in range(7)])
    before, after = prompt_text("go_left", history).split("<image>")
    content = [{"type": "text", "text": before}, *[{"type": "image"}] * 3, {"type": "text", "text": after}]
    template = jinja2.Environment().from_string(QWEN25VL_CHAT_TEMPLATE)
    rendered = template.render(messages=[{"role": "user", "content": content}], add_generation_prompt=True)
    assert release_chat_text("go_left", history, images=3) == rendered
    # The imported folder asks for it: its prompt holds the release's text and three image slots.
    planner = load(imported[1])
    frames = [np.zeros((308, 588, 3), np.uint8)] * 3
    prompt = planner.prompt(PlanInputs.checked(images=frames, history=history, command="go_left"))
    text = planner.model.tokenizer.decode(prompt.input_ids[0].tolist())
    assert text.count("<|vision_start|>") == 3 and "You are a helpful assistant." in text
    assert "High-level navigation command: GO_LEFT" in text


@pytest.fixture(scope="module")
def peaky_release(imported):
    """The imported folder's model in float64 with its weights scaled so that greedy ids vary with the context (a
    random model at its initial scale writes one token everywhere), a three-camera prompt and `ar`'s ids."""
    planner = load(imported[1])
    model = planner.model
    model.model.double()
    with torch.no_grad():
        for name, parameter in model.model.named_parameters():
            if "norm" not in name and "visual" not in name:
                parameter.mul_(10.0)
    rng = np.random.default_rng(1)
    frames = [rng.integers(0, 256, (1080, 1920, 3), dtype=np.uint8) for _ in range(3)]
    history = np.array([[-3.0 + 0.5 * k, 0.1 * k, 5.0, 0.0, 0.2, -0.1] for k in range(7)])
    prompt = planner.prompt(PlanInputs.checked(images=frames, history=history, command="go_right"))
    reference = decode("ar", model, prompt, planner.scaffold).token_ids
    values = [t for t, v in zip(reference, planner.scaffold.is_value, strict=True) if v]
    assert len(set(values)) > 20  # the reference varies, so equal ids are no coincidence
    return model, prompt, planner.scaffold, reference


@pytest.mark.parametrize("imported", ["current"], indirect=True)  # one layout: see the plan test
@pytest.mark.parametrize("rate", [0.0, 0.2])
def test_every_lossless_decoder_gives_ars_ids_on_the_release_layout_with_drafts_of_known_quality(
    peaky_release, monkeypatch, rate
):
    model, prompt, scaffold, reference = peaky_release
    assert scaffold.scaffold_tokenization == "release"
    oracle = with_oracle(monkeypatch, reference, rate, len(model.tokenizer))  # selfspec's drafts
    drafts = oracle.tokens
    runs = {
        "ss fused": decode("ss", model, prompt, scaffold, drafts=drafts),
        "ss": decode("ss", model, prompt, scaffold, drafts=drafts, fuse_draft=False),
        "selfspec": decode("selfspec", model, prompt, scaffold),
        "ar-jump": decode("ar-jump", model, prompt, scaffold),
        "jacobi": decode("jacobi", model, prompt, scaffold, drafts=drafts),
        "jacobi-mr": decode("jacobi-mr", model, prompt, scaffold, drafts=drafts),
    }
    for name, result in runs.items():
        assert result.token_ids == reference, name
        if rate == 0.0 and name != "ar-jump":
            assert max(result.accepted_per_step) >= 8, name  # the drafts were accepted
    floor = ss_nfe_floor(scaffold)
    if rate == 0.0:
        assert runs["ss fused"].nfe == floor and runs["ss"].nfe == ss_nfe_floor(scaffold, fuse_draft=False)
    else:
        assert runs["ss fused"].nfe > floor  # a wrong draft costs forwards, never ids


@pytest.fixture(scope="module")
def merge_episodes(tmp_path_factory):
    """Two merge episodes: the data both presets continue training on."""
    from fastddrive.data.build import build_dataset

    root = tmp_path_factory.mktemp("release-train-data") / "data"
    build_dataset(root, 2, 21, ["merge"])
    return root


@pytest.mark.parametrize("imported", ["current"], indirect=True)  # the prefixes differ only in the import
@pytest.mark.parametrize("preset", ["tiny-ar", "tiny-sasd"])
def test_training_continues_the_imported_model_in_the_release_layout(
    imported, tmp_path_factory, merge_episodes, preset
):
    from fastddrive.core.release_answer import render_release
    from fastddrive.data.dataset import DrivingDataset
    from fastddrive.engine.model_files import load_model
    from fastddrive.train.collate import DualStreamCollator
    from fastddrive.train.config import load_config
    from fastddrive.train.loop import continued_layout, initial_model, train

    base = tmp_path_factory.mktemp(f"release-train-{preset}")
    config = load_config(
        preset,
        init_from=str(imported[1]),
        data=str(merge_episodes),
        out=str(base / "run"),
        steps=1,
        batch_size=1,
        validation_samples=0,  # the random weights' answers mean nothing
        checkpoint_every=1,
        warmup_steps=1,
        image_min_pixels=56 * 56,
        image_max_pixels=112 * 56,  # small frames: the test is about the answer layout
    )
    carried = continued_layout(config, imported[1])
    assert (carried.scaffold_tokenization, carried.explanation_budget) == ("release", 192)  # the folder's, unasked
    # The targets are the release's text as one tokenization, and the prompt the release's with three cameras.
    model = initial_model(carried)
    planner_scaffold = load(imported[1]).scaffold
    sample = next(iter(DrivingDataset.open(merge_episodes).samples("train")))
    example = DualStreamCollator(model, planner_scaffold, carried).example(sample)
    ids = [t for t in example.response.tolist() if t != planner_scaffold.null_id]
    if preset == "tiny-ar":
        assert ids[-1] == model.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = ids[:-1]
    assert ids == model.tokenizer.encode(render_release(sample.response))
    prompt = model.tokenizer.decode(example.prompt.input_ids[0].tolist())
    assert prompt.count("<|vision_start|>") == 3 and "High-level navigation command:" in prompt

    report = train(config, say=lambda _: None)
    info = json.loads((report.final / "fastddrive.json").read_text())
    assert (info["scaffold_tokenization"], info["explanation_budget"], info["prompt"]) == ("release", 192, "release")
    assert info["cameras"] == ["FRONT_LEFT", "FRONT", "FRONT_RIGHT"]
    trained = load(report.final)
    assert trained.scaffold.scaffold_tokenization == "release"
    assert not torch.equal(  # the weights moved
        load_model(report.final).model.get_input_embeddings().weight, model.model.get_input_embeddings().weight
    )


@pytest.mark.parametrize("imported", ["current"], indirect=True)
def test_plan_on_the_command_line_takes_the_three_front_cameras_of_the_users_sizes(imported, tmp_path):
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    rng = np.random.default_rng(2)
    cameras = []
    sizes = [(1920, 1080), (1600, 900), (1920, 1080)]  # (width, height)
    for name, (width, height) in zip(("FRONT_LEFT", "FRONT", "FRONT_RIGHT"), sizes, strict=True):
        path = tmp_path / f"{name}.jpg"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path, format="JPEG")
        cameras += ["--camera", f"{name}={path}"]
    history = json.dumps(np.zeros((7, 6)).tolist())
    args = ["plan", "--model", str(imported[1]), "--history", history, "--command", "go_left", "--json"]
    result = CliRunner().invoke(app, [*args, *cameras, "--decoder", "ss"])
    assert result.exit_code in (0, 1), result.output  # 1: the random weights' answer does not parse
    answer = json.loads(result.stdout)
    release = [smart_resize(h, w, 28, 200_704, 200_704)[::-1] for w, h in sizes]
    assert answer["image_sizes_px"] == [list(size) for size in release]  # each camera at the release's pixels
    assert len(answer["token_ids"]) == 404  # the release layout with the real vocabulary
    missing = CliRunner().invoke(app, [*args, *cameras[:4]])  # FRONT_LEFT and FRONT only
    assert missing.exit_code == 2 and "camera FRONT_RIGHT is missing" in missing.output


# Options that bound the work of a random model over 151,936 logits per position (confidence never reaches 0.9).
QUICK_OPTIONS = {
    "mdm": {"tau": 0.0},
    "sd": {"tau": 0.0},
    "pvf": {"tau": 0.0, "planning": False},  # no planning vocabulary calibrated for this folder
    "selfspec-quad": {"block_size": 4},
    "tts": {"rollouts": 2},
}


@pytest.mark.parametrize("imported", ["current"], indirect=True)
def test_every_decoder_runs_on_the_imported_folder(imported):
    planner = load(imported[1])
    frames = [np.zeros((308, 588, 3), np.uint8)] * 3
    # fullseq re-reads the whole answer's 151,936-row logits at each of its ~200 steps here (43 s on 2 cores); it
    # runs on the embedded model in test_decoders, which exercises the same code on another layout. ar, ar-jump,
    # ss and jacobi run on this folder, ids checked, in test_the_imported_folder_plans_and_the_lossless_decoders...
    for decoder in sorted(set(DECODERS) - {"fullseq", "ar", "ar-jump", "ss", "jacobi"}):
        options = QUICK_OPTIONS.get(decoder, {})
        result = planner.plan(
            decoder=decoder, images=frames, history=np.zeros((7, 6)), command="go_straight", **options
        )
        assert len(result.token_ids) == len(planner.scaffold) == 404 and result.nfe >= 1, decoder
