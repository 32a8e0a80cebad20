"""In-flight updates against a real `hotswap serve`: completions keep running while a
trainer sends weights over gloo with no pause around `send_weights()`, and the round's
`kv_policy` (chosen per round through the trainer API, over the server's default) decides
whether tokens after the switch are marked stale."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time

import httpx
import pytest

from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from tests.helpers.server import RemoteServer
from tests.helpers.waiting import wait_until
from tests.weight_transfer.conftest import free_port

# A server and trainer processes: slow.
pytestmark = pytest.mark.slow

CONFIG = '{"backend": "gloo", "in_flight": true, "double_buffer": true}'
MAX_TOKENS = 480  # the tiny model's 512 positions, less the prompts


ARGS = ("--served-model-name", "tiny", "--dtype", "float32", "--enable-control",
        "--weight-transfer-config", CONFIG)  # fmt: skip


@pytest.fixture(scope="module")
def server(v1_dir):  # noqa: ANN201
    with RemoteServer(v1_dir, *ARGS, "--num-threads", "1") as srv:
        yield srv


@pytest.fixture(scope="module")
def tp_server(v1_dir):  # noqa: ANN201
    """Two tensor-parallel ranks, each with its shadow (on one thread each)."""
    with RemoteServer(v1_dir, *ARGS, "--num-threads", "2", "-tp", "2") as srv:
        yield srv


def complete(url: str, prompt: str) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def gauge(url: str, state: str) -> float:
    """hotswap:num_requests_{state} (running, waiting) as the server reports it now."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"hotswap:num_requests_{state}"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("kv_policy", ["recompute", "keep"])
def test_a_round_lands_mid_flight_without_a_pause(server, v2_trainer, kv_policy) -> None:
    client = HTTPWeightSyncClient(server.url)
    before = client.weight_info()["weight_version"]
    info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)
    sync = WeightTransferTrainerFactory.trainer_init(info, client, ModuleSource(v2_trainer))
    prompts = ["The quick brown fox", "Paged attention", "One two three", "Weights arrive"]
    # The requests are held until all four have arrived, then start together: a
    # request's 480 tokens take under a second, so one started alone could end before the
    # last arrives (the round itself then lands with no pause around it).
    httpx.post(f"{server.url}/pause", params={"mode": "keep"}).raise_for_status()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, server.url, p) for p in prompts]
        wait_until(lambda: gauge(server.url, "waiting") == len(prompts), "all four arrived")
        httpx.post(f"{server.url}/resume").raise_for_status()
        wait_until(lambda: gauge(server.url, "running") == len(prompts), "they run together")
        committed = sync.send_weights(f"step-{kv_policy}", kv_policy=kv_policy)
        choices = [f.result() for f in futures]
    assert committed.label == f"step-{kv_policy}"
    switched = 0
    for choice in choices:
        spans = choice["weight_versions"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == MAX_TOKENS
        versions = [s["version"] for s in spans]
        assert versions in ([committed.version - 1, committed.version], [committed.version - 1])
        switched += len(spans) == 2
        for span in spans:  # tokens after the switch: stale only with the KV kept
            assert span["stale"] == (kv_policy == "keep" and span["version"] == committed.version)
    assert switched >= 2, "the round did not land while the requests ran"
    assert client.weight_info()["weight_version"] == f"step-{kv_policy}" != before
    sync.shutdown()
    client.close()


def round_open(url: str) -> bool:
    return 'hotswap:weight_round_open{model_name="tiny"} 1.0' in httpx.get(f"{url}/metrics").text


@pytest.mark.parametrize("ranks", ["one rank", "two ranks"])
def test_a_trainer_killed_mid_round_while_generation_runs(
    request,
    ranks: str,
    v1_trainer,
    v2_dir,  # noqa: ANN001
) -> None:
    """A trainer opens a round, holds it for a second, sends a little and dies: tokens
    keep coming all along (in flight: the round never stops the steps), the round is
    aborted (the weights stay: on two ranks, every rank forgets its shadow's writes from
    the receiving thread, beside the steps), and the next trainer's round succeeds."""
    from tests.weight_transfer.test_http import KILLED_TRAINER

    server = request.getfixturevalue("server" if ranks == "one rank" else "tp_server")

    script = KILLED_TRAINER.replace(
        "client.start_weight_update()\n",
        "client.start_weight_update()\nprint('round open', flush=True)\ntime.sleep(1.0)\n",
    )
    assert "round open" in script
    client = HTTPWeightSyncClient(server.url)
    before = client.weight_info()
    arrivals: list[float] = []
    stop = threading.Event()

    def keep_streaming() -> None:
        body = {"model": "tiny", "prompt": "Tokens keep coming", "max_tokens": 64,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        while not stop.is_set():
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                              timeout=60) as response:  # fmt: skip
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())

    streamer = threading.Thread(target=keep_streaming, daemon=True)
    streamer.start()
    trainer = subprocess.Popen(
        [sys.executable, "-c", script, server.url, str(free_port()), str(v2_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    marks = {line.strip(): time.monotonic() for line in trainer.stdout}  # until it dies
    assert trainer.wait(60) != 0 and "dying mid-round" in marks, trainer.stderr.read()
    deadline = time.monotonic() + 60
    while round_open(server.url):
        assert time.monotonic() < deadline, "the engine never noticed the dead trainer"
        time.sleep(0.05)
    closed = time.monotonic()
    wait_until(lambda: any(t > closed for t in arrivals), "a token after the round was aborted")
    stop.set()
    streamer.join(60)
    held = sum(marks["round open"] <= t <= marks["dying mid-round"] for t in arrivals)
    assert held > 0, "no token while the round was open"
    assert sum(t > closed for t in arrivals) > 0, "no token after the round was aborted"
    assert client.weight_info()["digest"] == before["digest"]
    info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)
    sync = WeightTransferTrainerFactory.trainer_init(info, client, ModuleSource(v1_trainer))
    assert sync.send_weights("after the dead trainer").label == "after the dead trainer"
    sync.shutdown()
    client.close()
