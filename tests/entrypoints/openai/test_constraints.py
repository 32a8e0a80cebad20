"""JSON schemas read as vLLM reads them by default, on the built-in default model at
temperature 0: a schema allows only the properties it lists (xgrammar's strict mode,
behind vLLM's "auto" backend), for response formats, `structured_outputs`, `guided_json`
and the schemas that forced tool calls build; a schema that allows more, or a server
with `--structured-outputs-config '{"backend": "guidance"}'`, keeps JSON Schema's open
objects. Under the open reading this model invents keys: `"action": "GET"` in a required
call (and a second call until `max_tokens`), a free-text `"description"` beside an
integer answer."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from hotswap.default_model import default_model_dir
from tests.helpers.server import RemoteServer, concurrent_servers

# Two servers on the default model, and a dozen requests: slow.
pytestmark = pytest.mark.slow

ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--log-level", "warning")
GUIDANCE = ("--structured-outputs-config", '{"backend": "guidance"}')
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
QUESTION = [{"role": "user", "content": "What is 2 + 2? Answer in JSON."}]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[RemoteServer, RemoteServer]]:
    """vLLM's default reading, and the guidance backend's."""
    model = default_model_dir(progress=False)
    with concurrent_servers((model, *ARGS), (model, *ARGS, *GUIDANCE)) as (strict, guidance):
        yield strict, guidance


def chat(server: RemoteServer, **fields) -> dict:  # noqa: ANN003
    body = {"max_tokens": 64, "temperature": 0, **fields}
    with server.client(timeout=120) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def weather_call(server: RemoteServer, tool_choice: str | dict) -> dict:
    messages = [{"role": "user", "content": "What is the weather like in Paris?"}]
    return chat(server, messages=messages, tools=[WEATHER], tool_choice=tool_choice)


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_choice_gives_one_valid_call(servers, tool_choice: str | dict) -> None:  # noqa: ANN001
    answer = weather_call(servers[0], tool_choice)
    choice = answer["choices"][0]
    assert choice["finish_reason"] != "length" and answer["usage"]["completion_tokens"] <= 64
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str), arguments


def answer_format(spelling: str, schema: dict) -> dict:
    if spelling == "response_format":
        named = {"name": "answer", "schema": schema}
        return {"response_format": {"type": "json_schema", "json_schema": named}}
    if spelling == "structured_outputs":
        return {"structured_outputs": {"json": schema}}
    return {"guided_json": schema}


@pytest.mark.parametrize("spelling", ["response_format", "structured_outputs", "guided_json"])
def test_json_schema_answer_has_exactly_the_declared_keys(servers, spelling: str) -> None:  # noqa: ANN001
    answer = chat(servers[0], messages=QUESTION, **answer_format(spelling, ANSWER))
    content = json.loads(answer["choices"][0]["message"]["content"])
    assert set(content) == {"answer"} and isinstance(content["answer"], int), content


def test_a_schema_that_allows_more_keys_gets_them(servers) -> None:  # noqa: ANN001
    schema = {**ANSWER, "additionalProperties": True}
    answer = chat(servers[0], messages=QUESTION, **answer_format("response_format", schema))
    content = json.loads(answer["choices"][0]["message"]["content"])
    assert "answer" in content and len(content) > 1, content


def test_the_guidance_backend_keeps_json_schemas_open(servers) -> None:  # noqa: ANN001
    """The permissive reading, asked for as in vLLM: the old outputs come back."""
    guidance = servers[1]
    answer = chat(guidance, messages=QUESTION, **answer_format("response_format", ANSWER))
    content = json.loads(answer["choices"][0]["message"]["content"])
    assert "answer" in content and len(content) > 1, content
    choice = weather_call(guidance, "required")["choices"][0]
    assert choice["finish_reason"] == "length"  # a second call, cut by max_tokens
    assert '"action"' in choice["message"]["content"]  # a key the schema does not list
