"""The real Qwen2.5-VL tokenizer for tests, rebuilt offline from the BPE ranks that the `dashscope` wheel ships.

The test extra installs `dashscope` (and `tiktoken`, the reference BPE); nothing is fetched at test time. The
tokenizer takes a few seconds to build, so it is built once per test run.
"""

from __future__ import annotations

import importlib.util
import unicodedata
from functools import lru_cache
from pathlib import Path

from transformers import Qwen2Tokenizer

from conftest import explanations
from fastddrive.core.schema import SPECIAL_TOKEN_TEXT
from fastddrive.core.tokenizer import QWEN25VL_ADDED_TOKENS, qwen25vl_tokenizer

# sha256 of dashscope/resources/qwen.tiktoken, the same in dashscope 1.14.0 and 2.0.2: Qwen's 151,643 ranks.
QWEN_TIKTOKEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"


def qwen_tiktoken_path() -> Path:
    """Where the installed dashscope wheel keeps `qwen.tiktoken`, found without importing dashscope."""
    spec = importlib.util.find_spec("dashscope")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("dashscope is not installed: install the test extra (pip install -e '.[test]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: this dashscope release does not ship Qwen's BPE ranks")
    return path


@lru_cache(maxsize=1)
def qwen_tokenizer() -> Qwen2Tokenizer:
    """The real Qwen2.5-VL tokenizer with |<MASK>| and <|NULL|> added (shared: do not add tokens to it)."""
    return qwen25vl_tokenizer(qwen_tiktoken_path())


def _plain(text: str) -> bool:
    text = unicodedata.normalize("NFC", text)
    return SPECIAL_TOKEN_TEXT.search(text) is None and not any(t in text for t in QWEN25VL_ADDED_TOKENS)


# Explanations without any special token's text (those are refused, and Hypothesis finds them: it draws the
# string constants of the package, <|NULL|> and <tool_call> among them).
plain_explanations = explanations.filter(_plain)
