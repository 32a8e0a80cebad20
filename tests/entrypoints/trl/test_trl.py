"""TRL's `trl vllm-serve` dialect against a real `hotswap serve`: the calls TRL's
`VLLMClient` makes (trl/generation/vllm_client.py), with the bodies it sends, the trainer
joining the weight group as its last rank (gloo here: TRL's PyNccl is CUDA-only)."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys

import httpx
import pytest
import torch
import torch.distributed as dist
from fastapi.testclient import TestClient

from hotswap import LLM, SamplingParams
from hotswap.entrypoints.server.app import build_app
from hotswap.entrypoints.server.state import ServerConfig
from hotswap.tokenizer import Tokenizer
from hotswap.weight_transfer.trl_client import TRLClient
from tests.helpers.server import RemoteServer
from tests.helpers.waiting import wait_until
from tests.weight_transfer.conftest import free_port, trainer_model

ARGS = ("--served-model-name", "tiny", "--dtype", "float32", "--enable-control",
        "--weight-transfer-config", '{"backend": "gloo"}')  # fmt: skip
PROMPT = "The quick brown"
ROUND_CLOSED = 'hotswap:weight_round_open{model_name="tiny"} 0.0'


def generate_body(prompts: list, /, **overrides: object) -> dict:
    """What VLLMClient.generate posts (its defaults), greedy and short here."""
    body = {"prompts": prompts, "images": None, "n": 1, "repetition_penalty": 1.0,
            "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 8,
            "logprobs": 0, "structured_outputs_regex": None, "generation_kwargs": {}}  # fmt: skip
    return {**body, **overrides}


@pytest.fixture(scope="module")
def server(v1_dir):
    with RemoteServer(v1_dir, *ARGS) as srv:
        yield srv


@pytest.fixture
def http(server):
    # httpx follows no redirect unless asked: a 307 would show as a 307.
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def join_as_last_rank(port: int, world_size: int) -> dist.ProcessGroup:
    """The trainer's side of TRL's layout: the server's first worker hosts the store at
    the address the trainer reached it on; the trainer is rank world_size - 1."""
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    return dist.ProcessGroupGloo(store, world_size - 1, world_size, timeout)


def weight_info(http: httpx.Client) -> dict:
    return http.get("/weight_info").json()


def round_closed(http: httpx.Client) -> bool:
    return ROUND_CLOSED in http.get("/metrics").text


@pytest.mark.slow
def test_trl_sequence_then_helper_round_trip(server, http, v1_dir, v2_dir) -> None:
    v1_trainer, v2_trainer = trainer_model(v1_dir), trainer_model(v2_dir)
    reference = LLM(str(v2_dir), dtype="float32", progress=False)
    expected_digest = reference.get_weight_info()["digest"]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    expected = reference.generate(PROMPT, greedy, use_tqdm=False)[0]
    del reference

    # VLLMClient.check_server, then a generation on the weights the server started with.
    r = http.get("/health/")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    before = http.post("/generate/", json=generate_body([PROMPT])).json()
    assert before["prompt_ids"] == [expected.prompt_token_ids]
    (tokens,) = before["completion_ids"]
    assert 0 < len(tokens) <= 8 and before["logprob_token_ids"] == [[[t] for t in tokens]]
    assert [len(lp) for lp in before["logprobs"][0]] == [1] * len(tokens)
    start = weight_info(http)

    # VLLMClient.init_communicator: the world size, the init (answered at once), the join.
    assert http.get("/get_world_size/").json() == {"world_size": 1}
    port = free_port()
    init = {"host": "0.0.0.0", "port": port, "world_size": 2, "client_device_uuid": "GPU-x"}
    r = http.post("/init_communicator/", json=init)
    assert r.json() == {"message": "Request received, initializing communicator"}
    group = join_as_last_rank(port, 2)

    # VLLMClient.update_model_params: announce each parameter, then broadcast it (src=1).
    params = list(v2_trainer.named_parameters())
    for name, param in params:
        body = {"name": name, "dtype": str(param.dtype), "shape": list(param.shape)}
        r = http.post("/update_named_param/", json=body)
        assert r.json() == {"message": "Request received, updating named parameter"}, r.text
        group.broadcast(param.data, 1).wait()
    r = http.post("/reset_prefix_cache/")
    assert r.json() == {"message": "Request received, resetting prefix cache status: True"}
    r = http.post("/close_communicator/")
    assert r.json() == {"message": "Request received, closing communicator"}
    del group

    # One committed version per parameter, the label kept; the trainer's weights served.
    info = weight_info(http)
    assert info["digest"] == expected_digest != start["digest"]
    assert info["version"] == start["version"] + len(params)
    assert info["weight_version"] == start["weight_version"]
    after = http.post("/generate/", json=generate_body([PROMPT])).json()
    assert after["completion_ids"] == [expected.outputs[0].token_ids] != before["completion_ids"]
    assert round_closed(http)

    # The drop-in client (gloo, trainer last), on the same port (closing freed it): back to V1.
    client = TRLClient(base_url=server.url, group_port=port)
    client.init_communicator("cpu")
    client.update_model_params(v1_trainer)
    client.reset_prefix_cache()
    client.close_communicator()
    assert weight_info(http)["digest"] == start["digest"]
    out = client.generate([PROMPT], temperature=0.0, max_tokens=8)
    assert out == before
    # Closed: no parameter is taken until the next init.
    norm = {"name": "model.norm.weight", "dtype": "torch.float32", "shape": [64]}
    r = http.post("/update_named_param/", json=norm)
    assert r.status_code == 409 and "/init_communicator/" in r.json()["error"]["message"]


@pytest.mark.slow
def test_refusals_name_the_field_and_change_nothing(server, http, v1_dir) -> None:
    norm = trainer_model(v1_dir).model.norm.weight.detach()
    start = weight_info(http)

    def refused(path: str, body: dict, param: str, status: int = 400) -> None:
        r = http.post(path, json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param, r.text

    init = {"host": "0.0.0.0", "port": free_port(), "world_size": 2, "client_device_uuid": ""}
    refused("/init_communicator/", {**init, "world_size": 3}, "body.world_size")
    refused("/init_communicator/", {**init, "port": 0}, "body.port")
    refused("/init_communicator/", {k: v for k, v in init.items() if k != "host"}, "body.host")
    good = {"name": "model.norm.weight", "dtype": "torch.float32", "shape": [64]}
    refused("/update_named_param/", good, None, status=409)  # no communicator yet

    http.post("/init_communicator/", json=init).raise_for_status()
    group = join_as_last_rank(init["port"], 2)
    for body, param in [
        ({**good, "dtype": "torch.float99"}, "body.dtype"),
        ({**good, "dtype": "torch.int64"}, "body.dtype"),  # a float parameter
        ({**good, "shape": [-1]}, "body.shape"),
        ({**good, "shape": [65]}, "body.shape"),
        ({**good, "shape": "64"}, "body.shape"),
        ({**good, "name": "model.bogus.weight"}, "body.name"),
        ({**good, "name": ""}, "body.name"),
        ({k: v for k, v in good.items() if k != "name"}, "body.name"),
    ]:
        refused("/update_named_param/", body, param)
        assert round_closed(http)
    assert weight_info(http) == start
    # The group is still in step: a good parameter goes through (the same values).
    http.post("/update_named_param/", json=good).raise_for_status()
    group.broadcast(norm, 1).wait()
    http.post("/reset_prefix_cache/").raise_for_status()
    info = weight_info(http)
    assert (info["digest"], info["version"]) == (start["digest"], start["version"] + 1)
    http.post("/close_communicator/").raise_for_status()
    del group

    # Generation: what hotswap cannot honour is refused, never ignored.
    for overrides, param in [
        ({"images": [["aGk="]]}, "body.images[0]"),
        ({"structured_outputs_regex": "a+"}, "body.structured_outputs_regex"),
        ({"generation_kwargs": {"bogus": 1}}, "body.generation_kwargs.bogus"),
        ({"generation_kwargs": {"logits_processors": ["x"]}},
         "body.generation_kwargs.logits_processors"),
        ({"generation_kwargs": {"seed": "x"}}, "body.generation_kwargs.seed"),
        ({"generation_kwargs": {"stop": 5}}, "body.generation_kwargs.stop"),
        ({"generation_kwargs": {"n": 10**6}}, "body.generation_kwargs.n"),
        ({"n": 10**6}, "body.n"),
        ({"temperature": -1.0}, "body.temperature"),
        ({"logprobs": 50}, "body.logprobs"),
        ({"prompts": [[1, 2], "text"]}, "body.prompts"),
        ({"prompts": [[10**9]]}, "body.prompts[0]"),
        ({"max_tokens": 10**6}, "body.max_tokens"),
    ]:  # fmt: skip
        r = http.post("/generate/", json=generate_body([PROMPT], **overrides))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].startswith(param), r.text


@pytest.mark.slow
def test_close_ends_an_init_still_waiting_for_the_trainer(server, http) -> None:
    """/close_communicator/ while the engine, hosting the group's store (TRL's layout),
    still waits for a trainer that never joined: answered at once, and the wait ends
    within moments, not at the join's timeout (120 s): a new init on the same port (the
    cancelled store freed it) is accepted and its group forms."""
    init = {"host": "0.0.0.0", "port": free_port(), "world_size": 2, "client_device_uuid": ""}
    http.post("/init_communicator/", json=init).raise_for_status()
    r = http.post("/close_communicator/")
    assert r.json() == {"message": "Request received, closing communicator"}, r.text
    answers: list[httpx.Response] = []

    def init_taken() -> bool:  # refused (409 "being cancelled") until the engine's wait ends
        answers.append(http.post("/init_communicator/", json=init))
        return "being cancelled" not in answers[-1].text

    wait_until(init_taken, "the cancelled wait ended", timeout_s=10)
    r = answers[-1]
    assert r.json() == {"message": "Request received, initializing communicator"}, r.text
    group = join_as_last_rank(init["port"], 2)
    http.post("/close_communicator/").raise_for_status()
    del group
    assert round_closed(http)


@pytest.mark.slow
def test_generate_and_chat_shapes(server, http, v1_dir) -> None:
    # Token id prompts come back as sent; n samples per prompt, prompt by prompt.
    ids = [[5, 6, 7], [8, 9]]
    body = generate_body(ids, n=2, temperature=1.0, logprobs=2,
                         generation_kwargs={"seed": 3, "ignore_eos": True})  # fmt: skip
    out = http.post("/generate/", json=body).json()
    assert out["prompt_ids"] == ids and len(out["completion_ids"]) == 4
    for comp, values, tokens in zip(out["completion_ids"], out["logprobs"],
                                    out["logprob_token_ids"]):  # fmt: skip
        assert len(comp) == 8 and len(values) == len(tokens) == 8
        for token, vals, toks in zip(comp, values, tokens):
            assert token in toks and len(toks) in (2, 3) and vals == sorted(vals, reverse=True)
    out = http.post("/generate/", json=generate_body([PROMPT], logprobs=None)).json()
    assert out["logprobs"] is None and out["logprob_token_ids"] is None
    assert http.post("/generate/", json=generate_body([])).json() == {
        "prompt_ids": [], "completion_ids": [], "logprobs": [], "logprob_token_ids": []
    }  # fmt: skip

    # /chat/: the chat template with a generation prompt, no special tokens added.
    messages = [[{"role": "user", "content": "Hello"}],
                [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]]  # fmt: skip
    body = {**generate_body([]), "messages": messages, "chat_template_kwargs": {}, "tools": None}
    del body["prompts"], body["images"]
    out = http.post("/chat/", json=body).json()
    assert "prompt_ids" in out, out
    tokenizer = Tokenizer.from_pretrained(v1_dir)
    rendered = tokenizer.apply_chat_template(messages[0], tokenize=True)
    assert out["prompt_ids"][0] == rendered and len(out["completion_ids"]) == 2
    image = [[{"role": "user", "content": [{"type": "image_pil", "image_pil": "x"}]}]]
    r = http.post("/chat/", json={**body, "messages": image})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "body.messages[0][0].content[0]"


@pytest.mark.slow
def test_trailing_slash_routes_answer_without_redirect(http) -> None:
    for method, path in [("GET", "/health/"), ("GET", "/get_world_size/")]:
        r = http.request(method, path)
        assert r.status_code == 200 and "location" not in r.headers, (path, r.status_code)
    r = http.post("/generate/", json=generate_body([PROMPT], max_tokens=1))
    assert r.status_code == 200 and json.loads(r.text)["completion_ids"]


def test_weight_routes_need_the_control_plane() -> None:
    app = build_app(None, ServerConfig(served_model_name="tiny"))  # type: ignore[arg-type]
    client = TestClient(app)
    for method, path in [("GET", "/get_world_size/"), ("POST", "/init_communicator/"),
                         ("POST", "/update_named_param/"), ("POST", "/reset_prefix_cache/"),
                         ("POST", "/close_communicator/")]:  # fmt: skip
        assert client.request(method, path, json={}).status_code == 404, path
    # The data routes are there (refused for their body, before any engine call).
    r = client.post("/generate/", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.prompts"
    r = client.post("/chat/", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.messages"


DYING_TRAINER = """
import datetime, os, sys
import httpx, torch.distributed as dist
url, port = sys.argv[1], int(sys.argv[2])
http = httpx.Client(base_url=url, timeout=60)
init = {"host": "0.0.0.0", "port": port, "world_size": 2, "client_device_uuid": ""}
http.post("/init_communicator/", json=init).raise_for_status()
timeout = datetime.timedelta(seconds=60)
store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
group = dist.ProcessGroupGloo(store, 1, 2, timeout)
body = {"name": "model.norm.weight", "dtype": "torch.float32", "shape": [64]}
print("announced", http.post("/update_named_param/", json=body).status_code, flush=True)
os._exit(1)  # dies before broadcasting
"""


@pytest.mark.slow
def test_failure_behind_an_answer_is_the_next_calls_answer(server, http, v1_dir) -> None:
    start = weight_info(http)
    port = free_port()
    result = subprocess.run([sys.executable, "-c", DYING_TRAINER, server.url, str(port)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "announced 200" in result.stdout, result.stderr
    # The receive failed behind the answer: the next call says so (409: TRL's client would
    # retry a 5xx into a success), the round was aborted, the weights are the old ones.
    r = http.post("/reset_prefix_cache/")
    assert r.status_code == 409, r.text
    assert "'model.norm.weight' failed after it was answered" in r.json()["error"]["message"]
    assert weight_info(http) == start and round_closed(http)
    r = http.post("/reset_prefix_cache/")  # reported once
    assert r.status_code == 200
    # The channel is gone: a new init (same port) and a good sync go through.
    client = TRLClient(base_url=server.url, group_port=port)
    client.init_communicator("cpu")
    client.update_model_params(trainer_model(v1_dir))
    client.close_communicator()
    assert weight_info(http)["digest"] == start["digest"]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"trainer_rank": 2}, "init_info.trainer_rank"),  # outside world_size 2
        ({"trainer_rank": 1, "rank_offset": 1}, "init_info.rank_offset"),  # the trainer's
        ({"trainer_rank": 0, "rank_offset": 0}, "init_info.rank_offset"),  # rank 0 is it
    ],
)
def test_broadcast_layout_refusals(extra: dict, field: str) -> None:
    from hotswap.errors import InvalidArgument
    from hotswap.weight_transfer.broadcast import GlooEngine

    info = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2}
    with pytest.raises(InvalidArgument) as refused:
        GlooEngine(torch.device("cpu")).init_transfer_engine({**info, **extra})
    assert refused.value.field == field
