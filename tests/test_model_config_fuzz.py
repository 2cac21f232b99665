"""Model folders whose config.json, weights header, tokenizer or fastddrive.json are damaged or disagree are refused
in one line (ModelFileError) before transformers loads anything; never another exception (issue 32).

The property tests mutate a tiny saved model: its config.json (wrong types, zero, negative and huge sizes,
deleted keys, sizes that disagree with the weights) and its safetensors header (shapes, dtypes, offsets,
names, the header length); `load_model` either loads the folder or raises ModelFileError with one line."""

import copy
import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastddrive.engine.model import CheckpointInfo
from fastddrive.engine.model_check import ModelFileError, check_model_folder
from fastddrive.engine.model_files import load_model, save_model
from model_fixtures import vision_model

FUZZ = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen2.5-VL folder (2 layers of width 64) that loads for inference."""
    folder = tmp_path_factory.mktemp("fuzz") / "tiny"
    model = vision_model()
    model.info = CheckpointInfo(kind="autoregressive")
    save_model(model, folder)
    return folder


def _copy(tiny, tmp_path, name="model"):
    folder = tmp_path / name
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(tiny, folder)
    return folder


def _edit_config(folder, edit):
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def _refused(folder, *needles):
    with pytest.raises(ModelFileError) as caught:
        load_model(folder)
    message = str(caught.value)
    assert "\n" not in message and all(n in message for n in needles), message
    return message


def _layers(n):
    def edit(config):
        config["text_config"]["num_hidden_layers"] = n
        config["text_config"]["layer_types"] = ["full_attention"] * n

    return edit


@pytest.mark.parametrize(
    ("edit", "needles"),
    [
        (_layers(1), ["model.layers.1.", "num_hidden_layers 1"]),  # fewer layers: once loaded with half dropped
        (_layers(3), ["lack model.language_model.layers.2.", "num_hidden_layers 3"]),
        (lambda c: c["text_config"].update(hidden_size=128), ["model.embed_tokens.weight is [815, 64]", "[815, 128]"]),
        (lambda c: c["text_config"].update(vocab_size=900), ["model.embed_tokens.weight is [815, 64]", "[900, 64]"]),
        (lambda c: c["vision_config"].update(depth=3), ["lack model.visual.blocks.2.", "depth 3"]),
        (lambda c: c.update(tie_word_embeddings=False), ["lack lm_head.weight"]),
        (lambda c: c["text_config"].update(hidden_size="64"), ["config.json", "text_config.hidden_size", "'64'"]),
        (lambda c: c["text_config"].update(num_attention_heads=-4), ["text_config.num_attention_heads", "-4"]),
        (lambda c: c["vision_config"].update(depth=0), ["vision_config.depth must be a positive integer"]),
        (lambda c: c.update(text_config=[1, 2]), ["text_config must be a JSON object"]),
        (lambda c: c.update(model_type="llama"), ["model_type 'llama'"]),
        (lambda c: c.update(tie_word_embeddings="yes"), ["config.json", "tie_word_embeddings"]),
        (lambda c: c.update(image_token_id=0), ["image_token_id is 0 but the tokenizer's <|image_pad|> is"]),
        (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[1, 1]), ["mrope_section [1, 1]"]),
    ],
)
def test_a_config_that_disagrees_with_its_weights_is_named(tiny, tmp_path, edit, needles):
    folder = _copy(tiny, tmp_path)
    _edit_config(folder, edit)
    _refused(folder, *needles)


@pytest.mark.parametrize(
    ("damage", "needles"),
    [
        (lambda f: (f / "config.json").write_bytes(b"\xff\xfe{}"), ["config.json is not UTF-8"]),
        (lambda f: (f / "config.json").write_text("[]"), ["config.json is not a JSON object"]),
        (lambda f: (f / "tokenizer.json").write_text("{}"), ["tokenizer.json is not a tokenizer", "'model'"]),
        (lambda f: (f / "tokenizer.json").unlink(), ["holds no tokenizer.json"]),
        (lambda f: (f / "tokenizer_config.json").write_text('"x"'), ["tokenizer_config.json is not a JSON object"]),
        (lambda f: (f / "fastddrive.json").write_text('{"kind": "big"}'), ["fastddrive.json: kind must be"]),
        (lambda f: (f / "fastddrive.json").write_text('{"block_size": -2}'), ["fastddrive.json: block_size"]),
    ],
)
def test_damaged_small_files_are_named(tiny, tmp_path, damage, needles):
    folder = _copy(tiny, tmp_path)
    damage(folder)
    _refused(folder, *needles)


def test_the_tiny_folder_loads_and_the_check_reads_no_weights(tiny):
    checked = check_model_folder(tiny)
    assert (checked.vocab_size, checked.hidden_size, checked.layers) == (815, 64, 2)
    assert load_model(tiny).info.kind == "autoregressive"


# --- property tests --------------------------------------------------------------------------------------------

SECTIONS = ("", "text_config", "vision_config")
VALUES = st.one_of(
    st.integers(-3, 3),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=4),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-2, 10), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)
# A mutation: (section, key index, what): a new value, the key deleted, or an integer size scaled.
CONFIG_MUTATIONS = st.tuples(
    st.sampled_from(SECTIONS),
    st.integers(0, 40),
    st.one_of(VALUES, st.just("delete"), st.sampled_from([0, -1, 2, 1000]).map(lambda f: ("scale", f))),
)


def _mutated(config, mutations):
    config = copy.deepcopy(config)
    for section, index, change in mutations:
        holder = config if not section else config.get(section)
        if not isinstance(holder, dict) or not holder:
            continue
        key = sorted(holder)[index % len(holder)]
        if change == "delete":
            del holder[key]
        elif isinstance(change, tuple):
            if isinstance(holder[key], int) and not isinstance(holder[key], bool):
                holder[key] *= change[1]
        else:
            holder[key] = change
    return config


def _loads_or_one_line(folder):
    try:
        load_model(folder)
    except ModelFileError as err:
        assert "\n" not in str(err) and str(err), str(err)


@FUZZ
@given(mutations=st.lists(CONFIG_MUTATIONS, min_size=1, max_size=3))
def test_any_config_loads_or_is_refused_in_one_line(tiny, tmp_path, mutations):
    folder = _copy(tiny, tmp_path)
    config = json.loads((tiny / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(_mutated(config, mutations)))
    _loads_or_one_line(folder)


def _header(folder):
    raw = (folder / "model.safetensors").read_bytes()
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


FIELDS = st.sampled_from(["shape", "dtype", "data_offsets", "rename", "drop", "entry", "reverse-shape"])
HEADER_VALUES = st.one_of(VALUES, st.sampled_from(["F16", "BF16", "I32", "BOOL", "F64", "X"]))
LENGTHS = st.sampled_from([0, 0, 1, -1, 2**62, "zero"])


@FUZZ
@given(
    mutations=st.lists(st.tuples(st.integers(0, 200), FIELDS, HEADER_VALUES), min_size=1, max_size=3), length=LENGTHS
)
def test_any_weights_header_loads_or_is_refused_in_one_line(tiny, tmp_path, mutations, length):
    folder = _copy(tiny, tmp_path)
    header, data = _header(tiny)
    for index, field, value in mutations:
        names = sorted(n for n in header if n != "__metadata__")
        name = names[index % len(names)]
        entry = header[name]
        if field == "rename":
            header[str(value)] = header.pop(name)
        elif field == "drop":
            del header[name]
        elif field == "entry":
            header[name] = value
        elif field == "reverse-shape" and isinstance(entry, dict) and isinstance(entry.get("shape"), list):
            entry["shape"] = entry["shape"][::-1]
        elif isinstance(entry, dict):
            entry[field] = value
    text = json.dumps(header).encode()
    size = 0 if length == "zero" else len(text) + length
    (folder / "model.safetensors").write_bytes(size.to_bytes(8, "little") + text + data)
    _loads_or_one_line(folder)
