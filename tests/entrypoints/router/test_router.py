"""`hotswap route` over two real `hotswap serve` upstreams (tiny model, float32), driven
with the openai client and httpx: sessions stick to an upstream, keyless requests spread,
streams pass through, errors come back unchanged, the control plane moves both upstreams,
and a trainer that sees the router as one engine updates both in one two-phase round."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from hotswap.entrypoints.router.upstreams import UPSTREAM_HEADER
from hotswap.weight_transfer import GlooTrainerInitInfo, ModuleSource, WeightTransferTrainerFactory
from hotswap.weight_transfer.clients import HTTPWeightSyncClient
from tests.helpers.server import RemoteRouter, RemoteServer, concurrent_servers
from tests.weight_transfer.conftest import free_port

pytestmark = pytest.mark.slow

ARGS = ("--served-model-name", "tiny", "--dtype", "float32", "--enable-control",
        "--weight-transfer-config", '{"backend": "gloo"}', "--enable-lora",
        "--worker-extension-cls", "tests.helpers.gloo_extension:GlooReceiver")  # fmt: skip
# Seconds of work on the tiny model each (its context is 512 tokens)
LONG = {"model": "tiny", "prompt": "busy", "max_tokens": 480, "n": 8, "ignore_eos": True,
        "stream": True}  # fmt: skip
BUSY = 3  # long requests on the session's upstream: within the spill margin (4)


@pytest.fixture(scope="module")
def stack(v1_dir) -> Iterator[tuple[RemoteRouter, list[RemoteServer]]]:  # noqa: ANN001
    with concurrent_servers((v1_dir, *ARGS), (v1_dir, *ARGS)) as upstreams:
        router = RemoteRouter(" ".join(s.url for s in upstreams))
        try:
            yield router, upstreams
        finally:
            router.stop()


def in_flight(router: RemoteRouter) -> list[int]:
    text = httpx.get(f"{router.url}/metrics").text
    return [int(n) for n in re.findall(r"^hotswap_router:in_flight\{.*\} (\d+)$", text, re.M)]


def wait_for(check, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def aborted(server: RemoteServer) -> int:
    """Requests the upstream finished as aborted (a client that went away)."""
    text = httpx.get(f"{server.url}/metrics").text
    found = re.search(r'^hotswap:request_success_total{[^}]*finished_reason="abort"[^}]*} (\S+)$',
                      text, re.M)  # fmt: skip
    return int(float(found.group(1))) if found else 0


def running(server: RemoteServer) -> int:
    text = httpx.get(f"{server.url}/metrics").text
    found = re.search(r"^hotswap:num_requests_running{[^}]*} (\S+)$", text, re.M)
    assert found, text
    return int(float(found.group(1)))


def test_a_session_sticks_to_its_upstream_and_keyless_requests_spread(stack) -> None:  # noqa: ANN001
    """Each turn of a session goes where its first went while long requests keep that
    upstream busier (least-loaded routing would send the turns to the other), where a
    keyless request goes; the long ones, left by their client, are released."""
    router, upstreams = stack
    client = router.openai()

    def turn(i: int, session: str | None = "s-1") -> int:
        headers = {"X-Session-ID": session} if session else {}
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=f"turn {i}", max_tokens=2, extra_headers=headers
        )
        assert raw.parse().choices[0].text is not None
        return int(raw.headers[UPSTREAM_HEADER])

    home = turn(0)
    with contextlib.ExitStack() as busy:
        http, readers = busy.enter_context(router.client()), []
        for _ in range(BUSY):  # pinned by the router's own X-data-parallel-rank
            pin = {"X-data-parallel-rank": str(home)}
            stream = busy.enter_context(http.stream("POST", "/v1/completions", json=LONG,
                                                    headers=pin))  # fmt: skip
            assert stream.headers[UPSTREAM_HEADER] == str(home)
            readers.append(stream.iter_lines())  # kept: a dropped one closes its connection
            next(readers[-1])  # admitted
        assert [turn(i) for i in range(1, 4)] == [home] * 3
        assert turn(9, session=None) == 1 - home  # keyless: to the least-loaded
        assert in_flight(router)[home] == BUSY  # the long ones were in flight throughout
    # The client left: the router released them. (Whether the upstream still ran them is
    # a race with the tiny model's speed, since an engine generates whether or not its
    # client reads; the plain-request test below checks an abort upstream.)
    wait_for(lambda: in_flight(router) == [0, 0])
    wait_for(lambda: running(upstreams[home]) == 0)
    metrics = httpx.get(f"{router.url}/metrics").text
    assert "hotswap_router:session_hits 3" in metrics
    assert f"hotswap_router:pinned {BUSY}" in metrics


def test_streams_pass_through_and_errors_come_back_unchanged(stack) -> None:  # noqa: ANN001
    router, upstreams = stack
    stream = router.openai().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert len(chunks) >= 8 and chunks[-1].choices[0].finish_reason == "length"
    bad = {"model": "tiny", "prompt": "x", "max_tokens": -1}
    direct = httpx.post(f"{upstreams[0].url}/v1/completions", json=bad)
    routed = httpx.post(f"{router.url}/v1/completions", json=bad)
    assert routed.status_code == direct.status_code == 400
    assert routed.json() == direct.json()
    with pytest.raises(openai.BadRequestError):
        router.openai().completions.create(model="tiny", prompt="x", max_tokens=-1)
    models = httpx.get(f"{router.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    generate = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    assert httpx.post(f"{router.url}/inference/v1/generate", json=generate).status_code == 200
    sglang = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(f"{router.url}/generate", json=sglang).status_code == 200
    assert httpx.get(f"{router.url}/health").status_code == 200


def test_pause_and_resume_move_every_upstream(stack) -> None:  # noqa: ANN001
    router, upstreams = stack

    def paused() -> list[bool]:
        return [httpx.get(f"{s.url}/is_paused").json()["is_paused"] for s in upstreams]

    assert paused() == [False, False]
    assert httpx.post(f"{router.url}/pause", params={"mode": "abort"}).status_code == 200
    assert paused() == [True, True]
    assert httpx.get(f"{router.url}/is_paused").json()["is_paused"] is True
    assert httpx.post(f"{router.url}/resume").status_code == 200
    assert paused() == [False, False]
    assert httpx.get(f"{router.url}/is_paused").json()["is_paused"] is False
    bad = httpx.post(f"{router.url}/pause", params={"mode": "nonsense"})
    assert bad.status_code == 400 and "upstream 0" in bad.json()["error"]["message"]
    assert paused() == [False, False]


def test_a_trainer_updates_every_upstream_through_the_router(stack, v2_trainer) -> None:  # noqa: ANN001
    router, upstreams = stack
    client = HTTPWeightSyncClient(router.url)
    assert client.get_world_size() == 2  # both upstreams' receiving workers
    info = GlooTrainerInitInfo(master_port=free_port(), world_size=3)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client, ModuleSource(v2_trainer))
    committed = trainer.send_weights("step-1", digest=True)
    infos = [httpx.get(f"{s.url}/weight_info").json() for s in upstreams]
    assert [i["weight_version"] for i in infos] == ["step-1", "step-1"]
    assert infos[0]["digest"] == infos[1]["digest"] == committed.digest is not None
    together = httpx.get(f"{router.url}/weight_info").json()
    assert (together["weight_version"], together["digest"]) == ("step-1", committed.digest)


def test_a_commit_that_one_upstream_refuses_is_aborted_on_all(stack) -> None:  # noqa: ANN001
    """Two-phase: upstream 1 loses its round (aborted behind the router's back), so its
    prepare fails; the router then aborts upstream 0's round too, and neither commits."""
    router, upstreams = stack
    labels = [httpx.get(f"{s.url}/weight_info").json()["weight_version"] for s in upstreams]
    assert httpx.post(f"{router.url}/start_weight_update", json={}).status_code == 200
    active = [httpx.get(f"{s.url}/weight_update_active").json() for s in upstreams]
    assert [a["weight_update_active"] for a in active] == [True, True]
    httpx.post(f"{upstreams[1].url}/finish_weight_update", json={"abort": True}).raise_for_status()
    r = httpx.post(f"{router.url}/finish_weight_update", json={"weight_version": "never"})
    assert r.status_code >= 400, r.text
    message = r.json()["error"]["message"]
    assert "prepare_weight_update" in message and upstreams[1].url in message, message
    active = [httpx.get(f"{s.url}/weight_update_active").json() for s in upstreams]
    assert [a["weight_update_active"] for a in active] == [False, False]
    after = [httpx.get(f"{s.url}/weight_info").json()["weight_version"] for s in upstreams]
    assert after == labels


def test_a_client_that_leaves_a_plain_request_aborts_it_upstream(stack) -> None:  # noqa: ANN001
    router, upstreams = stack
    before = aborted(upstreams[0])
    body = json.dumps({**LONG, "stream": False}).encode()
    url = httpx.URL(router.url)
    with socket.create_connection((url.host, url.port)) as client:  # a plain HTTP client
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: "
                       b"application/json\r\nX-data-parallel-rank: 0\r\nContent-Length: %d"
                       b"\r\n\r\n%s" % (len(body), body))  # fmt: skip
        wait_for(lambda: running(upstreams[0]) > 0)  # admitted upstream
    # the client gave up and closed its connection before the answer
    wait_for(lambda: in_flight(router) == [0, 0])
    wait_for(lambda: running(upstreams[0]) == 0)
    assert aborted(upstreams[0]) > before


def test_adapters_load_on_every_upstream_or_on_none(stack, v1_dir, tmp_path) -> None:  # noqa: ANN001
    from tests.helpers.tiny_models import write_peft_adapter

    router, upstreams = stack
    adapter = str(write_peft_adapter(v1_dir, tmp_path / "adapter"))

    def listed(name: str) -> list[bool]:
        return [name in {m["id"] for m in httpx.get(f"{s.url}/v1/models").json()["data"]}
                for s in upstreams]  # fmt: skip

    def load(url: str, name: str, path: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/load_lora_adapter",
                          json={"lora_name": name, "lora_path": path}, timeout=60)  # fmt: skip

    assert load(router.url, "a", adapter).status_code == 200
    assert listed("a") == [True, True]
    for _ in range(4):  # whichever upstream a request goes to has it
        reply = httpx.post(f"{router.url}/v1/completions", timeout=60,
                           json={"model": "a", "prompt": "hi", "max_tokens": 2})  # fmt: skip
        assert reply.status_code == 200, reply.text
    bad = load(router.url, "bad", str(tmp_path / "missing"))
    assert bad.status_code == 400 and listed("bad") == [False, False]
    # upstream 1 already holds "dup": it refuses; upstream 0 takes it, then gives it back
    assert load(upstreams[1].url, "dup", adapter).status_code == 200
    refused = load(router.url, "dup", adapter)
    assert refused.status_code == 400 and "upstream 1" in refused.json()["error"]["message"]
    assert listed("dup") == [False, True]
    httpx.post(f"{upstreams[1].url}/v1/unload_lora_adapter", json={"lora_name": "dup"})
    gone = httpx.post(f"{router.url}/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert gone.status_code == 200 and listed("a") == [False, False]


def test_collective_rpc_reaches_every_upstream(stack) -> None:  # noqa: ANN001
    router, _ = stack
    reply = httpx.post(f"{router.url}/collective_rpc", json={"method": "rank_and_device"})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["results"]) == 2  # one rank on each of the two upstreams
    bad = httpx.post(f"{router.url}/collective_rpc", json={"method": "no_such_method"})
    assert bad.status_code == 400 and "upstream 0" in bad.json()["error"]["message"]
