"""Agentic serving end to end, with the `openai` client against a real server on a tiny
model whose tokenizer carries Qwen3's chat template: forced tool calls (required, named)
validate against their schemas, "auto" calls come out of the hermes parser (the model's
text is steered into a call by a regex constraint, since a random model never writes one
by itself), the thinking goes to `reasoning` (qwen3 parser), and every generated token,
thinking and call syntax included, is in `token_ids`.

With a reasoning parser a constraint starts after the thinking (vLLM's rule), and a random
model never closes its thinking, so the constrained requests here switch thinking off
(`enable_thinking: false`, as agentic RL runs often do); tests/test_structured_output.py
checks the wait for the end of thinking at the engine."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.openai.conftest import SERVER_ARGS
from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow

MODEL = "tiny"
TEMPLATE = Path(__file__).parents[2] / "helpers" / "data" / "qwen3_chat_template.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def qwen3_tiny(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with Qwen3's chat template (and room for its ~800-token tools block:
    the tiny tokenizer is inefficient)."""
    target = tmp_path_factory.mktemp("qwen3-template") / "model"
    shutil.copytree(tiny_model_factory("llama", max_position_embeddings=2048), target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE.read_text()
    config_path.write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def server(qwen3_tiny: Path) -> Iterator[RemoteServer]:
    args = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    longer = ("--max-model-len", "2048", "--num-kv-blocks", "640")
    # compact, closed JSON: a random model given free whitespace or free extra keys
    # wanders in them for ever
    closed = '{"disable_any_whitespace": true, "disable_additional_properties": true}'
    compact = ("--structured-outputs-config", closed)
    srv = RemoteServer(
        qwen3_tiny, *SERVER_ARGS, *longer, *compact, *args, "--reasoning-parser", "qwen3"
    )
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer):  # noqa: ANN201
    return server.openai()


@pytest.fixture(scope="module")
def http(server: RemoteServer):  # noqa: ANN201
    with server.client() as c:
        yield c


def check_weather_args(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "days"}
    assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7


def test_required_tool_choice_yields_schema_valid_calls(client) -> None:
    for seed in range(3):
        out = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER, ADD], tool_choice="required",
            max_tokens=120, seed=seed, temperature=1.0, extra_body=NO_THINKING,
            parallel_tool_calls=False,  # one call: a random model would append calls for ever
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
            if call.function.name == "get_weather":
                check_weather_args(call.function.arguments)
            else:
                assert call.function.name == "add"
                assert set(json.loads(call.function.arguments)) == {"a", "b"}


def test_named_function_is_called_with_valid_arguments(client) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, ADD], tool_choice=named,
        max_tokens=60, seed=1, extra_body=NO_THINKING,
    )  # fmt: skip
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    check_weather_args(call.function.arguments)
    assert out.choices[0].finish_reason == "stop"  # vLLM's: a named call keeps the reason
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice=named,
        max_tokens=60, seed=1, stream=True, extra_body=NO_THINKING,
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in stream if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert calls[0].function.name == "get_weather" and calls[0].id
    assert "".join(tc.function.arguments or "" for tc in calls) == call.function.arguments


def test_auto_tool_calls_come_from_the_hermes_parser(client) -> None:
    """tool_choice "auto" (the default with tools), the output steered into a call."""
    steer = {"structured_outputs": {"regex": "[a-z]{1,6} " + HERMES_CALL}, **NO_THINKING}
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=200, seed=2,
        extra_body=steer,
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_weather_args(call.function.arguments)
    # the text before the call (its trailing whitespace dropped)
    assert re.fullmatch("[a-z]{1,6}", choice.message.content)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=200, seed=2,
        stream=True, extra_body=steer,
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in stream if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert [c.function.name for c in calls if c.function.name] == ["get_weather"]
    assert "".join(c.function.arguments or "" for c in calls) == call.function.arguments
    assert "".join(d.content or "" for d in deltas) == choice.message.content


def test_thinking_goes_to_reasoning_and_token_ids_cover_it(client, http) -> None:
    """Thinking on (the template's default) and never closed by a random model: the whole
    output is reasoning, as vLLM's qwen3 parser has it; the ids and logprobs cover it."""
    # ASCII tokens only, so that every delta decodes whole
    words = http.post("/tokenize", json={"model": MODEL, "prompt": "the quick brown fox"})
    ascii_ids = words.json()["tokens"]
    out = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 12, "seed": 3,
        "return_token_ids": True, "logprobs": 1, "ignore_eos": True,
        "allowed_token_ids": ascii_ids,
    }).json()  # fmt: skip
    choice = out["choices"][0]
    ids = choice["token_ids"]
    text = http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    assert choice["message"]["reasoning"] == text.replace("<think>", "")
    assert choice["message"]["content"] is None
    assert len(choice["logprobs"]["content"]) == len(ids) == 12  # "logprobs": 1 means true
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, seed=3, stream=True,
        extra_body={"ignore_eos": True, "allowed_token_ids": ascii_ids},
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == text.replace(
        "<think>", ""
    )
    assert not any(d.content for d in deltas)


def test_enable_thinking_reaches_the_template(http) -> None:
    def rendered(**kwargs) -> str:  # noqa: ANN003
        body = {"model": MODEL, "messages": MESSAGES, **kwargs}
        tokens = http.post("/tokenize", json=body).json()["tokens"]
        return http.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]

    off = rendered(chat_template_kwargs={"enable_thinking": False})
    assert off.endswith("assistant\n<think>\n\n</think>\n\n")  # specials are skipped
    assert rendered().endswith("assistant\n")
    with_tools = rendered(tools=[WEATHER])
    assert "<tools>" in with_tools and '"get_weather"' in with_tools
    out = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 2, "return_token_ids": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }).json()  # fmt: skip
    prompt = http.post("/detokenize", json={"model": MODEL, "tokens": out["prompt_token_ids"]})
    assert prompt.json()["prompt"] == off


def test_json_schema_response_format(client) -> None:
    schema = WEATHER["function"]["parameters"]
    for stream in (False, True):
        kwargs = dict(
            model=MODEL, messages=MESSAGES, max_tokens=60, seed=4, stream=stream,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
            extra_body=NO_THINKING,
        )  # fmt: skip
        if stream:
            text = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(**kwargs)
                if c.choices
            )
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        check_weather_args(text)
