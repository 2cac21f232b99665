"""The official release's answer text (issue 34; paper 000 section 3.2 as the Fast-dDrive release writes it).

The release writes the same four sections as `schema.render`, with three differences:

- the trajectory string puts a space after `[` and after `,`: `"[[ +014.70, -000.04], [ +029.55, ...]]"`;
- meta-behaviour values are short phrases ("keep speed ", "go straight "), free text of at most 3 tokens;
- the whole JSON is tokenized as one text, so BPE merges text across value and scaffold (`' +'`, `'.",'`).

`release_pieces` is the single definition of that text, cut where a BPE tokenizer of Qwen2's pre-tokenizer
cannot merge: each value slot owns every character that can share a pre-token with it (the sign's leading
space; the quotes and the comma around a free-text value, whose first and last characters are anyone's), so
the whole text tokenizes as its pieces do and every scaffold piece has the same ids in every answer.
`parse_release` reads the text back (`<|NULL|>` padding already stripped): a phrase of `LONGITUDINAL_PHRASES` /
`LATERAL_PHRASES` maps to our value, any other meta-behaviour text is kept verbatim.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from fastddrive.core.schema import (
    CRITICAL_OBJECT_CLASSES,
    LATERAL_BEHAVIORS,
    LONGITUDINAL_BEHAVIORS,
    SECTIONS,
    DrivingResponse,
    Piece,
    coordinate_slots,
    format_coordinate,
    from_json_object,
    json_object,
    slot_choices,
)

# The release's phrase for each of our values (its answers end a phrase with a space, which BPE merges into the
# closing quote); any phrase is read back case- and space-insensitively, our own names too.
LONGITUDINAL_PHRASES: dict[str, str] = {
    "keep": "keep speed ",
    "accelerate": "speed up ",
    "decelerate": "slow down ",
    "stop": "stop ",
    "other": "other ",
}
LATERAL_PHRASES: dict[str, str] = {
    "straight": "go straight ",
    "yield": "yield ",
    "left_turn": "turn left ",
    "right_turn": "turn right ",
    "lane_follow": "lane follow ",
    "lane_change_left": "change lane left ",
    "lane_change_right": "change lane right ",
    "reverse": "reverse ",
    "overtake": "overtake ",
    "other": "other ",
}
META_TOKEN_LIMIT = 3  # the release's budget of a meta-behaviour phrase, in tokens
FREE_TEXT_SLOTS = ("explanation", "future_meta_behavior.longitudinal", "future_meta_behavior.lateral")


def _key(text: str) -> str:
    return " ".join(text.replace("_", " ").lower().split())


_READ_LONGITUDINAL = {_key(v): v for v in LONGITUDINAL_BEHAVIORS} | {
    _key(p): v for v, p in LONGITUDINAL_PHRASES.items()
}
_READ_LATERAL = {_key(v): v for v in LATERAL_BEHAVIORS} | {_key(p): v for v, p in LATERAL_PHRASES.items()}


def meta_phrase(value: str, phrases: Mapping[str, str]) -> str:
    """The release's text of a meta-behaviour value: its phrase, or the value itself when it was kept verbatim."""
    return phrases.get(value, value)


def release_pieces(response: DrivingResponse) -> list[Piece]:
    """The release's answer text as scaffold pieces and value slots, in decode order (see the module docstring
    for where the cuts fall)."""
    co, ex, fmb, tr = SECTIONS
    pieces: list[Piece] = []
    for i, name in enumerate(CRITICAL_OBJECT_CLASSES):
        opening = '{"critical_objects": {' if i == 0 else '", '
        pieces.append(Piece(f'{opening}"{name}": "', co))
        pieces.append(Piece("yes" if response.critical_objects[name] else "no", co, f"{co}.{name}"))
    pieces.append(Piece('"}', co))

    pieces.append(Piece(', "explanation":', ex))
    pieces.append(Piece(f' "{json.dumps(response.explanation, ensure_ascii=False)[1:-1]}",', ex, ex))

    meta = response.future_meta_behavior
    pieces.append(Piece(' "future_meta_behavior": {"longitudinal":', fmb))
    longitudinal = json.dumps(meta_phrase(meta.longitudinal, LONGITUDINAL_PHRASES), ensure_ascii=False)
    pieces.append(Piece(f" {longitudinal},", fmb, f"{fmb}.longitudinal"))
    pieces.append(Piece(' "lateral":', fmb))
    lateral = json.dumps(meta_phrase(meta.lateral, LATERAL_PHRASES), ensure_ascii=False)
    pieces.append(Piece(f" {lateral}}},", fmb, f"{fmb}.lateral"))

    pieces.append(Piece(' "trajectory": "[', tr))
    for i, point in enumerate(response.trajectory):
        pieces.append(Piece("[" if i == 0 else "], [", tr))
        for axis, value in zip("xy", point, strict=True):
            int_slot, frac_slot = coordinate_slots(i, axis)
            whole, frac = format_coordinate(value).split(".")
            if axis == "y":
                pieces.append(Piece(",", tr))
            pieces.append(Piece(f" {whole}", tr, int_slot))
            pieces.append(Piece(".", tr))
            pieces.append(Piece(frac, tr, frac_slot))
    pieces.append(Piece(']]"}', tr))
    return pieces


def render_release(response: DrivingResponse) -> str:
    """The response as the release writes it."""
    return "".join(p.text for p in release_pieces(response))


def release_slot_choices(slot: str) -> tuple[str, ...] | None:
    """Every text a value slot of the release layout can hold, or None for free text (explanation, meta)."""
    if slot in FREE_TEXT_SLOTS:
        return None
    choices = slot_choices(slot)
    if choices is not None and slot.endswith(".int"):
        return tuple(f" {c}" for c in choices)
    return choices


def parse_release(text: str) -> DrivingResponse:
    """Parse a release answer (NULL padding stripped): meta-behaviour phrases mapped to our values where they
    name one, kept verbatim where they do not; ResponseError saying what is wrong."""
    data = json_object(text)
    meta = data.get("future_meta_behavior")
    if isinstance(meta, dict):
        tables = {"longitudinal": _READ_LONGITUDINAL, "lateral": _READ_LATERAL}
        data["future_meta_behavior"] = {k: _read_meta(v, tables[k]) if k in tables else v for k, v in meta.items()}
    return from_json_object(data, free_meta_text=True)


def _read_meta(value: object, table: Mapping[str, str]) -> object:
    if not isinstance(value, str):
        return value  # the schema names the wrong type
    return table.get(_key(value), value)
