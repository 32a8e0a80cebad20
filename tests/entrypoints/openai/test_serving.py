"""Around generation: /v1/models, /tokenize, /detokenize, usage and the prefix cache,
request ids, aborts, disconnects and requests that arrive while the engine is paused."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.conftest import MAX_MODEL_LEN, MODEL, SERVER_ARGS
from tests.helpers.server import RemoteServer

LONG = {"temperature": 0, "max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True}


def test_models(client, http) -> None:
    (card,) = client.models.list().data
    assert card.id == MODEL and card.owned_by == "hotswap"
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_tokenize_detokenize_round_trip(http) -> None:
    text = "Pause, swap the weights, resume: no request is lost."
    tok = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    assert len(tok["token_strs"]) == tok["count"]
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": text}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    rendered = http.post("/tokenize", json=chat).json()
    no_gen = http.post("/tokenize", json={**chat, "add_generation_prompt": False}).json()
    assert no_gen["tokens"] == rendered["tokens"][: no_gen["count"]]
    assert rendered["count"] > no_gen["count"]
    bad = http.post("/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body.tokens"
    both = http.post("/tokenize", json={"prompt": "a", **chat})
    assert both.status_code == 400


def test_cached_tokens_reported(client) -> None:
    prompt = "Reinforcement learning trains a policy while it keeps generating rollouts. " * 3
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens >= 32
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.total_tokens == second.usage.prompt_tokens + 2


def test_request_id_header_and_body(http) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    by_header = http.post("/v1/completions", json=body, headers={"X-Request-Id": "rid-header"})
    assert by_header.json()["id"] == "rid-header"
    assert by_header.headers["x-request-id"] == "rid-header"
    by_body = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "request_id": "rid-body",
        },
    )
    assert by_body.json()["id"] == "rid-body"
    generated = http.post("/v1/completions", json=body).json()["id"]
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", generated)


def first_event(lines) -> dict:  # noqa: ANN001 - an iterator of SSE lines
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[len("data: ") :])
    raise AssertionError("no event")


def test_abort_requests_ends_stream_with_abort(server: RemoteServer, http) -> None:
    body = {"model": MODEL, "prompt": "hi", "stream": True, **LONG}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        request_id = first_event(lines)["id"]
        # a second request with the same id is refused while the first runs
        dup = http.post("/v1/completions", json={**body, "stream": False, "request_id": request_id})
        assert dup.status_code == 400 and dup.json()["error"]["param"] == "body.request_id"
        aborted = http.post("/abort_requests", json={"request_ids": [request_id]})
        assert aborted.status_code == 200
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finish[-1] == "abort"


def metrics_text(http: httpx.Client) -> str | None:
    response = http.get("/metrics")
    return response.text if response.status_code == 200 else None


def waiting_and_aborted(http: httpx.Client) -> tuple[float, float] | None:
    """(requests waiting, requests finished by abort so far); None without /metrics."""
    text = metrics_text(http)
    if text is None:
        return None
    waiting = re.search(r"^hotswap:num_requests_waiting(?:{[^}]*})? (\S+)$", text, re.M)
    aborted = re.findall(
        r'^hotswap:request_success(?:_total)?{[^}]*finished_reason="abort"[^}]*} (\S+)$',
        text,
        re.M,
    )
    if waiting is None:
        return None
    return float(waiting.group(1)), sum(float(v) for v in aborted)


def poll(check, timeout: float = 10.0) -> bool:  # noqa: ANN001 - a callable returning bool
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


DISCONNECT_CASES = {
    "completion": ("/v1/completions", {"prompt": "hello"}),
    "completion-stream": ("/v1/completions", {"prompt": "hello", "stream": True}),
    "chat-stream": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stream": True},
    ),
}


@pytest.mark.parametrize("case", list(DISCONNECT_CASES))
def test_disconnect_aborts(server: RemoteServer, http, case: str) -> None:
    """The request waits in a paused engine; the client gives up; the server must abort
    it (it leaves the waiting queue and counts as aborted) before generation resumes."""
    path, extra = DISCONNECT_CASES[case]
    body = {"model": MODEL, "max_tokens": 4, **extra}
    before = waiting_and_aborted(http)
    assert http.post("/pause", params={"mode": "keep"}).status_code == 200
    try:
        with server.client(timeout=1.0) as c, contextlib.suppress(httpx.ReadTimeout):
            if body.get("stream"):
                with c.stream("POST", path, json=body) as response:
                    assert response.status_code == 200
                    first_event(response.iter_lines())  # chat: the role chunk comes at once
            else:
                c.post(path, json=body)
        if before is not None:  # TODO: without /metrics only the server's health is checked
            assert poll(lambda: waiting_and_aborted(http) == (0.0, before[1] + 1)), (
                f"not aborted: {waiting_and_aborted(http)} (before: {before})"
            )
    finally:
        assert http.post("/resume").status_code == 200
    follow = http.post(path, json={**body, "stream": False})
    assert follow.status_code == 200 and follow.json()["usage"]["completion_tokens"] == 4


def test_requests_wait_while_paused(http) -> None:
    assert http.post("/pause", params={"mode": "keep"}).status_code == 200
    result: dict = {}

    def call() -> None:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
        result["response"] = http.post("/v1/completions", json=body)

    thread = threading.Thread(target=call)
    try:
        thread.start()
        time.sleep(0.5)
        assert "response" not in result  # queued, not refused
    finally:
        assert http.post("/resume").status_code == 200
        thread.join(30)
    assert result["response"].status_code == 200
    assert result["response"].json()["choices"][0]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def plain_server(tiny_llama):  # noqa: ANN001, ANN201
    """No prompt-token details; an API key; its weight version moves (test_weight_versions),
    so the shared server's stays 0."""
    with RemoteServer(tiny_llama, *SERVER_ARGS, "--api-key", "k", "--enable-control") as srv:
        yield srv


@pytest.mark.slow  # a second server
def test_no_prompt_tokens_details_by_default(plain_server: RemoteServer) -> None:
    client = plain_server.openai()
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert out.usage.prompt_tokens_details is None
    assert "prompt_tokens_details" not in out.usage.model_dump(exclude_unset=True)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 2
    assert usage[0].prompt_tokens_details is None
    unauthorized = httpx.post(f"{plain_server.url}/v1/completions", json={"prompt": "hi"})
    assert unauthorized.status_code == 401


def _spans_across_an_update(server: RemoteServer, label: str) -> dict[int, list[dict]]:
    """Stream 4 choices; after the first event pause (keep), commit a version labelled
    `label`, resume; each choice's weight-version spans, merged where contiguous."""
    body = {"model": MODEL, "prompt": "hi", "stream": True, "n": 4, **LONG}
    with server.client() as http, http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first_event(lines)
        assert http.post("/pause", params={"mode": "keep"}).status_code == 200
        update = http.post("/update_weight_version", json={"new_version": label})
        assert update.status_code == 200
        assert http.post("/resume").status_code == 200
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    spans: dict[int, list[dict]] = {}
    for event in events:
        for choice in event["choices"]:
            spans.setdefault(choice["index"], []).extend(choice["weight_versions"])
    merged_spans = {}
    for index, chunk_spans in spans.items():
        merged: list[dict] = []
        for span in chunk_spans:
            if merged and merged[-1]["version"] == span["version"]:
                assert merged[-1]["end"] == span["start"]
                merged[-1]["end"] = span["end"]
            else:
                merged.append(dict(span))
        merged_spans[index] = merged
    return merged_spans


@pytest.mark.slow  # a second server
def test_weight_versions_across_an_update(plain_server: RemoteServer) -> None:
    """Pause mid-stream, commit a new weight version, resume: the chunks' spans switch
    from the old version to the new at the pause, and the spans stay absolute and
    contiguous. A run whose choices all finished before the pause landed (a busy machine
    answering the pause late) shows no switch: it is run again, each run committing one
    version."""
    previous = (0, "default")
    for attempt in range(1, 4):
        label = f"step-{attempt}"
        spans = _spans_across_an_update(plain_server, label)
        for merged in spans.values():
            labels = [(s["version"], s["label"]) for s in merged]
            assert labels in ([(attempt, label)], [previous, (attempt, label)]) or labels == [
                previous], labels  # fmt: skip
            assert merged[-1]["end"] == LONG["max_tokens"]
        switched = [m for m in spans.values() if m[-1]["version"] == attempt]
        if switched:  # the pause landed mid-flight: the choices, in step, all switched
            assert len(switched) == len(spans) == 4, spans
            assert any(m[0]["version"] == attempt - 1 for m in spans.values())
            return
        previous = (attempt, label)
    raise AssertionError("every run finished before the pause")
