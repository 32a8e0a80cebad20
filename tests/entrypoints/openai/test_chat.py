"""POST /v1/chat/completions end to end."""

from __future__ import annotations

from tests.entrypoints.openai.conftest import MODEL
from tests.entrypoints.openai.test_completions import assert_spans_cover, sse_events

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about paged attention."},
]
GREEDY = {"temperature": 0.0, "max_tokens": 10, "extra_body": {"ignore_eos": True}}


def test_chat_uses_template_and_is_greedy(client, http) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert_spans_cover(choice.model_extra["weight_versions"], 10)
    # the prompt is the chat template with the generation prompt, as /tokenize renders it
    rendered = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert out.usage.prompt_tokens == rendered["count"]
    by_ids = client.completions.create(model=MODEL, prompt=rendered["tokens"], **GREEDY)
    assert by_ids.choices[0].text == choice.message.content


def test_chat_stream_matches(client, http) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": 10,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    first, chunks, usage = events[0], events[1:-2], events[-2]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["prompt_token_ids"]
    assert all("role" not in c["choices"][0]["delta"] for c in chunks)
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    assert text == full.choices[0].message.content
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 10
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    assert usage["usage"]["prompt_tokens"] == full.usage.prompt_tokens


def test_chat_openai_stream_and_n(client) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, n=2, **GREEDY
    )
    texts = {0: "", 1: ""}
    roles = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles.add(c.delta.role)
    assert "assistant" in roles
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert texts == {0: full.choices[0].message.content, 1: full.choices[0].message.content}


def test_chat_logprobs_and_max_completion_tokens(client) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_completion_tokens=5,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5 == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: rank 1 sampled
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert entry.bytes == list(entry.token.encode("utf-8"))
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_chat_content_parts(client) -> None:
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Tell me about"},
                {"type": "text", "text": "paged attention."},
            ],
        },
    ]
    joined = [{"role": "user", "content": "Tell me about\npaged attention."}]
    a = client.chat.completions.create(model=MODEL, messages=parts, **GREEDY)
    b = client.chat.completions.create(model=MODEL, messages=joined, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
