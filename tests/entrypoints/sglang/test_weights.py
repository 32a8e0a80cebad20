"""SGLang's weight-sync routes end to end: slime's update sequence against a real
`hotswap serve`, with this test process as the trainer making its group the way SGLang,
slime and AReaL do (torch's process-group helpers under a group name) and broadcasting one
tensor at a time; refused payloads; /abort_request and /v1/loads."""

from __future__ import annotations

import base64
import datetime
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed import distributed_c10d as c10d

from hotswap import LLM, SamplingParams
from hotswap.errors import InvalidArgument
from hotswap.weight_transfer.base import ParamMeta
from hotswap.weight_transfer.broadcast import BroadcastChannel, BroadcastEngine, join_group
from tests.helpers.server import RemoteServer
from tests.weight_transfer.conftest import free_port

PROMPT = "Weights move from the trainer to the engine while"
NEW_TOKENS = 12
ROUND_CLOSED = 'hotswap:weight_round_open{model_name="tiny"} 0.0'


# -- the trainer's side, as SGLang-based frameworks build it ------------------------------
def torch_helper_group(port: int, world_size: int, name: str) -> dist.ProcessGroup:
    """Rank 0 of a gloo group made like SGLang's `init_custom_process_group` (slime's
    `init_process_group`, AReaL's copy): a tcp:// rendezvous, its store prefixed with the
    group name, then torch's own `_new_process_group_helper`. Blocks until all ranks join."""
    timeout = datetime.timedelta(seconds=60)
    url = f"tcp://127.0.0.1:{port}"
    store, rank, size = next(c10d.rendezvous(url, 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        size, rank, [], c10d.Backend("gloo"), c10d.PrefixStore(name, store),
        group_name=name, backend_options=None, timeout=timeout,
    )  # fmt: skip
    c10d._world.pg_group_ranks[group] = {i: i for i in range(size)}
    return group


def broadcast_all(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """slime's data plane: every tensor posted as its own broadcast from rank 0, then all
    waited for."""
    works = [dist.broadcast(t, 0, group=group, async_op=True) for t in tensors]
    for work in works:
        work.wait()


def alongside(request: Callable[[], httpx.Response], trainer: Callable[[], object]):  # noqa: ANN201
    """(the HTTP answer, the trainer's result): the call is in flight while the trainer
    acts, as slime's Ray calls are."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(request)
        result = trainer()
        return future.result(timeout=120), result


# -- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v2_tensors(v2_dir: Path) -> dict[str, torch.Tensor]:
    """The trainer's weights, under checkpoint names (what slime's HF conversion sends)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(v2_dir, dtype=torch.float32)
    return {name: p.detach().contiguous() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference(v2_dir: Path) -> LLM:
    """A fresh engine on the trainer's weights."""
    return LLM(str(v2_dir), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def server(v1_dir: Path) -> Iterator[RemoteServer]:
    args = ("--served-model-name", "tiny", "--dtype", "float32", "--enable-control",
            "--weight-transfer-config", '{"backend": "gloo"}', "--max-model-len", "512",
            "--num-kv-blocks", "128", "--log-level", "warning")  # fmt: skip
    with RemoteServer(v1_dir, *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with server.client(timeout=120) as client:
        yield client


def greedy(http: httpx.Client, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "ignore_eos": True,
                                                  "max_new_tokens": NEW_TOKENS}}  # fmt: skip
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


def weights(http: httpx.Client) -> dict:
    return http.get("/weight_info").json()


def round_closed(http: httpx.Client) -> bool:
    return ROUND_CLOSED in http.get("/metrics").text


def init_payload(port: int, name: str, **extra: object) -> dict:
    return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": name, "backend": "gloo", **extra}  # fmt: skip


def join(http: httpx.Client, name: str, **extra: object) -> dist.ProcessGroup:
    port = free_port()
    response, group = alongside(
        lambda: http.post("/init_weights_update_group", json=init_payload(port, name, **extra)),
        lambda: torch_helper_group(port, 2, name),
    )
    assert response.status_code == 200, response.text
    assert response.json() == {
        "success": True,
        "message": "Succeeded to initialize custom process group.",
    }
    return group


def update_payload(tensors: dict[str, torch.Tensor], name: str, **extra: object) -> dict:
    """As slime's SGLangEngine.update_weights_from_distributed builds it."""
    return {
        "names": list(tensors),
        "dtypes": [str(t.dtype).replace("torch.", "") for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "group_name": name,
        **extra,
    }


def send(
    http: httpx.Client, group: dist.ProcessGroup, payload: dict, tensors: list[torch.Tensor]
) -> httpx.Response:
    response, _ = alongside(
        lambda: http.post("/update_weights_from_distributed", json=payload),
        lambda: broadcast_all(group, tensors),
    )
    return response


# -- the group itself ---------------------------------------------------------------------
def test_torch_helper_group_meets_a_named_join() -> None:
    """The trainer's group (torch's helpers) and the engine's (join_group with the name)
    are one group; a typed channel receives each tensor in its own dtype, empty ones too."""
    port, name = free_port(), "compat-check"
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(join_group, "127.0.0.1", port, 1, 2, torch.device("cpu"), 60.0,
                              None, name)  # fmt: skip
        trainer = torch_helper_group(port, 2, name)
        engine_group = joining.result(timeout=60)
        channel = BroadcastChannel(engine_group, torch.device("cpu"), False, 1, 1, typed=True)
        sent = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.zeros(0, 4),
                torch.tensor([1.5, -2.25], dtype=torch.bfloat16), torch.tensor([7, -8]),
                torch.tensor(3.0)]  # fmt: skip
        metas = [ParamMeta.of(f"t{i}", t) for i, t in enumerate(sent)]
        received = pool.submit(
            channel.receive, metas, lambda m: torch.empty(m.shape, dtype=m.dtype)
        )
        broadcast_all(trainer, sent)
        got = received.result(timeout=60)
    assert [name for name, _ in got] == [m.name for m in metas]
    for (_, tensor), expected in zip(got, sent):
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected)
    channel.close()
    dist.destroy_process_group(trainer)


def test_a_named_group_is_unpacked() -> None:
    engine = BroadcastEngine(torch.device("cpu"))
    info = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2,
            "group_name": "g", "packed": True}  # fmt: skip
    with pytest.raises(InvalidArgument) as refused:
        engine.init_transfer_engine(info)
    assert refused.value.field == "init_info.packed"
    with pytest.raises(InvalidArgument) as refused:
        engine.init_transfer_engine({**info, "packed": False, "group_name": ""})
    assert refused.value.field == "init_info.group_name"


# -- slime's sequence ---------------------------------------------------------------------
@pytest.mark.slow
def test_slime_update_sequence(http, reference, v2_tensors) -> None:
    ids = reference.tokenizer.encode(PROMPT)
    before_tokens, before = greedy(http, ids), weights(http)
    assert http.post("/pause_generation", json={}).json() == {"status": "paused"}
    assert http.get("/flush_cache").status_code == 200
    name = "slime-pp_0"
    group = join(http, name)
    try:
        # Two buckets, one weight version: slime's update_weight_buffer_size at work.
        items = list(v2_tensors.items())
        buckets = [dict(items[: len(items) // 2]), dict(items[len(items) // 2 :])]
        for bucket in buckets:
            payload = update_payload(bucket, name, flush_cache=False, weight_version="1")
            response = send(http, group, payload, list(bucket.values()))
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["success"] is True and body["weight_version"] == "1"
            assert body["message"].endswith("Weight version updated to 1.")
    finally:
        dist.destroy_process_group(group)
    assert http.post("/continue_generation", json={}).json() == {"status": "resumed"}
    after = weights(http)
    assert after["digest"] == reference.get_weight_info()["digest"] != before["digest"]
    assert after["weight_version"] == "1" and after["version"] == before["version"] + 2
    assert http.get("/get_weight_version").json() == {"weight_version": "1"}
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = reference.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    assert greedy(http, ids) == list(expected) != before_tokens
    assert round_closed(http)


# -- refusals -----------------------------------------------------------------------------
def refused(response: httpx.Response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


@pytest.mark.slow
def test_bad_payloads_change_nothing(http, v2_tensors) -> None:
    before = weights(http)
    post = http.post

    # Init: the group's backend must be the engine's; fields in SGLang's names.
    message = refused(post("/init_weights_update_group", json=init_payload(1, "g",
                                                                           backend="nccl")),
                      400, "body.backend")  # fmt: skip
    assert "gloo" in message
    refused(post("/init_weights_update_group", json=init_payload("abc", "g")), 400,
            "body.master_port")  # fmt: skip
    refused(post("/init_weights_update_group", json=init_payload(1, "g", rank_offset=0)), 400,
            "body.rank_offset")  # fmt: skip

    name = "checks-a"
    group = join(http, name)
    norm = {"model.norm.weight": v2_tensors["model.norm.weight"]}
    try:
        # Refused before anything reaches the engine.
        response = post("/update_weights_from_distributed", json=update_payload(norm, "other"))
        refused(response, 400, "body.group_name")
        payload = update_payload(norm, name, load_format="flattened_bucket")
        refused(post("/update_weights_from_distributed", json=payload), 400, "body.load_format")
        payload = update_payload(norm, name, flush_cache="yes")
        refused(post("/update_weights_from_distributed", json=payload), 400, "body.flush_cache")
        # A tensor the model cannot take: drained, refused, the group stays in step.
        wrong = {"model.norm.weight": torch.ones(7)}
        response = send(http, group, update_payload(wrong, name), [torch.ones(7)])
        message = refused(response, 400, "body.shapes[0]")
        assert "shape mismatch" in message and "left" not in message
        # A bad weight_version is refused at the commit, after the receive.
        response = send(http, group, update_payload(norm, name, weight_version=5),
                        list(norm.values()))  # fmt: skip
        refused(response, 400, "body.weight_version")
        assert weights(http) == before and round_closed(http)
        # Lengths that differ: the update cannot be sized, so the group is left.
        payload = {**update_payload(norm, name), "dtypes": []}
        message = refused(post("/update_weights_from_distributed", json=payload), 400,
                          "body.dtypes")  # fmt: skip
        assert "differ in length" in message and "init_weights_update_group" in message
        assert weights(http) == before and round_closed(http)
        response = post("/update_weights_from_distributed", json=update_payload(norm, name))
        assert response.status_code == 409, response.text
        assert "init_weights_update_group" in response.json()["error"]["message"]
    finally:
        dist.destroy_process_group(group)

    name = "checks-b"
    group = join(http, name)
    try:
        # FP8 codes (a trainer's own quantization) into a weight that is not FP8 here:
        # drained (float8 travels as its bytes), refused naming the dtype
        codes = v2_tensors["model.norm.weight"].to(torch.float8_e4m3fn)
        payload = {**update_payload(norm, name), "dtypes": ["float8_e4m3fn"]}
        response = send(http, group, payload, [codes.view(torch.uint8)])
        assert "not an FP8 weight" in refused(response, 400, "body.dtypes[0]")
        payload = {**update_payload(norm, name), "dtypes": ["float4"]}
        message = refused(post("/update_weights_from_distributed", json=payload), 400,
                          "body.dtypes[0]")  # fmt: skip
        assert "unknown dtype" in message
    finally:
        dist.destroy_process_group(group)
    assert weights(http) == before and round_closed(http)

    # The pickled form is refused unread; a group left on request takes no more updates.
    payload = {"serialized_named_tensors": ["gASVAAAAAAAAAAB9lC4="], "flush_cache": True}
    message = refused(post("/update_weights_from_tensor", json=payload), 400,
                      "body.serialized_named_tensors")  # fmt: skip
    assert "never unpickles" in message
    response = post("/destroy_weights_update_group", json={"group_name": name})
    assert response.status_code == 200 and response.json()["success"] is True
    response = post("/update_weights_from_distributed", json=update_payload(norm, name))
    assert response.status_code in (400, 409), response.text
    assert weights(http) == before and round_closed(http)


@pytest.mark.slow
def test_a_good_update_after_a_drained_one(http, v2_tensors) -> None:
    """The same group carries a good update after one the model could not take."""
    name = "drained"
    group = join(http, name)
    try:
        wrong = {"model.layers.0.input_layernorm.weight": torch.ones(3, 3)}
        response = send(http, group, update_payload(wrong, name), [torch.ones(3, 3)])
        refused(response, 400, "body.shapes[0]")
        before = weights(http)
        norm = {"model.norm.weight": v2_tensors["model.norm.weight"] + 1.0}
        response = send(http, group, update_payload(norm, name, weight_version="norm"),
                        list(norm.values()))  # fmt: skip
        assert response.status_code == 200, response.text
        after = weights(http)
        assert after["version"] == before["version"] + 1 and after["digest"] != before["digest"]
        assert after["weight_version"] == "norm"
    finally:
        dist.destroy_process_group(group)


# -- tensors by value: /update_weights_from_tensor's JSON-safe form ----------------------
# Two of the trainer's tensors as sent (float32), one sent as bfloat16 (the engine keeps
# its own float32: the value is the bfloat16 one).
INLINE = {
    "model.norm.weight": torch.float32,
    "model.layers.0.self_attn.q_proj.weight": torch.float32,  # a shard of a fused weight
    "model.layers.1.input_layernorm.weight": torch.bfloat16,
}


def by_value(name: str, tensor: torch.Tensor) -> dict:
    """One entry of named_tensors, as a client builds it: raw little-endian bytes in C
    order, base64."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape), "data": base64.b64encode(raw).decode()}  # fmt: skip


@pytest.fixture(scope="module")
def inline_sent(v2_tensors) -> dict[str, torch.Tensor]:
    return {name: v2_tensors[name].to(dtype) for name, dtype in INLINE.items()}


@pytest.fixture(scope="module")
def patched(v1_dir: Path, inline_sent, tmp_path_factory) -> LLM:
    """A fresh engine on the first checkpoint with the tensors sent replaced in it."""
    directory = tmp_path_factory.mktemp("patched")
    for file in v1_dir.iterdir():
        if file.is_file():
            shutil.copy(file, directory / file.name)
    for file in directory.glob("*.safetensors"):
        weights = load_file(file)
        for name, tensor in inline_sent.items():
            if name in weights:
                weights[name] = tensor.to(weights[name].dtype)
        save_file(weights, file, metadata={"format": "pt"})
    return LLM(str(directory), dtype="float32", progress=False)


@pytest.mark.slow
def test_tensors_by_value(http, v1_dir, reference, patched, inline_sent) -> None:
    response = http.post("/update_weights_from_disk", json={"model_path": str(v1_dir)})
    assert response.status_code == 200, response.text
    ids = reference.tokenizer.encode(PROMPT)
    before = weights(http)
    payload = {"named_tensors": [by_value(n, t) for n, t in inline_sent.items()],
               "weight_version": "inline-1", "flush_cache": True, "load_format": None,
               "abort_all_requests": False}  # fmt: skip
    response = http.post("/update_weights_from_tensor", json=payload)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["success"] is True and body["weight_version"] == "inline-1"
    assert body["message"].endswith("Weight version updated to inline-1.")
    after = weights(http)
    assert after["version"] == body["version"] == before["version"] + 1
    assert after["weight_version"] == "inline-1"
    assert http.get("/get_weight_version").json() == {"weight_version": "inline-1"}
    # Exactly the checkpoint with those tensors replaced, the rest untouched.
    assert after["digest"] == patched.get_weight_info()["digest"] != before["digest"]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = patched.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    assert greedy(http, ids) == list(expected)
    assert round_closed(http)
    # The same tensors through the Python API: the weights already hold them.
    loaded = patched.load_weights_inline(inline_sent, weight_version="again")
    assert loaded["label"] == "again"
    assert patched.get_weight_info()["digest"] == after["digest"]
    # No weight_version: a new version under the current label.
    response = http.post("/update_weights_from_tensor", json={"named_tensors": payload[
        "named_tensors"][:1], "flush_cache": False})  # fmt: skip
    assert response.status_code == 200, response.text
    assert response.json()["weight_version"] == "inline-1"
    assert weights(http)["version"] == after["version"] + 1


@pytest.mark.slow
def test_bad_tensors_by_value_change_nothing(http, inline_sent) -> None:
    before = weights(http)
    good = by_value("model.norm.weight", inline_sent["model.norm.weight"])
    # A second weight of the norm's shape: each case spoils one thing of it.
    name = "model.layers.0.input_layernorm.weight"
    other = {**good, "name": name}
    meta = {k: other[k] for k in ("name", "dtype", "shape")}
    bad_entries = [
        ({**other, "data": "not base64!"}, "body.named_tensors[1].data", "base64"),
        ({**other, "data": base64.b64encode(bytes(4)).decode()}, "body.named_tensors[1].data",
         "4 bytes"),
        ({**other, "dtype": "float8_e4m3fn", "data": base64.b64encode(bytes(64)).decode()},
         "body.named_tensors[1].dtype", "not an FP8 weight"),
        ({**other, "dtype": "float4"}, "body.named_tensors[1].dtype", "bfloat16"),
        ({**other, "name": "model.no_such.weight"}, "body.named_tensors[1].name", "unknown"),
        ({**meta, "shape": [3], "data": base64.b64encode(bytes(12)).decode()},
         "body.named_tensors[1].shape", "shape mismatch"),
        (by_value(name, torch.zeros(other["shape"], dtype=torch.int32)),
         "body.named_tensors[1].dtype", "dtype mismatch"),
        (meta, "body.named_tensors[1].data", "required"),
        ({**other, "shape": [-1]}, "body.named_tensors[1].shape", "sizes"),
        ({**other, "name": "model.layers.0.self_attn.q_proj.weight"},
         "body.named_tensors[1].shape", "shape mismatch"),
    ]  # fmt: skip
    for entry, param, words in bad_entries:
        payload = {"named_tensors": [good, entry], "weight_version": "bad"}
        message = refused(http.post("/update_weights_from_tensor", json=payload), 400, param)
        assert message.startswith(param.removeprefix("body.")) and words in message, message
        assert weights(http) == before
    duplicate = {"named_tensors": [good, good]}
    message = refused(http.post("/update_weights_from_tensor", json=duplicate), 400,
                      "body.named_tensors[1].name")  # fmt: skip
    assert "appears twice" in message
    for payload, param in [
        ({}, "body.named_tensors"),
        ({"named_tensors": []}, "body.named_tensors"),
        ({"named_tensors": [good], "load_format": "flattened_bucket"}, "body.load_format"),
        ({"named_tensors": [good], "weight_version": 5}, "body.weight_version"),
        ({"named_tensors": [good], "flush_cache": "yes"}, "body.flush_cache"),
        # The pickled form is refused unread, also beside tensors by value.
        ({"named_tensors": [good], "serialized_named_tensors": ["gASVAAAAAAAAAAB9lC4="]},
         "body.serialized_named_tensors"),
    ]:  # fmt: skip
        refused(http.post("/update_weights_from_tensor", json=payload), 400, param)
    assert weights(http) == before and round_closed(http)


# -- aborts and loads ---------------------------------------------------------------------
def long_generate(http: httpx.Client, rid: str, ids: list[int]) -> dict:
    body = {"input_ids": ids, "rid": rid, "sampling_params": {"temperature": 0,
            "ignore_eos": True, "max_new_tokens": 400}}  # fmt: skip
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def wait_running(http: httpx.Client, count: int) -> dict:
    deadline = time.monotonic() + 60
    while True:
        loads = http.get("/v1/loads").json()
        if loads["loads"][0]["num_running_reqs"] >= count:
            return loads
        assert time.monotonic() < deadline, loads
        time.sleep(0.05)


@pytest.mark.slow
def test_abort_request_and_loads(http, reference) -> None:
    ids = reference.tokenizer.encode(PROMPT)
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(long_generate, http, "long-1", ids)
        loads = wait_running(http, 1)
        load = loads["loads"][0]
        assert loads["dp_rank_count"] == 1 and loads["aggregate"]["total_running_reqs"] >= 1
        assert load["num_used_tokens"] > 0 and 0 < load["token_usage"] <= 1
        assert load["max_total_num_tokens"] == 128 * 16
        unknown = http.post("/abort_request", json={"rid": "no-such-request"})
        assert unknown.status_code == 200 and unknown.content == b""
        assert http.post("/abort_request", json={"rid": "long-1"}).status_code == 200
        out = running.result(timeout=60)
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(out["output_ids"]) < 400

        both = [pool.submit(long_generate, http, f"all-{i}", ids) for i in range(2)]
        wait_running(http, 2)
        assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
        for future in both:
            assert future.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
    text = http.get("/v1/loads", params={"format": "prometheus"}).text
    assert 'sglang_num_running_reqs{dp_rank="0"} 0' in text
    refused(http.get("/v1/loads", params={"include": "core,nope"}), 400, "query.include")
    assert http.get("/v1/loads", params={"dp_rank": 3}).json()["loads"] == []
