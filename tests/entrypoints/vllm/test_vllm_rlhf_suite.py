"""vLLM's own HTTP RL tests, re-expressed against one `hotswap serve`.

Source: vllm-project/vllm, `tests/entrypoints/serve/dev/rlhf/` (the path and commit each
test comes from are in its class's docstring). Each test here sends the same requests and
makes the same assertions as the vLLM test it is named after, against one shared server
(tiny model, fp32, CPU, gloo weight transfer) instead of one vLLM server per test. Where
hotswap deliberately differs, the test asserts hotswap's answer and says so (`DIFFERS:`);
the README's vLLM compatibility table lists every difference and why.

Adaptations that are not differences (the same contract, scaled to a shared CPU server):
- "fresh server" assertions (weight_gen 0, inactive, awake) read the state captured when
  the module's server came up, and later ones are relative to the current state;
- a request that must *not* complete while paused/asleep is given a 0.5 s client timeout
  where vLLM gives 5 s, and vLLM's fixed waits of 1-5 s are 0.5 s (a tiny model decodes a
  token in milliseconds);
- prompts repeated x20 are repeated x4 (the tiny model's context is 512 tokens);
- GPU-memory assertions (`gpu_free_bytes`) are dropped from tests that also check flags;
- after a level-2 sleep, `collective_rpc("reload_weights")` reloads the served
  checkpoint as in vLLM, and commits it as a new version;
- the IPC/NCCL weight-transfer test runs its rounds over gloo.

Tests that need GPUs, NCCL, several API servers or an MoE model are listed, skipped, in
`test_needs_gpu_or_unsupported_topology`.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from tests.helpers.server import RemoteServer
from tests.weight_transfer.conftest import free_port, trainer_model

VLLM = "vllm-project/vllm tests/entrypoints/serve/dev/rlhf/"
ARGS = (
    "--served-model-name", "m", "--dtype", "float32", "--enable-control",
    "--enable-sleep-mode", "--enable-prefix-caching", "--enable-prompt-tokens-details",
    "--num-kv-blocks", "128", "--weight-transfer-config", '{"backend": "gloo"}',
)  # fmt: skip
HELD_S = 0.5  # client timeout for a request that must not complete (vLLM: 5 s)
# One pooled client for every call (vLLM's helpers use `requests`, a connection each).
HTTP = httpx.Client(timeout=30)
CACHE_PROMPT = "Paris is the capital of France. Berlin is the capital of Germany. " * 4


# -- the server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama", seed=0)


@pytest.fixture(scope="module")
def started(model_dir):
    """One server for the module, and what it answered before any test touched it."""
    with RemoteServer(model_dir, *ARGS) as srv:
        url = srv.url
        initial = {
            "weight_info": HTTP.get(f"{url}/weight_info").json(),
            "is_paused": is_paused(url),
            "is_sleeping": is_sleeping(url),
            "weight_update_active": HTTP.get(f"{url}/weight_update_active").json(),
            "metrics": metric_samples(url),
            # vLLM sends this to a fresh server, before any init_weight_transfer_engine.
            "start_without_init": start_weight_update(url),
        }
        yield url, initial


@pytest.fixture(scope="module")
def url(started) -> str:
    return started[0]


@pytest.fixture(scope="module")
def initial(started) -> dict[str, Any]:
    return started[1]


@pytest.fixture(autouse=True)
def restore(started, model_dir):
    """After each test: no open round, awake, resumed, the checkpoint's weights loaded
    (vLLM's restore_unpaused_state / ensure_awake fixtures, plus the level-2 reload)."""
    yield
    url, initial = started
    if HTTP.get(f"{url}/weight_update_active").json()["weight_update_active"]:
        HTTP.post(f"{url}/finish_weight_update", json={"abort": True}, timeout=30)
    assert wake(url) == 200
    assert resume(url) == 200
    if HTTP.get(f"{url}/weight_info").json()["digest"] != initial["weight_info"]["digest"]:
        r = HTTP.post(f"{url}/update_weights_from_disk", json={"model_path": str(model_dir)},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text


class VersionedClient(HTTPWeightSyncClient):
    """vLLM's VersionedClient: the round's version goes through the trainer's finish."""

    version = "default"

    def finish_weight_update(self, weight_version=None, abort=False, digest=False):  # noqa: ANN001, ANN201
        return super().finish_weight_update(None if abort else self.version, abort, digest)


@dataclass
class Trainer:
    engine: Any
    client: VersionedClient
    model: torch.nn.Module


@pytest.fixture(scope="module")
def trainer(url, model_dir) -> Trainer:
    """A gloo trainer joined to the server (init_weight_transfer_engine done once)."""
    model = trainer_model(model_dir).eval()
    client = VersionedClient(url)
    info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)
    engine = WeightTransferTrainerFactory.trainer_init(info, client, ModuleSource(model))
    yield Trainer(engine, client, model)
    engine.shutdown()


# -- vLLM's conftest helpers, over httpx -------------------------------------------------------
def gen(url: str, prompt: str = "The capital of France is", max_tokens: int = 8,
        timeout: float = 30) -> dict:  # fmt: skip
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = HTTP.post(f"{url}/v1/completions", json=body, timeout=timeout)
    response.raise_for_status()
    return response.json()


def try_gen(url: str, timeout: float = 30, **kwargs: Any) -> dict | None:
    """The RFC conftest's gen: the JSON, or None on any error (a timeout included)."""
    try:
        return gen(url, timeout=timeout, **kwargs)
    except Exception:
        return None


def gen_with_logprobs(url: str, prompt: str, max_tokens: int = 8, logprobs: int = 5) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": logprobs}  # fmt: skip
    response = HTTP.post(f"{url}/v1/completions", json=body, timeout=30)
    response.raise_for_status()
    return response.json()


def ok(resp: dict | None) -> bool:
    return resp is not None and "choices" in resp and bool(resp["choices"]) and "error" not in resp


def completion_with_cache_details(url: str, prompt: str) -> dict:
    return gen_with_logprobs(url, prompt, logprobs=1)


def golden_output(response: dict) -> dict:
    choice, usage = response["choices"][0], response["usage"]
    return {"text": choice["text"], "finish_reason": choice["finish_reason"],
            "tokens": choice["logprobs"]["tokens"], "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"]}  # fmt: skip


def cached_tokens(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def pause(url: str, mode: str = "abort", clear_cache: bool = True) -> int:
    params = {"mode": mode, "clear_cache": str(clear_cache)}
    return HTTP.post(f"{url}/pause", params=params, timeout=30).status_code


def resume(url: str) -> int:
    return HTTP.post(f"{url}/resume", timeout=10).status_code


def sleep_response(url: str, level: int = 1, mode: str = "abort") -> httpx.Response:
    return HTTP.post(f"{url}/sleep", params={"level": level, "mode": mode}, timeout=30)


def sleep(url: str, level: int = 1, mode: str = "abort") -> int:
    return sleep_response(url, level, mode).status_code


def wake_response(url: str, tags: list[str] | None = None) -> httpx.Response:
    return HTTP.post(f"{url}/wake_up", params={"tags": tags} if tags else {}, timeout=30)


def wake(url: str, tags: list[str] | None = None) -> int:
    return wake_response(url, tags).status_code


def is_sleeping(url: str) -> bool:
    return HTTP.get(f"{url}/is_sleeping", timeout=5).json()["is_sleeping"]


def is_paused(url: str) -> bool:
    return HTTP.get(f"{url}/is_paused", timeout=5).json()["is_paused"]


def health(url: str) -> int:
    try:
        return HTTP.get(f"{url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def poll_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def start_weight_update(url: str, is_checkpoint_format: bool = True) -> httpx.Response:
    body = {"is_checkpoint_format": is_checkpoint_format}
    return HTTP.post(f"{url}/start_weight_update", json=body, timeout=10)


def finish_weight_update(url: str) -> httpx.Response:
    return HTTP.post(f"{url}/finish_weight_update", timeout=10)


def update_weights(url: str, update_info: dict) -> httpx.Response:
    return HTTP.post(f"{url}/update_weights", json={"update_info": update_info}, timeout=10)


def get_world_size(url: str, include_dp: bool = True) -> httpx.Response:
    return HTTP.get(f"{url}/get_world_size", params={"include_dp": include_dp}, timeout=5)


def weight_info(url: str) -> dict:
    response = HTTP.get(f"{url}/weight_info", timeout=5)
    assert response.status_code == 200, response.text
    return response.json()


def update_weight_version(url: str, new_version: Any) -> httpx.Response:
    return HTTP.post(f"{url}/update_weight_version", json={"new_version": new_version})


def update_weight_label(url: str, label: str) -> httpx.Response:
    return HTTP.post(f"{url}/update_weight_label", json={"weight_label": label}, timeout=5)


def weight_update_active(url: str) -> bool:
    response = HTTP.get(f"{url}/weight_update_active", timeout=5)
    assert response.status_code == 200, response.text
    return response.json()["weight_update_active"]


def metric_samples(url: str) -> dict[str, list]:
    text = HTTP.get(f"{url}/metrics", timeout=10).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def metric_value(metrics: dict, name: str, labels: dict | None = None) -> float | None:
    for sample in metrics.get(name, []):
        if labels is None or all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    return None


def sleep_metrics(url: str) -> tuple:
    """(awake, weights_offloaded, discard_all) of vllm:engine_sleep_state."""
    values = {s.labels["sleep_state"]: s.value
              for s in metric_samples(url).get("vllm:engine_sleep_state", [])}  # fmt: skip
    return values.get("awake"), values.get("weights_offloaded"), values.get("discard_all")


def subset(answer: dict, expected: dict) -> bool:
    """hotswap answers vLLM's keys plus its own (`version`, `digest`, `weight_gen`, ...)."""
    return {k: answer.get(k) for k in expected} == expected


@dataclass
class StreamResult:
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    chunks: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None


def stream_completion(url: str, result: StreamResult, max_tokens: int) -> None:
    body = {"model": "m", "prompt": "Count upward slowly: one, two, three,", "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}  # fmt: skip
    try:
        with HTTP.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line or line == "data: [DONE]":
                    continue
                assert line.startswith("data: ")
                chunk = json.loads(line.removeprefix("data: "))
                result.chunks.append(chunk)
                choice = chunk["choices"][0]
                if choice.get("text"):
                    result.started.set()
                if choice.get("finish_reason") is not None:
                    result.finish_reason = choice["finish_reason"]
    except Exception as error:
        result.error = error
    finally:
        result.done.set()


def start_stream(url: str, max_tokens: int) -> tuple[StreamResult, threading.Thread]:
    result = StreamResult()
    thread = threading.Thread(target=stream_completion, args=(url, result, max_tokens))
    thread.start()
    started = result.started.wait(timeout=10)
    assert started, "request did not start generating"
    assert not result.done.is_set(), "request completed before it could be paused"
    return result, thread


def in_thread(call) -> tuple[threading.Thread, dict]:  # noqa: ANN001
    result: dict = {}

    def run() -> None:
        try:
            result["resp"] = call()
        except Exception as e:
            result["err"] = str(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


# == info_retrieval/ ===========================================================================
class TestInfoRetrievalWeightInfo:
    """info_retrieval/test_weight_info.py (vllm-project/vllm@0142b4cd).

    DIFFERS throughout: vLLM's /weight_info is exactly {"weight_version": ...}; hotswap adds
    `version`, `digest`, `weight_gen` and `weight_label`, so equality is on vLLM's key.
    DIFFERS: /update_weight_version also bumps hotswap's integer version (a new version).
    """

    @pytest.fixture(autouse=True)
    def restore_default_version(self, url):
        assert update_weight_version(url, "default").status_code == 200
        yield
        assert update_weight_version(url, "default").status_code == 200

    def test_initial_schema(self, initial):
        """Verify a fresh server exposes the default weight version."""
        assert subset(initial["weight_info"], {"weight_version": "default"})
        assert initial["weight_info"]["version"] == 0  # hotswap's extra keys

    def test_does_not_affect_generation(self, url):
        before = gen(url)
        assert ok(before)
        assert update_weight_version(url, "generation-check").status_code == 200
        assert subset(weight_info(url), {"weight_version": "generation-check"})
        after = gen(url)
        assert ok(after)
        assert after["choices"][0]["text"] == before["choices"][0]["text"]

    def test_update_is_visible(self, url):
        response = update_weight_version(url, "step-42")
        assert response.status_code == 200
        assert response.json() == {"success": True, "new_version": "step-42"}
        assert subset(weight_info(url), {"weight_version": "step-42"})

    def test_version_can_be_overwritten(self, url):
        for version in ("step-1", "checkpoint/final"):
            response = update_weight_version(url, version)
            assert response.status_code == 200
            assert response.json() == {"success": True, "new_version": version}
        assert subset(weight_info(url), {"weight_version": "checkpoint/final"})

    @pytest.mark.parametrize(
        "payload",
        [
            pytest.param({}, id="missing-version"),
            pytest.param({"weight_version": "wrong-field"}, id="wrong-field"),
            pytest.param({"new_version": ["not", "a", "string"]}, id="wrong-type"),
        ],
    )
    def test_invalid_update_preserves_state(self, url, payload):
        assert update_weight_version(url, "stable").status_code == 200
        before = weight_info(url)
        response = HTTP.post(f"{url}/update_weight_version", json=payload, timeout=5)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "body.new_version"
        assert subset(weight_info(url), {"weight_version": "stable"})
        assert weight_info(url)["version"] == before["version"]  # a refusal changes nothing


class TestInfoRetrievalResponseSchema:
    """info_retrieval/test_response_schema.py (vllm-project/vllm@0142b4cd)."""

    @staticmethod
    def assert_elapsed_ms(value):
        assert type(value) in (int, float)
        assert math.isfinite(value) and value >= 0

    @pytest.mark.parametrize("level", [0, 1, 2])
    def test_sleep_response_schema(self, url, level):
        response = sleep_response(url, level=level)
        assert response.status_code == 200
        body = response.json()
        assert set(body) == {"status", "level", "elapsed_ms"}
        assert body["status"] == "sleeping"
        assert body["level"] == level
        self.assert_elapsed_ms(body["elapsed_ms"])
        assert is_sleeping(url)

    def test_is_sleeping_response_schema(self, url):
        response = HTTP.get(f"{url}/is_sleeping", timeout=5)
        assert response.status_code == 200
        assert response.json() == {"is_sleeping": False}
        sleep_response(url, level=1).raise_for_status()
        response = HTTP.get(f"{url}/is_sleeping", timeout=5)
        assert response.status_code == 200
        assert response.json() == {"is_sleeping": True}

    @pytest.mark.parametrize(
        ("params", "invalid_param"),
        [
            pytest.param({"level": "invalid"}, "query.level", id="non-integer-level"),
            pytest.param({"level": -1}, "query.level", id="negative-level"),
            pytest.param({"level": 3}, "query.level", id="unsupported-level"),
            pytest.param({"mode": "invalid"}, "query.mode", id="invalid-mode"),
        ],
    )
    @pytest.mark.parametrize("sleeping", [False, True], ids=["awake", "sleeping"])
    def test_invalid_parameters_preserve_state(self, url, params, invalid_param, sleeping):
        if sleeping:
            sleep_response(url, level=1).raise_for_status()
        assert is_sleeping(url) is sleeping
        response = HTTP.post(f"{url}/sleep", params=params, timeout=15)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == invalid_param
        assert is_sleeping(url) is sleeping

    def test_full_wake_response_schema(self, url):
        sleep_response(url, level=1).raise_for_status()
        response = wake_response(url)
        assert response.status_code == 200
        body = response.json()
        assert set(body) == {"status", "tags_woken", "elapsed_ms"}
        assert body["status"] == "awake"
        assert body["tags_woken"] is None
        self.assert_elapsed_ms(body["elapsed_ms"])
        assert not is_sleeping(url)

    @pytest.mark.parametrize("tags", [("weights", "kv_cache"), ("kv_cache", "weights")])
    def test_partial_wake_response_tracks_engine_state(self, url, tags):
        """The wake that leaves nothing asleep also wakes `scheduling` (hotswap's third
        tag); `tags_woken` is vLLM's: the tags asked for."""
        sleep_response(url, level=1).raise_for_status()
        first = wake_response(url, tags=[tags[0]])
        assert first.status_code == 200
        body = first.json()
        assert set(body) == {"status", "tags_woken", "elapsed_ms"}
        assert body["status"] == "sleeping"
        assert body["tags_woken"] == [tags[0]]
        self.assert_elapsed_ms(body["elapsed_ms"])
        assert is_sleeping(url)

        second = wake_response(url, tags=[tags[1]])
        assert second.status_code == 200
        body = second.json()
        assert set(body) == {"status", "tags_woken", "elapsed_ms"}
        assert body["status"] == "awake"
        assert body["tags_woken"] == [tags[1]]
        self.assert_elapsed_ms(body["elapsed_ms"])
        assert not is_sleeping(url)


# == state_transitions/ ========================================================================
class TestStateTransitionsPauseResume:
    """state_transitions/test_pause_resume.py (vllm-project/vllm@01a095ae; the same
    tests at tests/entrypoints/rl/state_transitions/test_pause_resume.py@643b1919)."""

    def test_state_and_idempotency_across_cycles(self, url):
        assert not is_paused(url)
        assert resume(url) == 200
        assert resume(url) == 200
        assert not is_paused(url)
        for _ in range(2):
            for mode in ("abort", "wait", "keep"):
                assert pause(url, mode=mode) == 200
                assert pause(url, mode=mode) == 200
                assert is_paused(url)
                assert resume(url) == 200
                assert resume(url) == 200
                assert not is_paused(url)

    def test_invalid_mode_preserves_state(self, url):
        for paused in (False, True):
            if paused:
                assert pause(url) == 200
            assert is_paused(url) is paused
            response = HTTP.post(f"{url}/pause", params={"mode": "invalid"}, timeout=10)
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "query.mode"
            assert is_paused(url) is paused
            assert resume(url) == 200

    @pytest.mark.parametrize(
        ("mode", "max_tokens", "inflight_finish_reason"),
        [
            pytest.param("abort", 256, "abort", id="abort"),
            pytest.param("wait", 256, "length", id="wait"),
            pytest.param("keep", 256, "length", id="keep"),
        ],
    )
    def test_mode_request_lifecycle(self, url, mode, max_tokens, inflight_finish_reason):
        inflight, inflight_thread = start_stream(url, max_tokens)
        new_result: dict[str, Any] = {}
        new_done = threading.Event()

        def _new_request() -> None:
            new_result["response"] = gen(url, max_tokens=4, timeout=60)
            new_done.set()

        new_thread = threading.Thread(target=_new_request)
        try:
            assert pause(url, mode=mode) == 200
            assert is_paused(url)
            if mode in ("abort", "wait"):
                # vLLM: is_set() at once; the stream's reader thread may lag the answer.
                assert inflight.done.wait(timeout=5)
            else:
                assert not inflight.done.wait(timeout=0.2)  # chunks already on the wire land
                chunks_after_pause = len(inflight.chunks)
                assert not inflight.done.wait(timeout=HELD_S)  # vLLM: 5 s
                assert len(inflight.chunks) == chunks_after_pause, (
                    "in-flight request continued generating in keep mode"
                )
            new_thread.start()
            assert not new_done.wait(timeout=0.3), "new request completed while paused"
        finally:
            assert resume(url) == 200
            inflight_thread.join(timeout=30)
            if new_thread.ident is not None:
                new_thread.join(timeout=30)
        assert not inflight_thread.is_alive()
        assert inflight.error is None
        assert inflight.finish_reason == inflight_finish_reason
        assert not new_thread.is_alive()
        assert ok(new_result.get("response"))

    def test_clear_cache_preserves_output_and_controls_prefix_cache(self, url):
        prompt = CACHE_PROMPT  # vLLM: x20
        assert pause(url, clear_cache=True) == 200
        assert resume(url) == 200
        baseline = completion_with_cache_details(url, prompt)
        warmed = completion_with_cache_details(url, prompt)
        assert cached_tokens(baseline) == 0
        assert cached_tokens(warmed) > 0

        assert pause(url, clear_cache=False) == 200
        assert resume(url) == 200
        preserved = completion_with_cache_details(url, prompt)
        assert golden_output(preserved) == golden_output(baseline)
        assert cached_tokens(preserved) > 0

        assert pause(url, clear_cache=True) == 200
        assert resume(url) == 200
        cleared = completion_with_cache_details(url, prompt)
        assert golden_output(cleared) == golden_output(baseline)
        assert cached_tokens(cleared) == 0


class TestStateTransitionsPauseMultiFrontend:
    """state_transitions/test_pause_multi_frontend.py (vllm-project/vllm@a5c16f56)."""

    NUM_REQUESTS = 8  # vLLM: 32, to spread fresh connections over its two API servers

    def test_pause_rejects_on_every_api_server(self, url):
        """DIFFERS: vLLM (`--api-server-count 2`) answers every completion sent while
        paused with 503. hotswap has one front end, and a request sent while paused waits
        with its connection open and runs after /resume (as vLLM's own
        test_mode_request_lifecycle expects of a new request): none completes while
        paused, all are 200 after resume."""

        def status(_: int) -> int:
            body = {"model": "m", "prompt": "Hello", "max_tokens": 4}
            return HTTP.post(f"{url}/v1/completions", json=body, timeout=60).status_code

        assert pause(url, mode="abort") == 200
        with ThreadPoolExecutor(self.NUM_REQUESTS) as pool:
            held = [pool.submit(status, i) for i in range(self.NUM_REQUESTS)]
            time.sleep(HELD_S)
            assert not any(f.done() for f in held)  # vLLM: [503] * NUM_REQUESTS
            assert resume(url) == 200
            assert [f.result(timeout=60) for f in held] == [200] * self.NUM_REQUESTS
        with ThreadPoolExecutor(self.NUM_REQUESTS) as pool:
            assert list(pool.map(status, range(self.NUM_REQUESTS))) == [200] * self.NUM_REQUESTS


def _sleep_wake_completion(url: str) -> dict:
    return gen_with_logprobs(url, "The capital of France is", logprobs=1)


def _assert_request_is_held(future) -> None:  # noqa: ANN001
    """vLLM waits for `/load` to report the request (`--enable-server-load-tracking`);
    hotswap has no /load, so: the request has not completed after HELD_S."""
    with pytest.raises(FutureTimeout):
        future.result(timeout=HELD_S)


class TestStateTransitionsSleepWake:
    """state_transitions/test_sleep_wake.py (vllm-project/vllm@103647d5)."""

    @pytest.mark.parametrize("level", [0, 1])
    def test_sleep_flags_metrics_and_idempotency(self, url, level):
        assert sleep_metrics(url) == (1, 0, 0)
        for _ in range(2):
            assert sleep(url, level=level) == 200
            assert is_sleeping(url)
            assert sleep_metrics(url) == ((0, 0, 0) if level == 0 else (0, 1, 0))
        for _ in range(2):
            assert wake(url) == 200
            assert not is_sleeping(url)
            assert sleep_metrics(url) == (1, 0, 0)
        assert _sleep_wake_completion(url)["choices"]

    @pytest.mark.parametrize("first_tag", ["weights", "kv_cache"])
    def test_partial_wake_holds_and_recovers_same_request(self, url, first_tag):
        """DIFFERS: no `/load` route (vLLM's --enable-server-load-tracking): 404."""
        assert HTTP.get(f"{url}/load").status_code == 404
        baseline = _sleep_wake_completion(url)
        assert sleep(url) == 200
        assert wake(url, tags=[first_tag]) == 200
        assert is_sleeping(url)
        remaining = "kv_cache" if first_tag == "weights" else "weights"
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(_sleep_wake_completion, url)
            try:
                _assert_request_is_held(future)
                assert health(url) == 200
            finally:
                assert wake(url, tags=[remaining]) == 200
            restored = future.result(timeout=30)
        assert not is_sleeping(url)
        assert golden_output(restored) == golden_output(baseline)

    @pytest.mark.parametrize("level", [0, 1])
    def test_sleep_queues_new_request_until_wake(self, url, level):
        assert sleep(url, level=level) == 200
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(_sleep_wake_completion, url)
            try:
                _assert_request_is_held(future)
            finally:
                assert wake(url) == 200
            response = future.result(timeout=30)
        assert response["choices"][0]["finish_reason"] in ("stop", "length")

    def test_deep_sleep_restores_checkpoint_before_generation(self, url, model_dir):
        """vLLM's sequence: sleep level 2, wake weights, collective_rpc("reload_weights")
        (vLLM's built-in worker method; hotswap's reloads the served checkpoint as a new
        version), wake kv_cache; output equals the output before the sleep."""
        baseline = _sleep_wake_completion(url)
        assert sleep(url, level=2) == 200
        try:
            assert sleep_metrics(url) == (0, 0, 1)
        finally:
            assert wake(url, tags=["weights"]) == 200
            rpc = HTTP.post(f"{url}/collective_rpc", json={"method": "reload_weights"},
                            timeout=120)  # fmt: skip
            assert rpc.status_code == 200 and rpc.json() == {"results": [None]}, rpc.text
            assert wake(url, tags=["kv_cache"]) == 200
        assert golden_output(_sleep_wake_completion(url)) == golden_output(baseline)

    @pytest.mark.parametrize("staged", [False, True])
    def test_sleep_wake_preserves_output_and_clears_prefix_cache(self, url, staged):
        assert sleep(url) == 200
        assert wake(url) == 200
        baseline = completion_with_cache_details(url, CACHE_PROMPT)
        assert cached_tokens(baseline) == 0
        assert cached_tokens(completion_with_cache_details(url, CACHE_PROMPT)) > 0
        for _ in range(2):
            assert sleep(url) == 200
            if staged:
                assert wake(url, tags=["weights"]) == 200
                assert is_sleeping(url)
                assert wake(url, tags=["kv_cache"]) == 200
            else:
                assert wake(url) == 200
            restored = completion_with_cache_details(url, CACHE_PROMPT)
            assert cached_tokens(restored) == 0
            assert golden_output(restored) == golden_output(baseline)
            before = baseline["choices"][0]["logprobs"]["token_logprobs"]
            after = restored["choices"][0]["logprobs"]["token_logprobs"]
            assert before and len(before) == len(after)
            assert all(value is not None for value in before + after)
            assert after == pytest.approx(before, abs=1e-2, rel=0)


WU_PROMPT = "Paris is the capital of France. Berlin is the capital of Germany. " * 8


def _wu_completion(url: str) -> dict:
    body = {"model": "m", "prompt": WU_PROMPT, "max_tokens": 8, "temperature": 0,
            "logprobs": 1, "return_token_ids": True}  # fmt: skip
    response = HTTP.post(f"{url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    return response.json()


def _assert_matches_trainer(response: dict, model: torch.nn.Module, tokenizer: Any) -> None:
    """Compare the same generated token positions, not free-running HF text."""
    choice = response["choices"][0]
    generated = choice["token_ids"]
    assert generated
    prompt = tokenizer.encode(WU_PROMPT)
    ids = torch.tensor([prompt + generated])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        targets = torch.tensor(generated)
        expected = logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    actual = choice["logprobs"]["token_logprobs"]
    assert len(actual) == len(generated)
    assert torch.isfinite(expected).all()
    assert actual == pytest.approx(expected.tolist(), abs=0.05, rel=0)


class TestStateTransitionsWeightUpdate:
    """state_transitions/test_weight_update.py (vllm-project/vllm@e6e8fd92).

    vLLM runs the rounds over IPC (one GPU) or NCCL (two GPUs); here over gloo, with
    hotswap's trainer side (`hotswap.weight_transfer`, the same factory/client/source API).
    DIFFERS: /weight_info == {"weight_version": version} is checked on vLLM's key only.
    """

    def test_transfer_commits_weights_and_version_across_rl_steps(self, url, trainer, model_dir):
        """Pause-only B update followed by level-2 restoration to A both match HF."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        head = trainer.model.get_output_embeddings().weight
        original = head.detach().clone()
        try:
            baseline = _wu_completion(url)
            _assert_matches_trainer(baseline, trainer.model, tokenizer)
            assert cached_tokens(_wu_completion(url)) > 0
            for version, deep_sleep in [("B", False), ("A-restored", True)]:
                with torch.no_grad():
                    head.copy_(original * (0.5 if version == "B" else 1.0))
                assert pause(url, clear_cache=True) == 200
                if deep_sleep:
                    assert sleep(url, level=2) == 200
                    assert wake(url, tags=["weights"]) == 200
                trainer.client.version = version
                trainer.engine.send_weights()
                assert subset(weight_info(url), {"weight_version": version})
                if deep_sleep:
                    assert wake(url, tags=["kv_cache"]) == 200
                assert resume(url) == 200
                result = _wu_completion(url)
                assert cached_tokens(result) == 0
                _assert_matches_trainer(result, trainer.model, tokenizer)
                if version == "A-restored":
                    assert result["choices"][0]["token_ids"] == baseline["choices"][0]["token_ids"]
                assert cached_tokens(_wu_completion(url)) > 0
        finally:
            with torch.no_grad():
                head.copy_(original)
            trainer.client.version = "default"


class TestStateTransitionsWeightChecker:
    """state_transitions/test_weight_checker.py (vllm-project/vllm@03af5191) and the RFC's
    test_weight_checker.py (@9780c138): POST /weight_checker (checksum / compare with a
    baseline; the RFC's snapshot / compare / checksum / reset).

    DIFFERS: `reset` forgets the snapshot (the RFC's meaning); upstream's reset also
    randomizes the weights, which hotswap never does.
    """

    def test_checksum_snapshot_compare_reset(self, url):
        checksums = HTTP.post(f"{url}/weight_checker", json={"action": "checksum"}).json()
        sums = checksums["checksums"]
        assert sums and all(k.startswith("dp0:pp0:pcp0:tp0:ep0:") for k in sums)
        assert all(len(v) == 64 for v in sums.values())
        same = HTTP.post(f"{url}/weight_checker", json={"action": "compare", "baseline": sums})
        assert same.json() == {"match": True, "mismatches": []}
        first = sorted(sums)[0]
        changed = {**sums, first: "0" * 64}
        diff = HTTP.post(f"{url}/weight_checker", json={"action": "compare", "baseline": changed})
        assert diff.json() == {"match": False, "mismatches": [first]}
        snap = HTTP.post(f"{url}/weight_checker", json={"action": "snapshot"}).json()
        assert snap == {"status": "snapshotted", "n_tensors": len(sums)}
        again = HTTP.post(f"{url}/weight_checker", json={"action": "compare"}).json()
        assert again["match"] is True
        assert HTTP.post(f"{url}/weight_checker", json={"action": "reset"}).json() == {
            "status": "reset"}  # fmt: skip
        none = HTTP.post(f"{url}/weight_checker", json={"action": "compare"})
        assert none.status_code == 400 and none.json()["error"]["param"] == "body.baseline"
        bad = HTTP.post(f"{url}/weight_checker", json={"action": "nope"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "body.action"
        assert health(url) == 200


# == top-level RFC-era modules (PR #45586) =====================================================
class TestFinishWeightUpdate:
    """test_finish_weight_update.py (vllm-project/vllm@e870279d). vLLM drives its router
    with a mock engine; here a real empty round (start, then finish) on a real engine.

    DIFFERS: hotswap's finish answer adds what it committed (`weight_version`, `version`,
    `digest`, `weight_gen`, `weight_label`) to vLLM's {"message": ...}.
    """

    def _finish(self, url: str, **body: Any) -> httpx.Response:
        assert start_weight_update(url).status_code == 200
        return HTTP.post(f"{url}/finish_weight_update", json=body or None, timeout=30)

    def test_finish_without_the_option_is_unchanged(self, url, trainer):
        response = self._finish(url)
        assert response.status_code == 200
        assert subset(response.json(), {"message": "Weight update finished"})
        assert "checksums" not in response.json()

    def test_finish_returns_the_snapshot_when_requested(self, url, trainer):
        response = self._finish(url, checksum=True)
        assert response.status_code == 200
        body = response.json()
        assert body["message"] == "Weight update finished"
        assert body["checksums"]
        assert all(key.startswith("dp0:pp0:pcp0:tp0:ep0:") for key in body["checksums"])
        assert all(len(digest) == 64 for digest in body["checksums"].values())

    def test_finish_forwards_a_weight_version_with_the_option(self, url, trainer):
        response = self._finish(url, weight_version="step-7", checksum=True)
        assert response.status_code == 200
        assert response.json()["weight_version"] == "step-7" == weight_info(url)["weight_version"]
        assert response.json()["checksums"]

    def test_checksum_defaults_to_false_when_only_a_version_is_sent(self, url, trainer):
        response = self._finish(url, weight_version="step-7")
        assert response.status_code == 200
        assert "checksums" not in response.json()

    @pytest.mark.skip(reason="needs vLLM's mock engine answering None to checksum=True; a "
                      "real engine always answers the snapshot")  # fmt: skip
    def test_no_checksums_key_when_the_engine_reports_none(self):
        """test_finish_weight_update.py::test_no_checksums_key_when_the_engine_reports_none"""


class TestStateMachine:
    """test_state_machine.py (vllm-project/vllm@4cfde2e1, RFC #45585 / PR #45586)."""

    def test_full_sleep_sets_both_tags(self, url):
        assert sleep(url, level=1) == 200
        assert poll_until(lambda: is_sleeping(url))
        assert wake(url) == 200
        assert poll_until(lambda: not is_sleeping(url))
        assert health(url) == 200

    def test_partial_wake_weights_only_keeps_sleeping(self, url):
        assert sleep(url, level=1) == 200
        assert poll_until(lambda: is_sleeping(url))
        assert wake(url, tags=["weights"]) == 200
        assert is_sleeping(url)
        assert wake(url, tags=["kv_cache"]) == 200
        assert poll_until(lambda: not is_sleeping(url))
        assert health(url) == 200

    def test_sleep_level0_sets_is_sleeping_no_memory_tags(self, url):
        assert sleep(url, level=0) == 200
        assert poll_until(lambda: is_sleeping(url))
        assert wake(url) == 200
        assert poll_until(lambda: not is_sleeping(url))
        assert health(url) == 200

    def test_pause_sets_is_paused_and_is_sleeping(self, url):
        """DIFFERS: after /pause hotswap's is_sleeping is False (pause and sleep are
        separate states; vLLM's is_sleeping = scheduler paused OR executor asleep). The
        RFC's own test_sleep_wake.py::test_pause_blocks_without_releasing_memory expects
        False, as hotswap answers."""
        assert pause(url, mode="abort") == 200
        assert poll_until(lambda: is_paused(url))
        assert is_sleeping(url) is False  # vLLM: True
        assert resume(url) == 200
        assert poll_until(lambda: not is_paused(url))
        assert is_sleeping(url) is False
        assert health(url) == 200

    def test_sleep_sets_is_paused_and_is_sleeping(self, url):
        assert sleep(url, level=1) == 200
        assert poll_until(lambda: is_sleeping(url))
        assert is_paused(url) is True
        assert wake(url) == 200
        assert poll_until(lambda: not is_sleeping(url))
        assert is_paused(url) is False
        assert health(url) == 200

    def test_resume_clears_both_pause_and_sleep(self, url):
        """DIFFERS: as test_pause_sets_is_paused_and_is_sleeping (is_sleeping stays False)."""
        assert pause(url, mode="abort") == 200
        assert poll_until(lambda: is_paused(url))
        assert is_sleeping(url) is False  # vLLM: True
        assert resume(url) == 200
        assert poll_until(lambda: not is_paused(url))
        assert is_sleeping(url) is False
        assert health(url) == 200

    def test_start_without_init_returns_error(self, url, initial):
        """hotswap: 409 "call init_weight_transfer_engine first" (vLLM: 500 "Weight
        transfer not configured"); both in the accepted (400, 409, 500)."""
        r = initial["start_without_init"]
        assert r.status_code in (400, 409, 500), r.text
        error_msg = str(r.json().get("error", {}).get("message", r.text)).lower()
        assert any(kw in error_msg for kw in ("not configured", "weight transfer", "init"))
        assert health(url) == 200

    def test_finish_without_start_returns_error(self, url):
        r = finish_weight_update(url)
        assert r.status_code in (400, 409, 500), r.text
        assert health(url) == 200

    def test_weight_update_endpoints_do_not_crash_engine(self, url):
        start_weight_update(url)
        finish_weight_update(url)
        assert health(url) == 200
        assert ok(gen(url))

    def test_double_sleep_engine_survives(self, url):
        assert sleep(url, level=1) == 200
        assert poll_until(lambda: is_sleeping(url))
        assert sleep(url, level=1) in (200, 400)
        assert health(url) == 200
        assert wake(url) == 200
        assert poll_until(lambda: not is_sleeping(url))
        assert health(url) == 200

    def test_double_wake_engine_survives(self, url):
        assert not is_sleeping(url)
        assert wake(url) in (200, 400)
        assert health(url) == 200

    def test_double_pause_engine_survives(self, url):
        assert pause(url, mode="abort") == 200
        assert poll_until(lambda: is_paused(url))
        assert pause(url, mode="abort") in (200, 400)
        assert health(url) == 200
        assert resume(url) == 200
        assert poll_until(lambda: not is_paused(url))

    def test_server_starts_awake_and_unpaused(self, url, initial):
        assert health(url) == 200
        assert initial["is_sleeping"] is False
        assert initial["is_paused"] is False

    def test_get_world_size_positive_on_fresh_server(self, url):
        r = get_world_size(url)
        assert r.status_code == 200
        ws = r.json()["world_size"]
        assert isinstance(ws, int) and ws >= 1

    def test_weight_update_active_false_on_startup(self, url, initial):
        assert initial["weight_update_active"] == {"weight_update_active": False}
        r = finish_weight_update(url)
        assert r.status_code in (400, 409, 500)
        assert health(url) == 200

    def test_concurrent_sleep_wake_calls_no_crash(self, url):
        errors: list[str] = []

        def _sleep_wake() -> None:
            try:
                sleep(url, level=1)
                time.sleep(0.05)
                wake(url)
            except Exception as e:
                errors.append(str(e))

        threads = [threading.Thread(target=_sleep_wake) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert health(url) == 200, f"engine died after concurrent sleep/wake: {errors}"
        if is_sleeping(url):
            wake(url)
            poll_until(lambda: not is_sleeping(url))


class TestStateMachineEnforcement:
    """test_state_machine_enforcement.py (vllm-project/vllm@9780c138)."""

    UPDATE = {"names": [], "dtype_names": [], "shapes": []}

    def test_inactive_at_startup(self, initial):
        assert initial["weight_update_active"]["weight_update_active"] is False

    def test_active_after_start(self, url, trainer):
        """vLLM's branch on a 200 start is taken: the trainer has initialized."""
        r = start_weight_update(url)
        if r.status_code == 200:
            assert weight_update_active(url) is True
        finish_weight_update(url)
        assert r.status_code == 200

    def test_double_start_returns_409(self, url, trainer):
        r1 = start_weight_update(url)
        assert r1.status_code == 200
        r2 = start_weight_update(url)
        assert r2.status_code == 409, r2.text
        assert health(url) == 200
        finish_weight_update(url)

    def test_finish_without_start_returns_409(self, url):
        r = finish_weight_update(url)
        assert r.status_code == 409, r.text
        assert health(url) == 200

    def test_engine_healthy_after_ordering_violation(self, url):
        finish_weight_update(url)
        assert ok(gen(url))

    def test_update_without_start_returns_409(self, url):
        r = update_weights(url, self.UPDATE)
        assert r.status_code == 409, r.text
        assert health(url) == 200

    def test_engine_healthy_after_update_ordering_violation(self, url):
        update_weights(url, self.UPDATE)
        assert ok(gen(url))

    def test_returns_bool_field(self, url):
        r = HTTP.get(f"{url}/weight_update_active", timeout=5)
        assert r.status_code == 200
        assert isinstance(r.json()["weight_update_active"], bool)

    def test_initial_value_is_false(self, initial):
        assert initial["weight_update_active"]["weight_update_active"] is False


class TestWeightInfoRFC:
    """test_weight_info.py (vllm-project/vllm@3a368c3b): the RFC's weight_gen / weight_label.

    DIFFERS: hotswap's /weight_info carries weight_gen and weight_label *beside* upstream
    vLLM's `weight_version` (plus `version`, `digest`), not instead; and the initial label
    is upstream's "default", not the RFC's "". A shared server has committed before most
    tests run, so "gen is 0" is checked on the state captured at start-up and "gen is
    unchanged" relative to the current gen.
    """

    def test_initial_weight_gen_is_zero(self, initial):
        body = initial["weight_info"]
        assert body["weight_gen"] == 0
        assert body["weight_label"] == "default"  # RFC: ""

    def test_weight_info_schema(self, url):
        body = weight_info(url)
        assert isinstance(body["weight_gen"], int)
        assert isinstance(body["weight_label"], str)
        # RFC: exactly {"weight_gen", "weight_label"}
        assert set(body) == {"weight_gen", "weight_label", "weight_version", "version", "digest"}

    def test_set_label_preserves_gen(self, url):
        before = weight_info(url)
        r = update_weight_label(url, "step-0")
        assert r.status_code == 200
        assert r.json() == {"weight_gen": before["weight_gen"], "weight_label": "step-0"}
        info = weight_info(url)
        assert info["weight_label"] == "step-0"
        assert info["weight_gen"] == before["weight_gen"]

    def test_label_can_be_overwritten(self, url):
        gen_before = weight_info(url)["weight_gen"]
        update_weight_label(url, "first")
        update_weight_label(url, "second")
        info = weight_info(url)
        assert info["weight_label"] == "second"
        assert info["weight_gen"] == gen_before

    def test_missing_label_returns_400(self, url):
        r = HTTP.post(f"{url}/update_weight_label", json={}, timeout=5)
        assert r.status_code in (400, 422)
        assert health(url) == 200

    def test_gen_starts_at_zero_and_label_does_not_bump(self, url, initial):
        assert initial["weight_info"]["weight_gen"] == 0
        gen_before = weight_info(url)["weight_gen"]
        for i in range(3):
            update_weight_label(url, f"label-{i}")
        info = weight_info(url)
        assert info["weight_gen"] == gen_before
        assert info["weight_label"] == "label-2"

    def test_gen_is_monotonic_contract(self, url):
        info = weight_info(url)
        assert isinstance(info["weight_gen"], int)
        assert info["weight_gen"] >= 0

    def test_weight_info_and_generate_coexist(self, url):
        info_before = weight_info(url)
        assert ok(gen(url))
        assert weight_info(url) == info_before


class TestResponseSchemaRFC:
    """test_response_schema.py (vllm-project/vllm@7e6abd20)."""

    def test_sleep_response_has_status_level_elapsed(self, url):
        r = sleep_response(url, level=1)
        assert r.status_code == 200
        body = r.json()
        assert body["status"] == "sleeping" and body["level"] == 1
        assert isinstance(body["elapsed_ms"], (int, float)) and body["elapsed_ms"] >= 0.0

    def test_sleep_level2_echoed_in_response(self, url):
        r = sleep_response(url, level=2)
        assert r.status_code == 200
        assert r.json()["status"] == "sleeping" and r.json()["level"] == 2

    def test_full_wake_reports_awake(self, url):
        assert sleep(url, level=1) == 200
        r = wake_response(url)
        assert r.status_code == 200
        body = r.json()
        assert body["status"] == "awake" and body["tags_woken"] is None
        assert isinstance(body["elapsed_ms"], (int, float)) and body["elapsed_ms"] >= 0.0
        assert health(url) == 200

    def test_partial_wake_reports_still_sleeping(self, url):
        assert sleep(url, level=1) == 200
        r = wake_response(url, tags=["weights"])
        assert r.status_code == 200
        assert r.json()["status"] == "sleeping" and r.json()["tags_woken"] == ["weights"]
        assert wake_response(url, tags=["kv_cache"]).json()["status"] == "awake"
        assert health(url) == 200

    def test_response_schema_round_trip_generates(self, url):
        assert sleep_response(url, level=1).json()["status"] == "sleeping"
        assert wake_response(url).json()["status"] == "awake"
        assert health(url) == 200
        assert ok(gen(url))


class TestSleepWakeRFC:
    """test_sleep_wake.py (vllm-project/vllm@4cfde2e1), the classes that need no GPU
    memory readings (TestPhysicalMemory is in test_needs_gpu_or_unsupported_topology)."""

    def test_sleep_sets_is_sleeping_and_metrics(self, url):
        assert sleep(url, level=1) == 200
        assert is_sleeping(url) is True
        assert sleep_metrics(url) == (0, 1, 0)
        assert wake(url) == 200
        assert is_sleeping(url) is False
        assert sleep_metrics(url) == (1, 0, 0)

    def test_level2_sets_discard_all_metric(self, url):
        assert sleep(url, level=2) == 200
        assert sleep_metrics(url)[2] == 1
        assert wake(url) == 200
        assert is_sleeping(url) is False
        assert health(url) == 200

    def test_staged_wake_keeps_is_sleeping_true(self, url):
        assert sleep(url, level=1) == 200
        assert wake(url, tags=["weights"]) == 200
        assert is_sleeping(url) is True
        assert wake(url, tags=["kv_cache"]) == 200
        assert is_sleeping(url) is False

    def test_partial_wake_blocks_until_kv_resident(self, url):
        assert sleep(url, level=1) == 200
        assert wake(url, tags=["weights"]) == 200
        assert is_sleeping(url) is True
        t, result = in_thread(lambda: try_gen(url, timeout=8))
        time.sleep(0.5)  # vLLM: 3 s
        assert health(url) == 200
        assert wake(url, tags=["kv_cache"]) == 200
        assert is_sleeping(url) is False
        t.join(timeout=30)
        assert health(url) == 200
        assert ok(try_gen(url))

    def test_sleep_abort_mode_blocks_new_requests(self, url):
        assert sleep(url, level=1, mode="abort") == 200
        assert is_sleeping(url) is True
        assert not ok(try_gen(url, timeout=HELD_S))  # held, not refused: times out
        assert health(url) == 200
        assert wake(url) == 200
        assert ok(try_gen(url))

    def test_sleep_level0_blocks_without_releasing_memory(self, url):
        assert sleep(url, level=0) == 200
        assert is_sleeping(url) is True
        assert not ok(try_gen(url, timeout=HELD_S))
        assert health(url) == 200
        assert wake(url) == 200
        assert ok(try_gen(url))

    def test_full_wake_restores_output(self, url):
        golden_text = gen(url)["choices"][0]["text"]
        assert sleep(url, level=1) == 200
        assert wake(url) == 200
        assert gen(url)["choices"][0]["text"] == golden_text

    def test_staged_wake_restores_output(self, url):
        golden_text = gen(url)["choices"][0]["text"]
        assert sleep(url, level=1) == 200
        assert wake(url, tags=["weights"]) == 200
        assert wake(url, tags=["kv_cache"]) == 200
        assert gen(url)["choices"][0]["text"] == golden_text

    def test_multiple_cycles_stable(self, url):
        golden_text = gen(url)["choices"][0]["text"]
        for _ in range(3):
            assert sleep(url, level=1) == 200
            assert wake(url) == 200
            assert health(url) == 200
            assert gen(url)["choices"][0]["text"] == golden_text

    def test_prefix_cache_cleared_after_wake(self, url):
        prompt = "The capital of France is"
        gen(url, prompt=prompt)
        assert sleep(url, level=1) == 200
        assert wake(url) == 200
        assert health(url) == 200
        assert ok(gen(url, prompt=prompt))

    def test_pause_blocks_without_releasing_memory(self, url):
        assert pause(url, mode="abort") == 200
        assert is_paused(url) is True
        assert is_sleeping(url) is False  # distinct from sleep (as hotswap answers)
        assert not ok(try_gen(url, timeout=HELD_S))
        assert resume(url) == 200
        assert is_paused(url) is False
        assert ok(try_gen(url))

    def test_pause_mode_wait_drains_inflight_request(self, url):
        t, result = in_thread(lambda: try_gen(url, max_tokens=32, timeout=60))
        time.sleep(0.5)
        assert pause(url, mode="wait") == 200
        t.join(timeout=30)
        assert result.get("resp") is not None
        assert not ok(try_gen(url, timeout=HELD_S))
        assert resume(url) == 200

    def test_pause_mode_keep_resumes_frozen_request(self, url):
        """max_tokens 256 with ignore_eos (vLLM: 16), streamed, and paused once its first
        tokens arrive (vLLM waits 0.3 s, which the CPU kernels outrun on the tiny model):
        the request must be frozen mid-way, then finish after resume."""
        body = {"model": "m", "prompt": "The capital of France is", "max_tokens": 256,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        texts: list[str] = []
        finish: list[str] = []
        started = threading.Event()

        def consume() -> None:
            with HTTP.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        texts.append(choice["text"])
                        finish.append(choice.get("finish_reason"))
                        started.set()

        t = threading.Thread(target=consume)
        t.start()
        assert started.wait(30)
        assert pause(url, mode="keep") == 200
        time.sleep(0.1)  # chunks already on the wire land
        frozen = len(texts)
        time.sleep(HELD_S)  # vLLM: 1 s
        assert len(texts) == frozen and not any(finish), "request progressed while paused"
        assert resume(url) == 200
        t.join(timeout=30)
        assert finish[-1] == "length" and len(texts) > frozen

    def test_get_world_size(self, url):
        r = HTTP.get(f"{url}/get_world_size", timeout=5)
        assert r.status_code == 200
        ws = r.json()["world_size"]
        assert isinstance(ws, int) and ws >= 1

    def test_double_sleep_idempotent(self, url):
        assert sleep(url, level=1) == 200
        assert sleep(url, level=1) in (200, 400)
        assert wake(url) == 200
        assert health(url) == 200
        assert ok(try_gen(url))

    def test_wake_while_awake_idempotent(self, url):
        try_gen(url)
        assert is_sleeping(url) is False
        assert wake(url) in (200, 400)
        assert health(url) == 200
        assert ok(try_gen(url))

    def test_abort_then_sleep_wake(self, url):
        body = {"model": "m", "prompt": "x" * 200, "max_tokens": 256, "temperature": 0}
        t, _ = in_thread(lambda: HTTP.post(f"{url}/v1/completions", json=body, timeout=1))
        time.sleep(0.3)
        assert sleep(url, level=1) == 200
        assert wake(url) == 200
        assert health(url) == 200
        assert ok(try_gen(url))
        t.join(timeout=10)


class TestSleepModeRFC:
    """state_transitions/test_sleep_mode.py (vllm-project/vllm@53ace941), without its GPU
    free-bytes readings (cumem-only parts: test_needs_gpu_or_unsupported_topology)."""

    def test_flags_metrics_memory(self, url):
        gen(url)
        assert sleep(url, level=1) == 200
        assert poll_until(lambda: is_sleeping(url))
        assert sleep_metrics(url) == (0, 1, 0)
        assert wake(url) == 200
        assert poll_until(lambda: not is_sleeping(url))
        assert sleep(url, level=2) == 200
        assert poll_until(lambda: is_sleeping(url))
        assert sleep_metrics(url)[2] == 1
        assert wake(url) == 200
        assert health(url) == 200
        assert sleep(url, level=0) == 200
        assert poll_until(lambda: is_sleeping(url))
        _, wo, da = sleep_metrics(url)
        assert wo == 0 and da == 0
        assert wake(url) == 200
        assert health(url) == 200

    def test_staged_wake_semantics(self, url):
        gen(url)
        assert sleep(url, level=1) == 200
        assert poll_until(lambda: is_sleeping(url))
        assert wake(url, tags=["weights"]) == 200
        assert is_sleeping(url) is True
        assert wake(url, tags=["kv_cache"]) == 200
        assert poll_until(lambda: not is_sleeping(url))
        assert health(url) == 200

    def test_output_correctness(self, url):
        golden = gen(url)
        assert ok(golden)
        golden_text = golden["choices"][0]["text"]
        assert sleep(url, level=1) == 200
        assert wake(url) == 200
        assert gen(url)["choices"][0]["text"] == golden_text
        assert sleep(url, level=1) == 200
        assert wake(url, tags=["weights"]) == 200
        assert wake(url, tags=["kv_cache"]) == 200
        assert gen(url)["choices"][0]["text"] == golden_text
        prompt = "The capital of France is"
        gen(url, prompt=prompt)
        assert sleep(url, level=1) == 200
        assert wake(url) == 200
        assert ok(gen(url, prompt=prompt))

    def test_partial_wake_blocks_until_kv_resident(self, url):
        assert sleep(url, level=1) == 200
        assert wake(url, tags=["weights"]) == 200
        assert is_sleeping(url) is True
        t, _ = in_thread(lambda: try_gen(url, timeout=8))
        time.sleep(0.5)  # vLLM: 3 s
        assert health(url) == 200
        assert wake(url, tags=["kv_cache"]) == 200
        assert poll_until(lambda: not is_sleeping(url))
        t.join(timeout=30)
        assert health(url) == 200
        assert ok(gen(url))

    def test_sleep_blocks_and_recovers(self, url):
        assert sleep(url, level=1, mode="abort") == 200
        assert is_sleeping(url) is True
        assert not ok(try_gen(url, timeout=HELD_S))
        assert health(url) == 200
        assert wake(url) == 200
        assert ok(gen(url))

        assert sleep(url, level=0) == 200
        assert is_sleeping(url) is True
        assert not ok(try_gen(url, timeout=HELD_S))
        assert health(url) == 200
        assert wake(url) == 200
        assert ok(gen(url))

        body = {"model": "m", "prompt": "Count from 1 to 100:", "max_tokens": 64,
                "temperature": 1.0, "n": 4}  # fmt: skip
        t, result = in_thread(
            lambda: HTTP.post(f"{url}/v1/completions", json=body, timeout=15).json()
        )
        time.sleep(0.3)
        assert sleep(url, level=1, mode="abort") == 200
        t.join(timeout=15)
        assert "err" not in result, result.get("err")
        assert health(url) == 200
        assert wake(url) == 200
        assert ok(gen(url))

    def test_idempotency(self, url):
        assert is_sleeping(url) is False
        assert sleep(url, level=1) == 200
        assert poll_until(lambda: is_sleeping(url))
        assert sleep(url, level=1) in (200, 400)
        assert health(url) == 200
        assert wake(url) == 200
        assert poll_until(lambda: not is_sleeping(url))
        assert ok(gen(url))
        assert is_sleeping(url) is False
        assert wake(url) in (200, 400)
        assert health(url) == 200
        assert ok(gen(url))

    def test_concurrent_and_cumem_edge(self, url):
        errors: list[str] = []

        def _gen_thread() -> None:
            try_gen(url, max_tokens=8, timeout=10)

        def _sleep_wake_thread() -> None:
            try:
                sleep(url, level=1, mode="abort")
                time.sleep(0.2)
                wake(url)
            except Exception as e:
                errors.append(str(e))

        threads = [threading.Thread(target=_gen_thread) for _ in range(10)]
        sw = threading.Thread(target=_sleep_wake_thread)
        for t in threads:
            t.start()
        time.sleep(0.1)
        sw.start()
        sw.join(timeout=30)
        for t in threads:
            t.join(timeout=30)
        assert not [i for i, t in enumerate(threads) if t.is_alive()]
        assert not sw.is_alive()
        assert not errors
        assert health(url) == 200
        assert ok(gen(url))

        gen(url)
        assert sleep(url, level=1) == 200
        assert wake(url, tags=["weights"]) == 200
        assert is_sleeping(url)
        assert sleep(url, level=1) == 200
        assert wake(url) == 200
        assert ok(gen(url))

        assert sleep(url, level=1) == 200
        assert wake(url, tags=["weights"]) == 200
        assert wake(url, tags=["weights"]) == 200
        assert wake(url) == 200
        assert ok(gen(url))

        assert sleep(url, level=1) == 200
        assert wake(url, tags=["kv_cache"]) == 200
        assert is_sleeping(url)
        try_gen(url, max_tokens=2, timeout=HELD_S)
        assert health(url) == 200
        assert wake(url) == 200
        assert ok(gen(url))

    def test_multi_cycle_leak_latency(self, url):
        golden_text = gen(url)["choices"][0]["text"]
        cycle_times = []
        for i in range(5):
            gen(url)
            t0 = time.perf_counter()
            assert sleep(url, level=1) == 200
            assert wake(url, tags=["weights"]) == 200
            assert wake(url, tags=["kv_cache"]) == 200
            elapsed = time.perf_counter() - t0
            assert health(url) == 200
            if i >= 1:
                cycle_times.append(elapsed)
            assert gen(url)["choices"][0]["text"] == golden_text, f"drift on cycle {i}"
        assert max(cycle_times) < 10.0

    def test_logprobs_precision(self, url):
        prompt = "The capital of France is Paris and the capital of Germany is"

        def _get_logprobs() -> list:
            return gen_with_logprobs(url, prompt, max_tokens=4)["choices"][0]["logprobs"][
                "token_logprobs"
            ]

        before = _get_logprobs()
        assert len(before) > 0
        assert sleep(url, level=1) == 200
        assert wake(url) == 200
        assert health(url) == 200
        after = _get_logprobs()
        assert len(after) == len(before)
        pairs = [(b, a) for b, a in zip(before, after, strict=True) if None not in (a, b)]
        assert pairs and all(abs(b - a) < 1e-2 for b, a in pairs)


class TestCumemPhysical:
    """test_cumem_physical.py (vllm-project/vllm@6301aac5): its state-machine and
    cross-tag-ordering tests, without GPU free-bytes readings (the CUDA-graph ones are in
    test_needs_gpu_or_unsupported_topology)."""

    def test_partial_wake_weights_only_leaves_kv_unmapped(self, url):
        assert ok(gen(url))
        assert sleep(url, level=1) == 200
        assert wake(url, tags=["weights"]) == 200
        assert is_sleeping(url)
        assert wake(url) == 200
        assert not is_sleeping(url)

    def test_sleep_after_partial_wake_no_double_unmap(self, url):
        assert ok(gen(url))
        assert sleep(url, level=1) == 200
        assert wake(url, tags=["weights"]) == 200
        assert is_sleeping(url)
        assert sleep(url, level=1) == 200
        assert wake(url) == 200
        assert not is_sleeping(url)
        assert ok(gen(url))

    def test_repeated_partial_wake_same_tag_idempotent(self, url):
        assert ok(gen(url))
        assert sleep(url, level=1) == 200
        assert wake(url, tags=["weights"]) == 200
        assert wake(url, tags=["weights"]) == 200
        assert wake(url) == 200
        assert ok(gen(url))

    def _attempt(self, url: str) -> None:
        """A completion sent while partly awake: held (a client timeout) or an error,
        never a crash (a connection refused)."""
        body = {"model": "m", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        with contextlib.suppress(httpx.TimeoutException):
            HTTP.post(f"{url}/v1/completions", json=body, timeout=HELD_S)

    def test_wake_weights_then_generate_blocked(self, url):
        assert ok(gen(url))
        assert sleep(url, level=1) == 200
        assert wake(url, tags=["weights"]) == 200
        assert is_sleeping(url)
        self._attempt(url)
        assert health(url) == 200
        assert wake(url) == 200
        assert ok(gen(url))

    def test_wake_kv_then_weights_scheduler_blocks(self, url):
        assert ok(gen(url))
        assert sleep(url, level=1) == 200
        assert wake(url, tags=["kv_cache"]) == 200
        assert is_sleeping(url)
        self._attempt(url)
        assert health(url) == 200
        assert wake(url) == 200
        assert ok(gen(url))

    def test_full_wake_cycle_forward_succeeds(self, url):
        expected = gen(url)["choices"][0]["text"]
        assert sleep(url, level=1) == 200
        assert wake(url) == 200
        assert not is_sleeping(url)
        assert gen(url)["choices"][0]["text"] == expected

    def test_concurrent_wake_and_generate_no_crash(self, url):
        assert ok(gen(url))
        body = {"model": "m", "prompt": "Hi", "max_tokens": 2, "temperature": 0}
        for _ in range(3):
            assert sleep(url, level=1) == 200
            t1, r1 = in_thread(lambda: wake(url))
            t2, r2 = in_thread(lambda: HTTP.post(f"{url}/v1/completions", json=body, timeout=15))
            t1.join(timeout=20)
            t2.join(timeout=20)
            assert "err" not in r1 and "err" not in r2, (r1, r2)
            assert poll_until(lambda: health(url) == 200)
            if is_sleeping(url):
                wake(url)


class TestWeightUpdateRFC:
    """test_weight_update.py (vllm-project/vllm@0665f6e3): the protocol classes. Its
    TestWeightUpdateWithTensors (skipped by vLLM unless VLLM_TEST_MODEL_ALT) and
    TestWeightReloadCodePaths (GPU, MoE/fp8) are in test_needs_gpu_or_unsupported_topology."""

    def test_start_finish_no_tensors_engine_survives(self, url, trainer):
        """With the trainer's init done, start is 200 (vLLM's 200 branch). DIFFERS:
        without an init hotswap answers 409 where vLLM answers 500 (both refusals)."""
        response = start_weight_update(url)
        assert response.status_code in (200, 500), response.text
        if response.status_code == 200:
            response = finish_weight_update(url)
            assert response.status_code == 200, response.text
        assert health(url) == 200
        assert ok(gen(url))

    def test_get_world_size_positive(self, url):
        response = get_world_size(url)
        assert response.status_code == 200
        world_size = response.json()["world_size"]
        assert isinstance(world_size, int) and world_size >= 1

    def test_finish_without_start_handled(self, url):
        response = finish_weight_update(url)
        assert response.status_code in (200, 400, 409, 500), response.text
        assert health(url) == 200

    def test_prefix_cache_flushed_after_finish(self, url):
        prompt = "The capital of France is"
        assert ok(gen(url, prompt=prompt))
        start_weight_update(url)
        finish_weight_update(url)
        assert ok(gen(url, prompt=prompt))

    def test_start_without_init_returns_error_and_engine_survives(self, url, initial):
        response = initial["start_without_init"]
        assert response.status_code in (400, 409, 500), response.text
        message = str(response.json().get("error", {}).get("message", "")).lower()
        assert any(k in message for k in ("not configured", "weight transfer", "init", "config"))
        assert health(url) == 200
        assert ok(gen(url))

    def test_update_weights_without_start_returns_error(self, url):
        response = update_weights(url, {"name": "dummy", "dtype": "float32", "shape": [1]})
        assert response.status_code in (400, 409, 500)
        assert health(url) == 200
        assert ok(gen(url))

    def test_finish_without_start_returns_error_and_engine_survives(self, url):
        response = finish_weight_update(url)
        assert response.status_code in (400, 409, 500)
        assert health(url) == 200
        assert ok(gen(url))


class TestWeightUpdateMetrics:
    """test_weight_update_metrics.py (vllm-project/vllm@0857dec3). "Initially 0" reads
    the metrics scraped at start-up; "unchanged" is relative on the shared server."""

    ENGINE = {"engine": "0"}

    def test_metrics_registered_at_startup(self, initial):
        metrics = initial["metrics"]
        assert "vllm:rl_weight_update_duration_seconds" in metrics
        assert "vllm:rl_weight_gen" in metrics
        assert "vllm:rl_weight_update_active" in metrics

    def test_initial_weight_gen_gauge_is_zero(self, initial):
        assert metric_value(initial["metrics"], "vllm:rl_weight_gen", self.ENGINE) == 0.0

    def test_initial_active_gauge_is_zero(self, initial):
        value = metric_value(initial["metrics"], "vllm:rl_weight_update_active", self.ENGINE)
        assert value == 0.0

    def test_weight_gen_gauge_tracks_update_weight_label_calls(self, url):
        before = metric_value(metric_samples(url), "vllm:rl_weight_gen", self.ENGINE)
        response = update_weight_label(url, "test")
        assert response.status_code == 200, response.text
        assert metric_value(metric_samples(url), "vllm:rl_weight_gen", self.ENGINE) == before

    def test_active_gauge_starts_at_zero(self, url):
        assert metric_value(metric_samples(url), "vllm:rl_weight_update_active", self.ENGINE) == 0

    def test_engine_label_present_in_all_metrics(self, url):
        metrics = metric_samples(url)
        for name in ("vllm:rl_weight_gen", "vllm:rl_weight_update_active"):
            assert metrics.get(name), f"{name} has no samples"
            assert all("engine" in sample.labels for sample in metrics[name])

    def test_metrics_and_generate_coexist(self, url):
        metric_samples(url)
        assert ok(gen(url))
        metric_samples(url)
        assert health(url) == 200


class TestWeightOperationMetrics:
    """test_weight_operation_metrics.py (vllm-project/vllm@29bf676a; two API servers and
    the IPC backend there, one front end and gloo here).

    DIFFERS: vLLM exports vllm:rl_weight_update_operation_duration_seconds{operation}
    and vllm:rl_weight_update_operations_in_flight{operation}; hotswap exports neither,
    only vllm:rl_weight_update_operations_total{operation,status} (which vLLM also has),
    so the per-operation counts are read from the counter.
    """

    SYNCS = 3

    def test_weight_sync_metrics_aggregate_across_api_servers(self, url, trainer):
        def counts() -> dict[str, float]:
            samples = metric_samples(url).get("vllm:rl_weight_update_operations", [])
            return {s.labels["operation"]: s.value for s in samples
                    if s.name.endswith("_total") and s.labels["status"] == "success"}  # fmt: skip

        before = counts()
        for _ in range(self.SYNCS):
            trainer.engine.send_weights()
        after = counts()
        metrics = metric_samples(url)
        assert after["init"] >= 1
        for operation in ("start", "update", "finish"):
            assert after[operation] - before.get(operation, 0) == self.SYNCS, operation
        assert "vllm:rl_weight_update_operation_duration_seconds" not in metrics
        assert "vllm:rl_weight_update_operations_in_flight" not in metrics


# == what cannot run here ======================================================================
GPU_ONLY = {
    "test_sleep_wake.py::TestPhysicalMemory (4 tests)": "GPU free bytes after cumem unmap",
    "test_sleep_mode.py GPU-memory assertions": "GPU free bytes (their flag checks run above)",
    "test_cumem_physical.py::TestSleepWakeWithGraphPool (2 tests)": "CUDA graphs + cumem",
    "test_multi_gpu.py (4 tests)": "TP=2 on two GPUs",
    "consistency/test_routed_experts.py (2 tests)": "TP2+DP2 on four GPUs (routing replay "
    "itself: tests/entrypoints/openai/test_routed_experts.py)",
    "state_transitions/test_weight_checker.py::TestWeightCheckerTP2DP2EP": "TP2/DP2/EP on "
    "four GPUs",
    "test_weight_update.py::TestWeightUpdateWithTensors": "skipped by vLLM unless "
    "VLLM_TEST_MODEL_ALT; inline base64 tensor `data` in update_info is not a format of "
    "hotswap's backends (the bytes move on the data plane)",
    "test_weight_update.py::TestWeightReloadCodePaths": "offline LLM + collective_rpc "
    "layerwise reload on MoE/fp8/mxfp8 GPU checkpoints",
    "test_weight_operation_metrics.py with --api-server-count 2": "several API server "
    "processes (hotswap has one front end); the single-server form runs above",
    "state_transitions/test_pause_multi_frontend.py with --api-server-count 2": "several "
    "API server processes; the single-server form runs above",
}


@pytest.mark.parametrize("vllm_test", sorted(GPU_ONLY))
def test_needs_gpu_or_unsupported_topology(vllm_test):
    pytest.skip(f"{VLLM}{vllm_test}: {GPU_ONLY[vllm_test]}")
