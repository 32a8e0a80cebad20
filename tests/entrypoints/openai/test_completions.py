"""POST /v1/completions end to end: the real openai client against a real server."""

from __future__ import annotations

import json

import httpx

from tests.entrypoints.openai.conftest import MODEL

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def sse_events(response: httpx.Response) -> list[dict | str]:
    """The data of every event ("[DONE]" stays a string)."""
    events: list[dict | str] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_spans_cover(spans: list, num_tokens: int, start: int = 0) -> None:
    """Version-0 "default" spans, contiguous over output tokens [start, num_tokens)."""
    spans = [s if isinstance(s, dict) else dict(s) for s in spans]
    assert [(s["version"], s["label"], s["stale"]) for s in spans] == [(0, "default", False)]
    assert (spans[0]["start"], spans[0]["end"]) == (start, num_tokens)


def test_greedy_completion(client) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.model == MODEL
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert_spans_cover(choice.model_extra["weight_versions"], 12)
    again = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    assert again.choices[0].text == choice.text


def test_stream_reassembles_to_greedy_text(client, http) -> None:
    full = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        **GREEDY | {"extra_body": {"ignore_eos": True, "return_token_ids": True}},
    )
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "temperature": 0,
        "max_tokens": 12,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 12
    assert usage_chunk["usage"]["prompt_tokens"] == full.usage.prompt_tokens
    assert all("usage" not in c for c in chunks)
    assert {c["id"] for c in chunks} == {usage_chunk["id"]}
    text = "".join(c["choices"][0]["text"] for c in chunks)
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert text == full.choices[0].text
    assert ids == full.choices[0].model_extra["token_ids"]
    assert (
        chunks[0]["choices"][0]["prompt_token_ids"]
        == full.choices[0].model_extra["prompt_token_ids"]
    )
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    # every chunk's spans cover exactly its own tokens, indexes absolute
    pos = 0
    for chunk in chunks:
        n = len(chunk["choices"][0]["token_ids"])
        if n:
            assert_spans_cover(chunk["choices"][0]["weight_versions"], pos + n, start=pos)
        pos += n


def test_openai_client_streaming(client) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in stream if c.choices) == full.choices[0].text


def test_n_and_list_prompts(client, http) -> None:
    out = client.completions.create(
        model=MODEL, prompt=["Hello there", "Paged attention"], n=2, **GREEDY
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    # greedy: the two samples of a prompt agree, the prompts do not
    assert out.choices[0].text == out.choices[1].text
    assert out.choices[2].text == out.choices[3].text
    single = client.completions.create(model=MODEL, prompt="Paged attention", **GREEDY)
    assert out.choices[2].text == single.choices[0].text
    assert out.usage.completion_tokens == 4 * 12
    hello = http.post("/tokenize", json={"prompt": "Hello there"}).json()["count"]
    assert out.usage.prompt_tokens == hello + single.usage.prompt_tokens


def test_token_id_prompts(client, http) -> None:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    both = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], **GREEDY)
    assert len(both.choices) == 2
    assert both.choices[0].text == by_text.choices[0].text
    assert both.usage.prompt_tokens == len(ids) + 2


def test_stream_n_and_prompts_indexes(http) -> None:
    body = {
        "model": MODEL,
        "prompt": [[5, 6, 7], [8, 9]],
        "n": 2,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = sse_events(response)
    chunks = [e for e in events[:-1] if e["choices"]]
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1, 2, 3]
    usage = events[-2]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        5,
        12,
        17,
    )


def test_stop_string(client) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0].text
    stop = next((ch for ch in full[1:] if ch.isascii() and ch.isprintable()), None)
    assert stop is not None, f"no ASCII character to stop on in {full!r}"
    cut = full.index(stop)
    out = client.completions.create(model=MODEL, prompt=PROMPT, stop=[stop], **GREEDY)
    choice = out.choices[0]
    assert choice.text == full[:cut]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop


def test_seed_reproducible(client) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            temperature=1.0,
            max_tokens=16,
            seed=seed,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return out.choices[0].model_extra["token_ids"]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_logprobs_shape(client) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert len(lp.text_offset) == 12 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0.0
        assert 1 <= len(top) <= 4
        # greedy: the sampled token is the most likely one
        assert max(top.values()) == value and top.get(token) == value


def test_return_token_ids_and_echo(client, http) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        echo=True,
        **GREEDY | {"extra_body": {"ignore_eos": True, "return_token_ids": True}},
    )
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT)
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert choice.model_extra["prompt_token_ids"] == prompt_ids
    assert len(choice.model_extra["token_ids"]) == 12
    detok = http.post("/detokenize", json={"tokens": choice.model_extra["token_ids"]})
    assert PROMPT + detok.json()["prompt"] == choice.text
    plain = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0]
    assert "token_ids" not in plain.model_extra and "prompt_token_ids" not in plain.model_extra


def test_stop_token_ids(client) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=0,
        max_tokens=12,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ids = out.choices[0].model_extra["token_ids"]
    stop_id = ids[3]
    cut = ids.index(stop_id)
    stopped = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=0,
        max_tokens=12,
        extra_body={"return_token_ids": True, "stop_token_ids": [stop_id], "ignore_eos": True},
    ).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.model_extra["stop_reason"] == stop_id
    assert stopped.model_extra["token_ids"] == ids[: cut + 1]
