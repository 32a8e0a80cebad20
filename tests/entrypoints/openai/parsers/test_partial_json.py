"""`partial_json.JsonWriter`: strict JSON read in pieces and written back in
`json.dumps(..., ensure_ascii=False)` form, never taking back what it wrote."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from hotswap.entrypoints.openai.parsers.partial_json import (
    DONE,
    FAILED,
    OPEN,
    JsonWriter,
    canonical_object,
    number_text,
)

ALPHABET = ['"', "\\", "/", "\n", "\t", "\x01", "\x7f", "é", "😀", "\u2028", "<", " ", "a", "Z"]


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -7, 10**30, rng.randrange(-(10**6), 10**6)])
    if kind == 2:
        return rng.choice([0.5, -0.0, 1e-7, 2.5e20, 1 / 3, rng.uniform(-1e6, 1e6)])
    if kind in (3, 4):
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(6)))
    if kind == 5:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {
        "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(4))): random_value(rng, depth + 1)
        for _ in range(rng.randrange(4))
    }


def random_text(rng: random.Random, value: Any) -> str:
    """`value` as a model might write it: any spacing, escaped or not."""
    return json.dumps(
        value,
        ensure_ascii=rng.random() < 0.5,
        indent=rng.choice([None, 0, 2]),
        separators=rng.choice([None, (",", ":"), (" , ", " : ")]),
    )


def write(text: str, pieces: list[str] | None = None) -> tuple[str, str]:
    """(state, text written) after reading `text` in `pieces` and finishing."""
    writer, written = JsonWriter(), []
    for piece in pieces or [text]:
        writer.feed(piece)
        written.append(writer.take())
    writer.finish()
    return writer.state, "".join(written) + writer.take()


def random_pieces(rng: random.Random, text: str) -> list[str]:
    cuts = sorted({rng.randrange(len(text) + 1) for _ in range(rng.randrange(8))})
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_random_documents_are_written_as_json_dumps_writes_them() -> None:
    rng = random.Random(0)
    for _ in range(400):
        value = random_value(rng)
        text = random_text(rng, value)
        expected = json.dumps(value, ensure_ascii=False)
        assert write(text) == (DONE, expected), text
        assert write(text, random_pieces(rng, text)) == (DONE, expected), text
        assert write(text, list(text)) == (DONE, expected), text


def test_every_prefix_is_written_as_a_prefix_that_closes_into_json() -> None:
    rng = random.Random(1)
    for _ in range(60):
        value = {"k": random_value(rng), "l": [random_value(rng)]}
        text = random_text(rng, value)
        final = json.dumps(value, ensure_ascii=False)
        writer, written = JsonWriter(), ""
        for ch in text:
            writer.feed(ch)
            written += writer.take()
            assert final.startswith(written), (text, written)
            closed = json.loads(written + writer.closers())  # valid JSON at every point
            assert isinstance(closed, dict)


def test_escapes_and_surrogates_decode_as_json_loads_decodes_them() -> None:
    for text in [
        r'"\ud83d\ude00"',  # a pair: one character
        r'"\ud83d"',  # a lone high half
        r'"\ud83dx\ude00"',  # halves apart: two lone ones
        r'"\ud83d\ud83d\ude00"',  # a lone high half, then a pair
        r'"\ude00\ud83d"',
        r'"\u00e9\/\b\f\n\r\t\"\\\u0000\u001f\u007f"',
    ]:
        assert write(text) == (DONE, json.dumps(json.loads(text), ensure_ascii=False)), text
        assert write(text, list(text))[1] == write(text)[1], text


@pytest.mark.parametrize(
    "token", ["0", "-0", "-0.0", "1.0", "2.50", "1e5", "1E-7", "-12.5e+3", "10" * 20, "7"]
)
def test_numbers_are_written_as_python_reads_and_writes_them(token: str) -> None:
    assert number_text(token) == json.dumps(json.loads(token))
    assert write(f"[{token}]") == (DONE, f"[{json.dumps(json.loads(token))}]")


@pytest.mark.parametrize("token", ["01", "1.", ".5", "1e", "-", "+1", "1e999", "1" * 5000, "--1"])
def test_numbers_json_cannot_carry_fail(token: str) -> None:
    assert number_text(token) is None
    assert write(f"[{token}]")[0] == FAILED


@pytest.mark.parametrize(
    "text",
    [
        '{"a" 1}',
        '{"a": 1,}',
        "[1,]",
        "{,}",
        '{"a": tru}',
        '{"a": nul',
        '"\x01"',  # a raw control character
        r'"\x"',
        r'"\u12g4"',
        '{"a": NaN}',
        "[Infinity]",
        "[-Infinity]",
        "{'a': 1}",
        '{"a": 1]',
        "[1}",
        "{1: 2}",
        "",
        "  ",
    ],
)
def test_what_json_loads_rejects_fails(text: str) -> None:
    assert write(text)[0] == FAILED
    assert canonical_object(text) is None


def test_reading_stops_at_the_end_of_the_value() -> None:
    writer = JsonWriter()
    assert writer.feed('  {"a": [1]} tail') == len('  {"a": [1]}')
    assert writer.state == DONE and writer.take() == '{"a": [1]}'
    writer = JsonWriter()
    assert writer.feed("12") == 2 and writer.state == OPEN  # the number may go on
    assert writer.feed("3,", 0) == 1 and writer.state == DONE and writer.take() == "123"
    assert canonical_object(' {"a": 1} \n') == '{"a": 1}'
    assert canonical_object('{"a": 1} x') is None and canonical_object("[1]") is None


def test_duplicate_keys_are_written_in_order() -> None:
    assert write('{"a": 1, "a": {"b": 2, "b": 3}}') == (DONE, '{"a": 1, "a": {"b": 2, "b": 3}}')


def test_closers_close_whatever_is_open() -> None:
    for text, expected in [
        ('{"a": [1, {"b": "x', '{"a": [1, {"b": "x"}]}'),
        ('{"a": [1, {"b": ', '{"a": [1, {}]}'),
        ('{"a": [1, {"b', '{"a": [1, {}]}'),
        ('{"a": 1, ', '{"a": 1}'),
        ('{"a": "\\ud83d', '{"a": ""}'),  # undecided high half: not written yet
    ]:
        writer = JsonWriter()
        writer.feed(text)
        assert writer.take() + writer.closers() == expected, text
