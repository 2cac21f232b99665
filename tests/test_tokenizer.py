import base64

import pytest
from transformers import AutoTokenizer, Qwen2Tokenizer

from fastddrive.core.schema import example_response, render
from fastddrive.core.tokenizer import (
    CHAT_TOKENS,
    MASK_TOKEN,
    NULL_TOKEN,
    QWEN25VL_ADDED_TOKENS,
    DiffusionTokenIds,
    add_diffusion_tokens,
    bpe_merges,
    diffusion_token_ids,
    load_tokenizer,
    qwen25vl_tokenizer,
    train_tokenizer,
)


def test_embedded_tokenizer_is_a_qwen2_tokenizer_with_every_special_token(tokenizer):
    assert isinstance(tokenizer, Qwen2Tokenizer)
    vocab = tokenizer.get_vocab()
    for token in (*CHAT_TOKENS, MASK_TOKEN, NULL_TOKEN):
        assert token in vocab
        assert tokenizer.encode(f"a{token}b", add_special_tokens=False).count(vocab[token]) == 1


def test_digits_are_split_one_per_token(tokenizer):
    ids = tokenizer.encode("+123.45 -0098", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert [p for p in pieces if p.strip().isdigit()] == list("123450098")
    assert all(len(p.strip()) == 1 for p in pieces if any(c.isdigit() for c in p))


def test_training_saving_and_auto_loading(tmp_path):
    texts = [render(example_response())] * 20 + ["Command: go_left. The car ahead is slower."] * 20
    trained = train_tokenizer(texts, vocab_size=400)
    trained.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    text = render(example_response())
    assert loaded.encode(text) == trained.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert diffusion_token_ids(loaded) == diffusion_token_ids(trained)


def test_adding_the_diffusion_tokens_to_a_tokenizer_that_lacks_them(tmp_path):
    # The same class and layout as a real Qwen2.5-VL tokenizer, without |<MASK>| and <|NULL|>.
    qwen = Qwen2Tokenizer(vocab={"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}, merges=[("a", "b")])
    qwen.add_special_tokens({"additional_special_tokens": list(CHAT_TOKENS[1:])})
    before = len(qwen)
    ids = add_diffusion_tokens(qwen)
    assert ids.added == (MASK_TOKEN, NULL_TOKEN)
    assert {ids.mask_id, ids.null_id} == {before, before + 1}
    assert qwen.encode(f"ab{MASK_TOKEN}{NULL_TOKEN}", add_special_tokens=False) == [2, ids.mask_id, ids.null_id]
    assert qwen.convert_ids_to_tokens(qwen.encode("<|im_start|>", add_special_tokens=False)) == ["<|im_start|>"]
    again = add_diffusion_tokens(qwen)
    assert again.added == () and (again.mask_id, again.null_id) == (ids.mask_id, ids.null_id)
    qwen.save_pretrained(str(tmp_path))
    reloaded = diffusion_token_ids(load_tokenizer(tmp_path))
    assert (reloaded.mask_id, reloaded.null_id) == (ids.mask_id, ids.null_id)


def test_loading_a_folder_without_a_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)


def _write_ranks(path, tokens):
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for t, rank in tokens.items()))
    return path


def test_a_qwen_tokenizer_from_bpe_ranks(tmp_path):
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256, b" a": 257, b"abab": 258, b" ab": 259}
    assert bpe_merges(ranks) == [(b"a", b"b"), (b" ", b"a"), (b"ab", b"ab"), (b" ", b"ab"), (b" a", b"b")]
    tokenizer = qwen25vl_tokenizer(_write_ranks(tmp_path / "ranks.tiktoken", ranks))
    assert tokenizer.encode("abab ab aba 12") == [258, 259, 259, 97, 32, 49, 50]  # a byte's rank is its id
    assert tokenizer.convert_tokens_to_ids(list(QWEN25VL_ADDED_TOKENS))[:3] == [260, 261, 262]
    assert diffusion_token_ids(tokenizer) == DiffusionTokenIds(282, 283)
    with pytest.raises(ValueError, match="without gaps"):
        qwen25vl_tokenizer(_write_ranks(tmp_path / "gap.tiktoken", ranks | {b"abc": 300}))
