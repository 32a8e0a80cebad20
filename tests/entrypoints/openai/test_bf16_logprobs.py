"""return_bf16_logprobs over HTTP on an FP8 server (--enable-bf16-logprobs), with the
openai client: the field on completions and chat (streamed too), and /metrics' gap."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.test_scoring import hf_token_logprobs
from tests.helpers.server import RemoteServer
from tests.model.test_fp8 import QUANTIZED

pytestmark = pytest.mark.slow  # one server for the module

MODEL = "fp8"
EXTRA = {"ignore_eos": True, "return_token_ids": True, "return_bf16_logprobs": True}


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[RemoteServer]:
    args = ("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256",
            "--quantization", "fp8", "--hf-overrides", json.dumps(QUANTIZED),
            "--enable-bf16-logprobs", "--log-level", "warning")  # fmt: skip
    with RemoteServer(tiny_llama, *args) as remote:
        yield remote


def test_completions_return_the_bf16_logprobs(server, tiny_llama) -> None:
    out = server.openai().completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=6, logprobs=1, seed=5,
        extra_body=EXTRA,
    )  # fmt: skip
    choice = out.choices[0]
    want = hf_token_logprobs(tiny_llama, choice.prompt_token_ids, choice.token_ids)
    assert choice.bf16_logprobs == pytest.approx(want, abs=1e-4)
    assert choice.logprobs.token_logprobs != pytest.approx(want, abs=1e-4)  # FP8's own


def test_streamed_chat_carries_them_on_the_last_chunk(server, tiny_llama) -> None:
    messages = [{"role": "user", "content": "Score me in bf16"}]
    stream = server.openai().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, stream=True, extra_body=EXTRA
    )
    chunks = [c for c in stream if c.choices]
    tokens = [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])]
    assert all(getattr(c.choices[0], "bf16_logprobs", None) is None for c in chunks[:-1])
    last = chunks[-1].choices[0]
    prompt = (
        server.client()
        .post("/tokenize", json={"model": MODEL, "messages": messages})
        .json()["tokens"]
    )
    want = hf_token_logprobs(tiny_llama, prompt, tokens)
    assert last.bf16_logprobs == pytest.approx(want, abs=1e-4)


def test_absent_unless_asked_and_counted_in_metrics(server) -> None:
    before = _metric(server, "hotswap:bf16_scored_tokens_total")
    out = server.openai().completions.create(model=MODEL, prompt="plain", max_tokens=3)
    assert "bf16_logprobs" not in out.choices[0].model_dump(exclude_unset=True)
    server.openai().completions.create(
        model=MODEL, prompt="counted", max_tokens=4, extra_body=EXTRA
    )
    assert _metric(server, "hotswap:bf16_scored_tokens_total") == before + 4
    assert _metric(server, "hotswap:bf16_logprob_abs_diff_total") > 0


def _metric(server: RemoteServer, name: str) -> float:
    text = server.client().get("/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_sglang_generate_returns_them_in_meta_info(server, tiny_llama) -> None:
    ids = [5, 17, 33, 80, 101, 7, 9]
    params = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    body = {"input_ids": ids, "return_bf16_logprobs": True, "sampling_params": params}
    out = server.client().post("/generate", json=body).json()
    want = hf_token_logprobs(tiny_llama, ids, out["output_ids"])
    assert out["meta_info"]["bf16_logprobs"] == pytest.approx(want, abs=1e-4)


def test_vllm_generate_route_too(server, tiny_llama) -> None:
    ids = [5, 17, 33, 80, 101, 7, 9]
    params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
              "return_bf16_logprobs": True}  # fmt: skip
    body = {"token_ids": ids, "sampling_params": params}
    (choice,) = server.client().post("/inference/v1/generate", json=body).json()["choices"]
    want = hf_token_logprobs(tiny_llama, ids, choice["token_ids"])
    assert choice["bf16_logprobs"] == pytest.approx(want, abs=1e-4)
