"""The body's `priority` over HTTP (vLLM's field) reaches the engine: on a server with
--scheduling-policy priority and --max-num-seqs 1, requests queued behind a pause are
admitted lowest priority value first, whichever route (completions, chat,
/inference/v1/generate) carried them; a priority that is not a 64-bit integer is a 400
naming body.priority, as vLLM's pydantic models refuse it."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.openai.conftest import MODEL, SERVER_ARGS
from tests.helpers.server import RemoteServer
from tests.helpers.waiting import gauge, wait_until

pytestmark = pytest.mark.slow

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
ROUTES = {
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "Hi"}),
    "chat": ("/v1/chat/completions", CHAT),
    "generate": ("/inference/v1/generate", {"token_ids": [1, 2]}),
}
SHORT = {"max_tokens": 4}
# Long enough never to finish: the test closes the stream (aborting the request).
ENDLESS = {"max_tokens": 400, "ignore_eos": True, "stream": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(
        tiny_llama, *SERVER_ARGS, "--enable-control",
        "--scheduling-policy", "priority", "--max-num-seqs", "1",
    )  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


def body_of(route: str, priority: object, extra: dict) -> tuple[str, dict]:
    path, body = ROUTES[route]
    body = {**body, "priority": priority}
    if route == "generate":  # its sampling parameters are nested
        sampling = {k: v for k, v in extra.items() if k in ("max_tokens", "ignore_eos")}
        rest = {k: v for k, v in extra.items() if k not in sampling and k != "return_token_ids"}
        return path, {**body, **rest, "sampling_params": sampling}
    return path, {**body, **extra}


def test_priority_orders_admission_over_every_route(server: RemoteServer) -> None:
    """With one request running at a time, only the admitted request streams tokens; the
    test closes its stream once it has (aborting it), which admits the next. So the order
    in which streams see their first token is the admission order, race-free."""
    sent = [("completions", 3), ("chat", 2), ("generate", 1), ("completions", -1)]
    first_token: queue.Queue[tuple[str, int]] = queue.Queue()
    release = {job: threading.Event() for job in sent}

    def send(route: str, priority: int) -> None:
        path, body = body_of(route, priority, ENDLESS)
        with server.client() as http, http.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
                if any(c.get("token_ids") for c in chunk.get("choices", [])):
                    first_token.put((route, priority))
                    release[(route, priority)].wait(60)
                    return  # closing the stream aborts the request

    threads = [threading.Thread(target=send, args=job, daemon=True) for job in sent]
    with server.client() as http:
        assert http.post("/pause", params={"mode": "keep"}).status_code == 200
        try:
            for thread in threads:
                thread.start()
            wait_until(lambda: gauge(http.get("/metrics").text, "hotswap:num_requests_waiting")
                       == len(sent), "every request is queued")  # fmt: skip
        finally:
            http.post("/resume")
        admitted = []
        for _ in sent:
            job = first_token.get(timeout=60)
            admitted.append(job)
            release[job].set()
    for thread in threads:
        thread.join(60)
    assert admitted == sorted(sent, key=lambda job: job[1])


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("bad", ["high", 1.5, 2**63, -(2**63) - 1, None])
def test_a_bad_priority_is_a_400_naming_it(server: RemoteServer, route: str, bad: object) -> None:
    path, body = body_of(route, bad, SHORT)
    with server.client() as http:
        r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "body.priority", r.text


def test_lax_priorities_vllm_accepts(server: RemoteServer) -> None:
    """vLLM's pydantic models take an integral float or a numeric string as an int."""
    with server.client() as http:
        for lax in (2.0, "-3", 2**63 - 1, -(2**63)):
            path, body = body_of("completions", lax, SHORT)
            r = http.post(path, json=body)
            assert r.status_code == 200, (lax, r.text)
