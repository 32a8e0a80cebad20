"""The router's pure parts (routing hints, the hashed prompt, the balancer, the weight
routes' arguments), and its app over fake upstreams (httpx.MockTransport) and dead ones."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from hotswap.entrypoints.router.app import RouterConfig, build_app
from hotswap.entrypoints.router.upstreams import (
    DOWN_S,
    UPSTREAM_HEADER,
    Balancer,
    Hints,
    RoutingError,
    prometheus_text,
    prompt_key,
    request_hints,
)
from hotswap.entrypoints.router.weights import finish_arguments, update_chunks
from hotswap.errors import InvalidArgument


def test_hints_header_over_body_and_pin_is_an_upstream_index() -> None:
    headers = httpx.Headers({"X-Session-ID": "h", "X-data-parallel-rank": "1"})
    assert request_hints(headers, {"session_id": "b"}, 2) == Hints("h", 1)
    assert request_hints(httpx.Headers(), {"session_id": "b"}, 2) == Hints("b", None)
    assert request_hints(httpx.Headers(), {"routing_key": "k"}, 2) == Hints("k", None)
    # the body's data_parallel_rank is a rank inside the upstream: not the router's pin
    assert request_hints(httpx.Headers(), {"data_parallel_rank": 1}, 2) == Hints()
    assert request_hints(httpx.Headers({"X-data-parallel-rank": "x"}), None, 2) == Hints()
    with pytest.raises(RoutingError, match=r"2 is out of range \[0, 2\)") as e:
        request_hints(httpx.Headers({"X-data-parallel-rank": "2"}), None, 2)
    assert e.value.param == "X-data-parallel-rank"
    with pytest.raises(RoutingError, match="X-Session-ID"):
        request_hints(httpx.Headers({"X-Session-ID": "s" * 257}), None, 2)


def test_prompt_key_token_ids_else_bytes() -> None:
    assert prompt_key({"token_ids": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_key({"input_ids": [4, 5]}) == [4, 5]
    assert prompt_key({"prompt": [7, 8]}) == [7, 8]
    assert prompt_key({"prompt": "ab"}) == [97, 98]
    assert prompt_key({"text": "é"}) == list("é".encode())
    messages = [{"role": "user", "content": "hi"}]
    assert prompt_key({"messages": messages}) == list(json.dumps(messages, sort_keys=True).encode())
    assert prompt_key({"prompt": [True]}) == [] and prompt_key(None) == []


def test_balancer_sessions_stick_keyless_spread_pins_win() -> None:
    balancer = Balancer("session", 2)
    first = balancer.acquire(Hints("s"), [])
    busy = balancer.acquire(Hints(pinned=first), [])  # keeps the session's upstream busier
    assert busy == first and balancer.in_flight[first] == 2
    assert balancer.acquire(Hints("s"), []) == first  # within the spill margin
    other = balancer.acquire(Hints(), [])
    assert other != first  # keyless: the least-loaded
    for index in (first, first, first, other):
        balancer.release(index)
    assert balancer.in_flight == [0, 0]
    stats = balancer.stats
    assert (stats.session_hits, stats.pinned, sum(stats.routed)) == (1, 1, 4)
    text = prometheus_text(stats, balancer.in_flight, ["http://a", "http://b"])
    assert "hotswap_router:session_hits 1" in text
    assert f'hotswap_router:routed{{upstream="{first}",url="http://{"ab"[first]}"}} 3' in text


def test_an_upstream_that_refused_is_routed_around_until_its_cooldown_ends() -> None:
    balancer = Balancer("session", 2)
    assert balancer.acquire(Hints("s"), [], now=100.0) == 0
    balancer.release(0)
    balancer.mark_down(0, now=100.0)
    assert balancer.acquire(Hints("s"), [], now=101.0) == 1  # the session moves
    assert balancer.acquire(Hints(), [], now=101.0) == 1  # though 0 is less loaded
    assert balancer.acquire(Hints(pinned=0), [], now=101.0) == 0  # a pin still goes there
    assert balancer.acquire(Hints(), [], now=100.0 + DOWN_S) == 0  # tried again
    balancer.mark_down(0, now=200.0)
    balancer.mark_down(1, now=200.0)
    assert balancer.acquire(Hints(), [], now=201.0) in (0, 1)  # all down: tried anyway


def test_balancer_cache_aware_follows_the_prefix() -> None:
    balancer = Balancer("cache-aware", 2)
    prompt = list(b"a long shared system prompt, long enough for blocks" * 2)
    held = balancer.acquire(Hints(), prompt)
    balancer.acquire(Hints(pinned=held), [])  # that upstream is now busier
    assert balancer.acquire(Hints(), prompt + [1, 2]) == held
    assert balancer.stats.prefix_hits == 1


def test_weight_route_arguments() -> None:
    assert finish_arguments({"weight_label": "v", "digest": True}) == {
        "weight_version": "v",
        "digest": True,
    }
    with pytest.raises(InvalidArgument, match="weight_label"):
        finish_arguments({"weight_label": "v", "weight_version": "w"})
    with pytest.raises(InvalidArgument, match="bogus"):
        finish_arguments({"bogus": 1})
    assert update_chunks({"update_info": {"a": 1}}) == [{"a": 1}]
    assert update_chunks([{"update_info": [{"a": 1}, {"b": 2}]}]) == [{"a": 1}, {"b": 2}]
    with pytest.raises(InvalidArgument, match="body"):
        update_chunks([1])


def _app(urls: list[str], handler=None, **config) -> httpx.AsyncClient:  # noqa: ANN001
    app = build_app(urls, RouterConfig(**config))
    if handler is not None:
        app.state.router.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://router")


def _fake(request: httpx.Request) -> httpx.Response:
    """Upstream 'b' refuses /pause; every upstream echoes what it was sent."""
    if request.url.host == "b" and request.url.path == "/pause":
        return httpx.Response(409, json={"error": {"message": "busy", "code": 409}})
    if request.url.path == "/v1/completions" and b"-1" in request.content:
        return httpx.Response(400, json={"error": {"message": "max_tokens", "code": 400}})
    echo = {"host": request.url.host, "path": request.url.path, "query": request.url.query.decode(),
            "pin": request.headers.get("x-data-parallel-rank")}  # fmt: skip
    return httpx.Response(200, json=echo)


def test_forwarding_and_fan_out_over_fake_upstreams() -> None:
    async def run() -> None:
        async with _app(["http://a", "http://b"], _fake) as client:
            r = await client.post("/v1/completions", json={"prompt": "x"},
                                  headers={"X-data-parallel-rank": "1"})  # fmt: skip
            assert r.status_code == 200 and r.headers[UPSTREAM_HEADER] == "1"
            assert r.json() == {"host": "b", "path": "/v1/completions", "query": "", "pin": None}
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
            assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens"
            r = await client.post("/resume")
            assert r.status_code == 200 and r.json()["path"] == "/resume"
            r = await client.post("/resume?x=1")
            assert r.json()["query"] == "x=1"
            r = await client.post("/pause?mode=abort")
            assert r.status_code == 409
            assert r.json()["error"]["message"] == "upstream 1 (http://b): busy"
            r = await client.get("/metrics")
            assert 'hotswap_router:routed{upstream="1",url="http://b"} 1' in r.text

    asyncio.run(run())


def _dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_dead_upstreams_give_502_naming_them() -> None:
    dead = [_dead_url(), _dead_url()]

    async def run() -> None:
        async with _app(dead, api_key="k") as client:
            assert (await client.post("/v1/completions", json={})).status_code == 401
            auth = {"Authorization": "Bearer k"}
            r = await client.post("/v1/completions", json={"prompt": "x"},
                                  headers={**auth, "X-data-parallel-rank": "1"})  # fmt: skip
            assert r.status_code == 502
            assert f"upstream 1 ({dead[1]}) cannot be reached" in r.json()["error"]["message"]
            r = await client.post("/v1/completions", headers={**auth, "X-data-parallel-rank": "2"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "X-data-parallel-rank"
            r = await client.post("/pause", headers=auth)
            assert r.status_code == 502 and f"upstream 0 ({dead[0]})" in r.text
            r = await client.get("/health")
            assert r.status_code == 503 and r.json()["healthy"] is False
            assert "in_flight" in (await client.get("/metrics")).text

    asyncio.run(run())


def test_a_request_goes_to_another_upstream_when_one_refuses_the_connection() -> None:
    def refusing_a(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            raise httpx.ConnectError("connection refused", request=request)
        return _fake(request)

    async def run() -> None:
        async with _app(["http://a", "http://b"], refusing_a) as client:
            for _ in range(2):  # the first tries a, then b; the second goes to b at once
                r = await client.post("/v1/completions", json={"prompt": "x"})
                assert r.status_code == 200 and r.headers[UPSTREAM_HEADER] == "1", r.text
            router = client._transport.app.state.router  # type: ignore[attr-defined]
            assert router.balancer.in_flight == [0, 0]
            assert router.balancer.stats.routed == [1, 2]
            r = await client.post("/v1/completions", json={}, headers={"X-data-parallel-rank": "0"})
            assert r.status_code == 502 and "upstream 0 (http://a)" in r.text  # pinned

    asyncio.run(run())
