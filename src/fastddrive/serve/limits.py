"""The service's own limits (issue 32): what one request may hold and ask for, stricter than the library's.

The library takes any scene and any option value within the decoders' ranges, since on the command line the
user pays for what they ask. A service shares one model among clients, so a request is bounded before any
work: the body's size and the time it may take to arrive (413, 408: `guards.BodyLimit`), the values it holds
before it is parsed, the number of images and their pixels read from each image's header before it is
decoded (a decompression bomb is refused from its header), and a cap per decoder option (422 naming it).
`fastddrive serve` sets them; the OpenAPI schema states them.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fastddrive.core.sample import HISTORY_STEPS
from fastddrive.decode.options import OPTIONS
from fastddrive.decode.registry import DecoderError

MIB = 2**20
# A cap names an option of every decoder that takes it ("block_size"), or of one decoder ("tts.block_size"),
# which wins. Each is a multiple of the paper's or the library's default, where memory or time grows with it.
DEFAULT_OPTION_CAPS: dict[str, int] = {
    "block_size": 64,  # tokens per block (defaults 16 and 32)
    "selfspec-quad.block_size": 16,  # block_size^2 tokens per forward (default 8)
    "rollouts": 8,  # `tts` rollouts in one cache (the paper's 4)
    "rollout_window": 64,  # `tts` lock-step window (default 24)
    "width": 8,  # `pvf` branches per forward (the paper's 4)
    "reveal": 64,  # `pvf` masks left when the next block is revealed (default off)
    "max_blocks": 4,  # `jacobi-mr` blocks in flight (the paper's 2)
    "candidates": 16,  # `jacobi-mr` recycled n-grams per forward (default 4)
}
# A plan request holds 7 history rows of 6 numbers, a few images and options (drafts: a few hundred ids), so its
# JSON has a few hundred list items and object members, each after a comma; this many more is no plan request.
SPARE_COMMAS = 4096


class LimitError(ValueError):
    """A request past one of the service's limits; the message names the limit."""


class ServiceLimits(BaseModel):
    """What one request may hold; every limit is a positive number (`fastddrive serve --help` names them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(16 * MIB, ge=1024, description="Largest request body (413).")
    body_timeout_s: float = Field(30.0, gt=0, description="Time a request body may take to arrive (408).")
    max_images: int = Field(8, ge=1, description="Images per request (422).")
    max_image_pixels: int = Field(2048 * 2048, ge=28 * 28, description="Pixels of one image, from its header (422).")
    max_request_pixels: int = Field(4096 * 4096, ge=28 * 28, description="Pixels of all images of a request (422).")
    option_caps: dict[str, int] = Field(
        default_factory=lambda: dict(DEFAULT_OPTION_CAPS),
        description="The largest value of a decoder option, by 'option' or 'decoder.option' (422).",
    )

    @model_validator(mode="after")
    def _caps_name_options(self) -> ServiceLimits:
        for key, cap in self.option_caps.items():
            check_cap(key, cap)
        return self

    @property
    def max_commas(self) -> int:
        """More commas than a plan request's JSON can hold (`check_shape`)."""
        return SPARE_COMMAS + 2 * self.max_images

    def cap(self, decoder: str, option: str) -> int | None:
        """The largest value this service takes for `option` of `decoder`, or None (the library's range)."""
        return self.option_caps.get(f"{decoder}.{option}", self.option_caps.get(option))

    def check_shape(self, body: bytes) -> None:
        """LimitError when a JSON body holds more values than a plan request can: a scan of the bytes, before
        the parser builds them (parsing a body of numbers holds the interpreter lock about 0.1 s per MB)."""
        commas = body.count(b",")
        if commas > self.max_commas:
            raise LimitError(
                f"the body has {commas} commas, more list items and object members than a plan request holds"
                f" (at most {self.max_commas}: {HISTORY_STEPS} history rows of 6 numbers, at most"
                f" {self.max_images} images and the decoder's options)"
            )

    def check_pixels(self, sizes: list[tuple[str, int, int]]) -> None:
        """LimitError when an image (name, width, height) or all of them together have more pixels than allowed."""
        for name, width, height in sizes:
            if width * height > self.max_image_pixels:
                raise LimitError(
                    f"{name} is {width}x{height} px, more than the {self.max_image_pixels} px an image may have"
                )
        total = sum(width * height for _, width, height in sizes)
        if total > self.max_request_pixels:
            raise LimitError(
                f"the images have {total} px together, more than the {self.max_request_pixels} px a request may have"
            )

    def described(self) -> str:
        """The limits in words, for the OpenAPI description."""
        caps = ", ".join(f"{key} <= {cap}" for key, cap in sorted(self.option_caps.items()))
        return (
            f"Limits of this server: a body of at most {self.max_body_bytes} bytes (413) that arrives within"
            f" {self.body_timeout_s:g} s (408); at most {self.max_images} images, {self.max_image_pixels} px each"
            f" and {self.max_request_pixels} px together, read from the images' headers before decoding (422);"
            f" decoder options at most: {caps} (422)."
        )


def check_cap(key: str, cap: int) -> None:
    """DecoderError unless `key` ('option' or 'decoder.option') names an integer option and `cap` is >= 1."""
    decoder, _, option = key.rpartition(".")
    models = [OPTIONS[decoder]] if decoder in OPTIONS else [] if decoder else list(OPTIONS.values())
    integer = any(option in m.model_fields and m.model_fields[option].annotation is int for m in models)
    if not integer:
        raise DecoderError(f"option cap {key!r} names no integer option of a decoder (e.g. rollouts, tts.rollouts)")
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise DecoderError(f"option cap {key}: got {cap!r}, expected an integer >= 1")


def parse_caps(pairs: Iterable[str]) -> dict[str, int]:
    """['tts.rollouts=16', 'width=4'] -> the default caps with these set; DecoderError names a bad pair."""
    caps = dict(DEFAULT_OPTION_CAPS)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not value.strip().isdigit():
            raise DecoderError(f"an option cap is OPTION=N or DECODER.OPTION=N with N an integer >= 1, got {pair!r}")
        check_cap(key.strip(), int(value))
        caps[key.strip()] = int(value)
    return caps
