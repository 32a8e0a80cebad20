"""The RL control plane over HTTP, end to end: a real `hotswap serve` process, httpx and
streaming completions in flight while pausing, sleeping, aborting and relabelling."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.helpers.server import RemoteServer, concurrent_servers
from tests.helpers.waiting import requests_waiting, until

MODEL = "tiny"
SHARED = "Reinforcement learning trains a policy while it keeps generating rollouts. " * 3
SERVER_ARGS = (
    "--served-model-name", MODEL, "--dtype", "float32", "--block-size", "8",
    "--max-model-len", "512", "--enable-control", "--enable-sleep-mode",
    "--enable-prefix-caching", "--enable-prompt-tokens-details",
)  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_llama):
    with RemoteServer(tiny_llama, *SERVER_ARGS) as srv:
        yield srv


@pytest.fixture
def client(server: RemoteServer):
    with server.client() as c:
        yield c
    # Every test leaves the server running normally for the next one.
    with server.client() as c:
        c.post("/wake_up")
        c.post("/resume")


def completion_body(prompt: str, max_tokens: int, stream: bool = False, **extra) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
        **extra,
    }


class StreamingCompletion:
    """One streaming completion consumed in the background; keeps every SSE chunk."""

    def __init__(self, http: httpx.AsyncClient, body: dict) -> None:
        self.chunks: list[dict] = []
        self.done = False
        self.first = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(http, body))

    async def _run(self, http: httpx.AsyncClient, body: dict) -> None:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.done = True
                    return
                self.chunks.append(json.loads(line[len("data: ") :]))
                self.first.set()

    @property
    def finish_reason(self) -> str | None:
        reasons = [c["choices"][0]["finish_reason"] for c in self.chunks if c["choices"]]
        return next((r for r in reasons if r is not None), None)

    @property
    def num_tokens(self) -> int:
        spans = [s for c in self.chunks if c["choices"] for s in c["choices"][0]["weight_versions"]]
        return max((s["end"] for s in spans), default=0)


async def _waiting(http: httpx.AsyncClient, count: int) -> bool:
    return await requests_waiting(http) == count


async def tokens_generated(http: httpx.AsyncClient) -> float:
    """The front end's count of generated tokens: final once `/pause` has answered (every
    output made before it has reached its stream), whereas the stream's HTTP chunks may
    still be on their way to this client on another connection."""
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith("hotswap:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no hotswap:generation_tokens_total in /metrics")


async def kv_is_idle(http: httpx.AsyncClient) -> bool:
    text = (await http.get("/metrics")).text
    values = {}
    for line in text.splitlines():
        if line.startswith(("hotswap:num_requests_running", "hotswap:kv_cache_usage_perc")):
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            values[name] = value
    return values == {"hotswap:num_requests_running": 0.0, "hotswap:kv_cache_usage_perc": 0.0}


# -- pause / resume state ------------------------------------------------------------------
def test_pause_resume_idempotent_and_invalid_mode_is_400(client: httpx.Client) -> None:
    for mode in ["abort", "wait", "keep"] * 2:
        for _ in range(2):
            r = client.post("/pause", params={"mode": mode})
            assert r.status_code == 200 and r.json() == {"status": "paused"}
        assert client.get("/is_paused").json() == {"is_paused": True}
        bad = client.post("/pause", params={"mode": "bogus"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.mode"
        assert client.get("/is_paused").json() == {"is_paused": True}
        for _ in range(2):
            assert client.post("/resume").json() == {"status": "resumed"}
        assert client.get("/is_paused").json() == {"is_paused": False}
        bad = client.post("/pause", params={"mode": "bogus"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.mode"
        assert bad.json()["error"]["code"] == 400
        assert client.get("/is_paused").json() == {"is_paused": False}
    bad = client.post("/pause", params={"clear_cache": "maybe"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.clear_cache"
    assert client.get("/is_paused").json() == {"is_paused": False}


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_request_lifecycle_per_pause_mode(server: RemoteServer, client, mode: str) -> None:
    async def scenario() -> None:
        async with server.async_client() as http:
            inflight = StreamingCompletion(http, completion_body("The quick", 200, stream=True))
            await asyncio.wait_for(inflight.first.wait(), 30)
            r = await http.post("/pause", params={"mode": mode, "clear_cache": "false"})
            assert r.status_code == 200
            if mode != "keep":  # the stream's last chunk follows the pause's answer
                await until(lambda: inflight.finish_reason, "the in-flight request finished")
            if mode == "abort":
                assert inflight.finish_reason == "abort" and 0 < inflight.num_tokens < 200
            elif mode == "wait":
                assert inflight.finish_reason == "length" and inflight.num_tokens == 200
            else:
                assert inflight.finish_reason is None
                generated = await tokens_generated(http)
                await asyncio.sleep(0.3)  # a window in which a running engine makes tokens
                assert await tokens_generated(http) == generated  # frozen while paused
            queued = StreamingCompletion(http, completion_body("Pause", 12, stream=True))
            await until(lambda: _waiting(http, 1), "the engine holds the queued request")
            assert queued.chunks == []  # connection open, request pending
            assert (await http.post("/resume")).status_code == 200
            await asyncio.wait_for(asyncio.gather(inflight.task, queued.task), 60)
            assert queued.done and queued.finish_reason == "length" and queued.num_tokens == 12
            assert inflight.done
            assert inflight.finish_reason == {"abort": "abort"}.get(mode, "length")
            if mode == "keep":
                assert inflight.num_tokens == 200
            assert await kv_is_idle(http)

    asyncio.run(scenario())


@pytest.mark.slow
def test_clear_cache_keeps_golden_output_and_controls_cached_tokens(client) -> None:
    def run() -> dict:
        r = client.post("/v1/completions", json=completion_body(SHARED + "Paged", 16))
        assert r.status_code == 200, r.text
        return r.json()

    golden = run()
    client.post("/pause", params={"mode": "wait", "clear_cache": "false"})
    client.post("/resume")
    kept = run()
    client.post("/pause", params={"mode": "wait", "clear_cache": "true"})
    client.post("/resume")
    cleared = run()
    text = golden["choices"][0]["text"]
    assert kept["choices"][0]["text"] == text and cleared["choices"][0]["text"] == text
    assert kept["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cleared["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# -- aborts and cache ------------------------------------------------------------------------
@pytest.mark.slow
def test_abort_requests_by_id_and_all(server: RemoteServer, client) -> None:
    async def scenario() -> None:
        async with server.async_client() as http:
            streams = [
                StreamingCompletion(
                    http, completion_body("The", 300, stream=True, request_id=f"job-{i}")
                )
                for i in range(3)
            ]
            await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 30)
            r = await http.post("/abort_requests", json={"request_ids": ["job-0", "nope"]})
            assert r.json() == {"status": "aborted", "aborted": 1}
            await asyncio.wait_for(streams[0].task, 30)
            assert streams[0].finish_reason == "abort"
            assert all(s.finish_reason is None for s in streams[1:])
            assert not (await http.get("/is_paused")).json()["is_paused"]  # does not pause
            r = await http.post("/abort_requests")
            assert r.json() == {"status": "aborted", "aborted": 2}
            await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 30)
            assert [s.finish_reason for s in streams] == ["abort"] * 3
            bad = await http.post("/abort_requests", json={"request_ids": "job-1"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "body.request_ids"
            bad = await http.post("/abort_requests", content=b"{not json")
            assert bad.status_code == 400 and bad.json()["error"]["message"] == (
                "Invalid JSON format"
            )
            assert await kv_is_idle(http)

    asyncio.run(scenario())


@pytest.mark.slow
def test_reset_prefix_cache(client) -> None:
    r = client.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"success": True}
    r = client.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
    assert r.json() == {"success": True}
    assert client.post("/flush_cache").json() == {"success": True}


@pytest.mark.slow
def test_streaming_disconnect_frees_kv(server: RemoteServer, client) -> None:
    async def scenario() -> None:
        async with server.async_client() as http:
            async with http.stream(
                "POST", "/v1/completions", json=completion_body("The", 400, stream=True)
            ) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break  # first token seen: hang up
            for _ in range(100):
                if await kv_is_idle(http):
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("the disconnected request still holds KV")

    asyncio.run(scenario())


# -- weight versions ---------------------------------------------------------------------------
@pytest.mark.slow
def test_weight_version_routes(client) -> None:
    info = client.get("/weight_info").json()
    assert info["weight_version"] == "default" and isinstance(info["digest"], str)
    version = info["version"]
    r = client.post("/update_weight_version", json={"new_version": "step-1"})
    assert r.json() == {"success": True, "new_version": "step-1"}
    r = client.post("/update_weight_version", json={"new_version": "step-2"})
    info2 = client.get("/weight_info").json()
    assert info2["weight_version"] == "step-2" and info2["version"] == version + 2
    assert info2["digest"] == info["digest"]  # relabelled, same weights
    for body in ({}, {"new_version": 3}, {"new_version": None}, {"new_version": ""}):
        bad = client.post("/update_weight_version", json=body)
        assert bad.status_code == 400, body
        assert bad.json()["error"]["param"] == "body.new_version"
    bad = client.post("/update_weight_version", content=b"[", headers={"content-type": "x"})
    assert bad.status_code == 400
    assert client.get("/weight_info").json() == info2
    spans = client.post("/v1/completions", json=completion_body("The", 5)).json()
    assert spans["choices"][0]["weight_versions"] == [
        {"version": version + 2, "label": "step-2", "start": 0, "end": 5, "stale": False}
    ]


# -- sleep -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sleep_levels_tags_and_queued_requests(server: RemoteServer, client) -> None:
    for level in (0, 1):
        r = client.post("/sleep", params={"level": level})
        assert r.status_code == 200
        assert r.json()["status"] == "sleeping" and r.json()["level"] == level
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        r = client.post("/wake_up")
        assert r.json()["status"] == "awake" and r.json()["tags_woken"] is None
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    for params, param in (({"level": 3}, "query.level"), ({"level": "x"}, "query.level")):
        bad = client.post("/sleep", params=params)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param
    bad = client.post("/sleep", params={"mode": "nap"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.mode"
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}

    async def queued_during_sleep() -> None:
        async with server.async_client() as http:
            await http.post("/sleep", params={"level": 1})
            queued = StreamingCompletion(http, completion_body("Sleepy", 8, stream=True))
            await asyncio.sleep(0.3)
            assert queued.chunks == []
            r = await http.post("/wake_up", params={"tags": ["scheduling"]})
            assert r.status_code == 409  # weights and KV still sleep
            r = await http.post("/wake_up", params={"tags": ["weights"]})
            assert r.json()["status"] == "sleeping" and r.json()["tags_woken"] == ["weights"]
            bad = await http.post("/wake_up", params={"tags": ["gpu"]})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.tags"
            r = await http.post("/wake_up", params={"tags": ["kv_cache", "scheduling"]})
            assert r.json()["status"] == "awake"
            await asyncio.wait_for(queued.task, 30)
            assert queued.finish_reason == "length" and queued.num_tokens == 8

    asyncio.run(queued_during_sleep())


@pytest.mark.slow
def test_sleep_level2_then_reload_from_disk(client, tiny_llama) -> None:
    golden = client.post("/v1/completions", json=completion_body("Swap", 8)).json()
    assert client.post("/sleep", params={"level": 2}).status_code == 200
    assert client.post("/wake_up").json()["status"] == "awake"
    r = client.post(
        "/update_weights_from_disk", json={"model_path": str(tiny_llama), "weight_version": "v2"}
    )
    assert r.status_code == 200 and r.json()["weight_version"] == "v2"
    again = client.post("/v1/completions", json=completion_body("Swap", 8)).json()
    assert again["choices"][0]["text"] == golden["choices"][0]["text"]
    bad = client.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body.model_path"
    assert client.get("/weight_info").json()["weight_version"] == "v2"


@pytest.mark.slow
def test_sglang_dialect(client) -> None:
    for mode in ("abort", "retract", "in_place"):
        assert client.post("/pause_generation", json={"mode": mode}).status_code == 200
        assert client.get("/is_paused").json() == {"is_paused": True}
        assert client.post("/continue_generation").status_code == 200
    bad = client.post("/pause_generation", json={"mode": "keep"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body.mode"
    assert client.post("/release_memory_occupation", json={}).json() == {"success": True}
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    r = client.post("/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]})
    assert r.json() == {"success": True, "is_sleeping": False}
    assert client.get("/is_paused").json() == {"is_paused": False}


@pytest.mark.slow
def test_metrics_report_state(client) -> None:
    client.post("/pause", params={"mode": "keep"})
    text = client.get("/metrics").text
    assert f'hotswap:is_paused{{model_name="{MODEL}"}} 1.0' in text
    assert 'hotswap:pause_state{model_name="tiny",state="PAUSED_ALL"} 1.0' in text
    assert 'hotswap:pause_latency_seconds_count{mode="keep",model_name="tiny"}' in text
    assert "hotswap:generation_tokens_total" in text
    client.post("/resume")


# -- security and control switch ---------------------------------------------------------------
@pytest.fixture(scope="module")
def switch_servers(tiny_llama):
    """Control off with an API key, and control on through the environment: started
    together for the two tests below."""
    key = (tiny_llama, "--served-model-name", MODEL, "--api-key", "sekret")
    dev = (tiny_llama, "--served-model-name", MODEL)
    dev_env = {"HOTSWAP_SERVER_DEV_MODE": "1"}
    with concurrent_servers(key, dev, envs=[None, dev_env]) as started:
        yield started


@pytest.mark.slow
def test_api_key_and_control_disabled(switch_servers) -> None:
    srv = switch_servers[0]
    assert httpx.get(f"{srv.url}/health").status_code == 200  # open
    anonymous = httpx.get(f"{srv.url}/v1/models")
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == 401
    wrong = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    with srv.client() as c:
        assert c.get("/v1/models").status_code == 200
        for method, path in [("post", "/pause"), ("get", "/is_paused"), ("post", "/sleep")]:
            assert getattr(c, method)(path).status_code == 404, path
    assert srv.stop() == 0  # Ctrl-C: clean exit


@pytest.mark.slow
def test_dev_mode_environment_enables_control(switch_servers) -> None:
    srv = switch_servers[1]  # no --enable-control
    assert httpx.get(f"{srv.url}/is_paused").json() == {"is_paused": False}
