"""Bad requests: 400 (404 for an unknown model) with `error.param` naming the field."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.conftest import MAX_MODEL_LEN, MODEL

COMPLETION_CASES = [
    ({"temperature": -1}, "body.temperature"),
    ({"max_tokens": 0}, "body.max_tokens"),
    ({"max_tokens": -1}, "body.max_tokens"),
    ({"max_tokens": 1.5}, "body.max_tokens"),
    ({"top_p": 0}, "body.top_p"),
    ({"min_p": 2}, "body.min_p"),
    ({"n": 0}, "body.n"),
    ({"logprobs": 21}, "body.logprobs"),
    ({"min_tokens": 8, "max_tokens": 4}, "body.min_tokens"),
    ({"seed": 2**70}, "body.seed"),
    ({"stop": [1]}, "body.stop"),
    ({"stop": [""]}, "body.stop"),
    ({"presence_penalty": 2.5}, "body.presence_penalty"),
    ({"frequency_penalty": -3}, "body.frequency_penalty"),
    ({"repetition_penalty": 0}, "body.repetition_penalty"),
    ({"repetition_penalty": -1.5}, "body.repetition_penalty"),
    ({"logit_bias": {"five": 1}}, "body.logit_bias"),
    ({"logit_bias": {"1000000": 1}}, "body.logit_bias"),
    ({"logit_bias": {"5": "x"}}, "body.logit_bias.5"),
    ({"allowed_token_ids": [10**6]}, "body.allowed_token_ids"),
    ({"allowed_token_ids": []}, "body.allowed_token_ids"),
    ({"bad_words": [""]}, "body.bad_words"),
    ({"structured_outputs": {"regex": "a(b"}}, "body.structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "body.structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "body.structured_outputs.structural_tag"),
    (
        {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
        "body.structured_outputs.whitespace_pattern",
    ),
    ({"response_format": {"type": "json_schema"}}, "body.response_format"),
    ({"guided_json": "{oops"}, "body.guided_json"),
    ({"best_of": 3}, "body.best_of"),
    ({"suffix": "x"}, "body.suffix"),
    ({"use_beam_search": True}, "body.use_beam_search"),
    ({"prompt_logprobs": 21}, "body.prompt_logprobs"),
    ({"prompt_logprobs": -2}, "body.prompt_logprobs"),
    ({"cache_salt": ""}, "body.cache_salt"),
    ({"cache_salt": 5}, "body.cache_salt"),
    # an unknown field is ignored (test_unknown_fields.py), but not a bad known one with it
    ({"no_such_field": 1, "logit_bias": {"five": 1}}, "body.logit_bias"),
    ({"stream_options": {"include_usage": True}}, "body.stream_options"),
    ({"echo": True, "logprobs": 21}, "body.logprobs"),
    ({"prompt": []}, "body.prompt"),
    ({"prompt": [[]]}, "body.prompt"),
    ({"prompt": ["a", [1]]}, "body.prompt"),
    ({"prompt": [10**6]}, "body.prompt"),
    ({"prompt": [5] * MAX_MODEL_LEN}, "body.prompt"),
    ({"prompt": [5] * (MAX_MODEL_LEN - 8), "max_tokens": 16}, "body.max_tokens"),
    ({"max_weight_lag": -1}, "body.max_weight_lag"),
    ({"return_bf16_logprobs": True}, "body.return_bf16_logprobs"),  # no --enable-bf16-logprobs
    ({"return_bf16_logprobs": [1]}, "body.return_bf16_logprobs"),
]


@pytest.mark.parametrize(("extra", "param"), COMPLETION_CASES)
def test_completion_bad_input(http, extra: dict, param: str) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **extra}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["code"] == 400 and error["message"]


CHAT_CASES = [
    ({"messages": []}, "body.messages"),
    ({"messages": [{"content": "no role"}]}, "body.messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "body.messages"),
    ({"messages": [{"role": "user", "content": "Z? " * MAX_MODEL_LEN}]}, "body.messages"),
    ({"max_completion_tokens": 0}, "body.max_completion_tokens"),
    ({"max_completion_tokens": MAX_MODEL_LEN}, "body.max_completion_tokens"),
    ({"top_logprobs": 2}, "body.top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "body.top_logprobs"),
    ({"tools": []}, "body.tools"),
    ({"tools": [{"type": "function"}]}, "body.tools.0.function"),
    # "auto" (the default with tools) needs --enable-auto-tool-choice and a parser
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "body.tool_choice"),
    ({"tool_choice": "required"}, "body.tool_choice"),
    (
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "maybe"},
        "body.tool_choice",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "body.tool_choice",
    ),
    ({"response_format": {"type": "yaml"}}, "body.response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "body.response_format"),
    ({"temperature": -1}, "body.temperature"),
    ({"repetition_penalty": 0}, "body.repetition_penalty"),
    ({"prompt_logprobs": 99}, "body.prompt_logprobs"),
    # a request's template is refused unless --trust-request-chat-template
    ({"chat_template": "{{ raise_exception('nope') }}"}, "body.chat_template"),
    ({"continue_final_message": True}, "body.continue_final_message"),
]


@pytest.mark.parametrize(("extra", "param"), CHAT_CASES)
def test_chat_bad_input(http, extra: dict, param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404(http, path: str) -> None:
    body = {"model": "gpt-4", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    body.pop("messages" if path == "/v1/completions" else "prompt")
    response = http.post(path, json=body)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["param"] == "body.model" and "gpt-4" in error["message"]


def test_openai_client_errors(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert info.value.body["param"] == "body.temperature"


def test_bad_json_and_missing_field(http) -> None:
    response = http.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    response = http.post("/v1/completions", json={"model": MODEL})
    assert response.status_code == 400 and response.json()["error"]["param"] == "body.prompt"
