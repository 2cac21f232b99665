"""What a decoder returns, and the report every decoder run produces (DESIGN section 6)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastddrive.core.schema import DrivingResponse


@dataclass
class Decoded:
    """A decoder's own output: the response ids and how many tokens each step committed."""

    token_ids: list[int]
    accepted_per_step: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class DecodeResult:
    """One decoded answer and its cost.

    `nfe` counts model forward calls, prefill included; `fed_tokens` the tokens the forwards after the
    prefill carried (drafts, branches, candidates and every row of a batched forward included: what the
    forwards cost, not what they commit). `tokens` counts the answer's real tokens: scaffold and value
    tokens, <|NULL|> padding not counted (the length of the JSON text in tokens, which is also what an AR
    model writing the JSON freely emits). `prefill_ms` is the first forward (image and prompt),
    `decode_ms` everything after it. `response` is None when the text does not parse (`error` says why).
    `image_sizes_px`: the (width, height) each camera frame was resized to before the model saw it.
    """

    decoder: str
    token_ids: list[int]
    text: str
    response: DrivingResponse | None
    nfe: int
    tokens: int
    fed_tokens: int
    accepted_per_step: list[int]
    prefill_ms: float
    decode_ms: float
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    image_sizes_px: list[tuple[int, int]] = field(default_factory=list)  # (width, height) each image was resized to

    @property
    def latency_ms(self) -> float:
        return self.prefill_ms + self.decode_ms

    @property
    def tokens_per_nfe(self) -> float:
        return self.tokens / self.nfe if self.nfe else 0.0

    @property
    def fed_per_forward(self) -> float:
        """Tokens each forward after the prefill carried, on average."""
        return self.fed_tokens / (self.nfe - 1) if self.nfe > 1 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tokens / self.latency_ms if self.latency_ms else 0.0

    def to_json(self) -> dict[str, Any]:
        """The `fastddrive plan --json` object."""
        return {
            "decoder": self.decoder,
            "response": self.response.model_dump(mode="json") if self.response else None,
            "text": self.text,
            "token_ids": self.token_ids,
            "nfe": self.nfe,
            "tokens": self.tokens,
            "fed_tokens": self.fed_tokens,
            "prefill_ms": round(self.prefill_ms, 3),
            "decode_ms": round(self.decode_ms, 3),
            "accepted_per_step": self.accepted_per_step,
            "error": self.error,
            "image_sizes_px": [list(size) for size in self.image_sizes_px],
        }
