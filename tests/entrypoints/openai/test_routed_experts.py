"""Routing replay over HTTP, as vLLM serves it: `--enable-return-routed-experts`, the
request's `routed_experts_prompt_start`, and each choice's `routed_experts` (base64 of a
`.npy` array [positions, sparse layers, top_k]) on /v1/completions, /v1/chat/completions
and /inference/v1/generate, read with the real openai client and checked against the
top-k of transformers' router."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.execution.test_routed_experts import reference_experts
from tests.helpers.server import RemoteServer

# One server for the module: slow.
pytestmark = pytest.mark.slow

MODEL = "moe"
GREEDY = {"temperature": 0.0, "max_tokens": 5}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


def decode(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen3_moe")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[RemoteServer]:
    args = ("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "512",
            "--enable-return-routed-experts", "--log-level", "warning")  # fmt: skip
    with RemoteServer(model_dir, *args) as remote:
        yield remote


def test_completions_return_the_experts_from_the_prompt_start(server, model_dir) -> None:
    client = server.openai()
    out = client.completions.create(
        model=MODEL, prompt="The quick brown fox", **GREEDY,
        extra_body={**EXTRA, "routed_experts_prompt_start": 3},
    )  # fmt: skip
    choice = out.choices[0]
    fed = choice.prompt_token_ids + choice.token_ids[:-1]
    rows = decode(choice.routed_experts)
    assert rows.dtype == np.uint8 and rows.shape == (len(fed) - 3, 3, 2)  # every layer
    np.testing.assert_array_equal(rows, reference_experts(model_dir, fed)[3:])


def test_chat_returns_every_fed_position(server, model_dir) -> None:
    messages = [{"role": "user", "content": "Which experts did I use?"}]
    out = server.openai().chat.completions.create(
        model=MODEL, messages=messages, **GREEDY, extra_body=EXTRA
    )
    choice = out.choices[0]
    tokens = (
        server.client()
        .post("/tokenize", json={"model": MODEL, "messages": messages})
        .json()["tokens"]
    )
    fed = tokens + choice.token_ids[:-1]
    np.testing.assert_array_equal(decode(choice.routed_experts), reference_experts(model_dir, fed))


def test_token_in_token_out_returns_them_too(server, model_dir) -> None:
    ids = [5, 17, 33, 80, 101, 7, 9]
    body = {
        "model": MODEL,
        "token_ids": ids,
        "sampling_params": {**GREEDY, "ignore_eos": True, "routed_experts_prompt_start": 2},
    }
    choice = server.client().post("/inference/v1/generate", json=body).json()["choices"][0]
    fed = ids + choice["token_ids"][:-1]
    np.testing.assert_array_equal(decode(choice["routed_experts"]),
                                  reference_experts(model_dir, fed)[2:])  # fmt: skip


def test_streams_carry_no_experts_and_a_negative_start_is_refused(server) -> None:
    stream = server.openai().completions.create(model=MODEL, prompt="stream", stream=True,
                                                **GREEDY)  # fmt: skip
    assert all("routed_experts" not in chunk.choices[0].model_extra for chunk in stream)
    for start, message in ((-1, "greater than or equal to 0"), (99, "inclusive")):
        bad = server.client().post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "routed_experts_prompt_start": start},
        )
        assert bad.status_code == 400 and message in bad.json()["error"]["message"]
        assert bad.json()["error"]["param"] == "body.routed_experts_prompt_start"


def sglang_decode(text: str) -> np.ndarray:
    """As SGLang's clients read it: int32, reshaped by the model's layers and top_k."""
    return np.frombuffer(base64.b64decode(text), dtype=np.int32).reshape(-1, 3, 2)


def test_sglang_generate_returns_them_in_meta_info(server, model_dir) -> None:
    body = {
        "input_ids": [[5, 17, 33, 80], [101, 7, 9]],
        "return_routed_experts": [True, False],
        "routed_experts_start_len": 1,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
    }
    first, second = server.client().post("/generate", json=body).json()
    fed = [5, 17, 33, 80] + first["output_ids"][:-1]
    np.testing.assert_array_equal(sglang_decode(first["meta_info"]["routed_experts"]),
                                  reference_experts(model_dir, fed)[1:])  # fmt: skip
    assert "routed_experts" not in second["meta_info"]  # that prompt did not ask
    bad = server.client().post("/generate", json={**body, "return_routed_experts": "yes"})
    assert bad.status_code == 400 and "return_routed_experts" in bad.json()["error"]["message"]
    beyond = server.client().post("/generate", json={**body, "routed_experts_start_len": 5})
    assert beyond.status_code == 400
    assert beyond.json()["error"]["param"] == "body.routed_experts_start_len"


def test_sglang_chat_returns_them_in_sglext(server, model_dir) -> None:
    messages = [{"role": "user", "content": "Route me."}]
    body = {"model": MODEL, "messages": messages, **GREEDY, **EXTRA,
            "return_routed_experts": True, "routed_experts_start_len": 2}  # fmt: skip
    out = server.client().post("/v1/chat/completions", json=body).json()
    tokens = (
        server.client()
        .post("/tokenize", json={"model": MODEL, "messages": messages})
        .json()["tokens"]
    )
    fed = tokens + out["choices"][0]["token_ids"][:-1]
    np.testing.assert_array_equal(sglang_decode(out["sglext"]["routed_experts"]),
                                  reference_experts(model_dir, fed)[2:])  # fmt: skip
    plain = server.openai().completions.create(model=MODEL, prompt="no sglext", **GREEDY)
    assert "sglext" not in plain.model_extra  # only when asked, as SGLang
    completion = server.client().post("/v1/completions", json={
        "model": MODEL, "prompt": "Route me too.", **GREEDY, "return_routed_experts": True,
    }).json()  # fmt: skip
    assert sglang_decode(completion["sglext"]["routed_experts"]).shape[0] > 0
