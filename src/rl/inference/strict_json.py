"""Untrusted JSON, parsed strictly: UTF-8 only, nesting bounded before parsing (json recurses per level), finite
numbers, integers of sane length, no lone surrogates; each refusal a ValueError saying what is wrong."""

import json
import re

JSON_STRING_OR_NOT_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|[^\[\]{}]', re.DOTALL)
MAX_INT_DIGITS = 100  # an int64 has 19


def parse_json(body: bytes, max_depth: int) -> object:
    """JSON in UTF-8 nested at most `max_depth` arrays/objects deep, with finite numbers and UTF-8 strings;
    ValueError saying what is wrong otherwise. The depth is checked before parsing (json recurses per level)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"is not UTF-8 ({e.reason} at byte {e.start})") from None
    if json_depth(text) > max_depth:
        raise ValueError(f"is nested deeper than {max_depth} levels")
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_short_int)
    except json.JSONDecodeError as e:
        raise ValueError(f"is not JSON: {e}") from None
    try:  # a "\ud800" escape parses to a lone surrogate, which no file name or response can encode
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds a lone surrogate (an unpaired \\ud800-\\udfff escape): strings must be UTF-8") from None
    return data


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON `text` (brackets inside strings do not count)."""
    brackets = JSON_STRING_OR_NOT_BRACKET.sub("", text)
    depth = deepest = 0
    for bracket in brackets:
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _refuse_constant(name: str):
    raise ValueError(f"holds {name}, which is not a JSON number")


def _short_int(literal: str) -> int:
    if len(literal) > MAX_INT_DIGITS:  # Python refuses to parse past 4300 digits; no field needs more than 19
        raise ValueError(f"holds an integer of {len(literal)} digits (at most {MAX_INT_DIGITS})")
    return int(literal)


def _finite_float(literal: str) -> float:
    value = float(literal)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"holds the number {literal[:32]}, which overflows a float")
    return value
