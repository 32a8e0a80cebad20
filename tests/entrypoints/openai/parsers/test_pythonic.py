"""`pythonic`: `[get_weather(city='SF'), f(x=1)]`, read with `ast`, literals only."""

from __future__ import annotations

import pytest

from hotswap.entrypoints.openai.parsers import TOOL_PARSERS, PythonicToolParser
from tests.entrypoints.openai.parsers.helpers import calls_of, check_tools, streamed_so_far


def test_list_of_calls_with_literal_arguments() -> None:
    text = (
        "[get_weather(city='San Francisco', days=3, metric=True, unit=None), "
        'search(q="a]b\'c)", limit=-2, ratio=+0.5, tags=("x", "y"), ids={7}, '
        "opts={'deep': [1, {'k': null}], 'on': true}, note=f'plain', "
        "doc='''two\nlines'''), tools.math.add(a=1, b=2)]"
    )
    result = check_tools(PythonicToolParser, text)
    assert result.content is None
    assert calls_of(result) == [
        ("get_weather", {"city": "San Francisco", "days": 3, "metric": True, "unit": None}),
        (
            "search",
            {
                "q": "a]b'c)",
                "limit": -2,
                "ratio": 0.5,
                "tags": ["x", "y"],
                "ids": [7],
                "opts": {"deep": [1, {"k": None}], "on": True},
                "note": "plain",
                "doc": "two\nlines",
            },
        ),
        ("tools.math.add", {"a": 1, "b": 2}),
    ]


def test_no_arguments_and_leading_whitespace() -> None:
    result = check_tools(PythonicToolParser, "\n [get_time()]")
    assert result.content is None and calls_of(result) == [("get_time", {})]


def test_text_after_the_list_is_dropped() -> None:
    result = check_tools(PythonicToolParser, "[f(x='é')]\nI called f.")
    assert result.content is None and calls_of(result) == [("f", {"x": "é"})]


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 4.",
        "[1] See the reference.",  # a list, not of calls
        "[]",
        "[f(x=y)]",  # a name is not a literal
        "[f(x=1 + 2)]",  # nor is an expression
        "[f('SF')]",  # positional argument: no parameter name
        "[f(**kw)]",
        "[f(x=b'raw')]",  # bytes have no JSON
        "[f(x=1e999)]",  # nor has inf
        "[f(x=f'{y}')]",  # an f-string with a placeholder
        "[f(x='it's')]",  # not Python
        "[f(x='line\nbreak')]",  # a one-line string across a line end
        "[get_weather(city='SF'",  # cut off
        "[f(s='''open",
        "[f(a=1",  # cut off before the argument ended
        "[f(, a=1)]",
        "[f(a=1 b=2)]",
        "[(f)(a=1)]",
        "[f.(a=1)]",
    ],
)
def test_not_calls_is_verbatim_content(text: str) -> None:
    result = check_tools(PythonicToolParser, text)
    assert not result.tools_called and result.content == text


def test_calls_stream_one_argument_at_a_time() -> None:
    text = "[get_weather(city='San Francisco', days=3, unit=None), get_time()]"
    seen = streamed_so_far(PythonicToolParser, text)
    assert seen[text.index("'San Fr")] == []  # a Python value is only certain whole
    assert seen[text.index(", days")] == []  # ... until the `,` after it
    assert seen[text.index(", days") + 1] == [("get_weather", '{"city": "San Francisco"')]
    assert seen[text.index(", unit") + 1][0][1] == '{"city": "San Francisco", "days": 3'
    assert seen[text.index("None)") + 4][0][1].endswith('"days": 3')
    assert seen[text.index("None)") + 5][0][1].endswith(', "unit": null}')
    assert seen[text.index("get_time(") + 9][1:] == []  # no argument yet: wait for `)`
    assert seen[text.index("get_time()") + 10][1:] == [("get_time", "{}")]


def test_argument_boundaries_inside_strings_and_brackets() -> None:
    parser = PythonicToolParser(None)
    assert parser.feed(" [f(a='])', ").tool_calls[0].function.arguments == '{"a": "])"'
    assert parser.feed("b=''").tool_calls == []  # '' or ''' ? undecided
    delta = parser.feed(", c={'k': (1, 2)})")
    assert [(c.index, c.function.name, c.function.arguments) for c in delta.tool_calls] == [
        (0, None, ', "b": "", "c": {"k": [1, 2]}}')
    ]


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ("[f(x=1), 3]", [("f", '{"x": 1}')]),
        ("[f()[0]()]", [("f", "{}")]),
        ("[f(a=1, b=y)]", [("f", '{"a": 1}')]),  # not a literal, after the start
        ("[f(a=1, a=2), g()]", [("f", '{"a": 1}')]),  # a repeated keyword
        ("[f(a=1, 'x')]", [("f", '{"a": 1}')]),  # a positional one
        ("[f(a=1, b='cut", [("f", '{"a": 1}')]),
        ("[f(a=1)", [("f", '{"a": 1}')]),  # the list cut off
        ("[f(a=1), g(b=2", [("f", '{"a": 1}')]),  # g had not started
        ("[f(a=1), g(b=2, c=", [("f", '{"a": 1}'), ("g", '{"b": 2}')]),
    ],
)
def test_malformed_after_the_start_stays_as_sent_closed(
    text: str, calls: list[tuple[str, str]]
) -> None:
    result = check_tools(PythonicToolParser, text)
    assert result.content is None
    assert [(c.function.name, c.function.arguments) for c in result.tool_calls] == calls


def test_not_python_is_content_at_once() -> None:
    """A one-line string across a line end decides it: no waiting for the end."""
    parser = PythonicToolParser(None)
    assert parser.feed("[note(x='it").content is None
    assert parser.feed("\nbreaks").content == "[note(x='it\nbreaks"


def test_registered_under_vllm_name() -> None:
    assert TOOL_PARSERS["pythonic"] is PythonicToolParser
