"""A server set up the way RL frameworks run vLLM: `--logprobs-mode processed_logprobs`,
`--return-tokens-as-token-ids` (PipelineRL parses "token_id:N"), sleep mode; and the
sleep/wake sequences OpenRLHF and verl send, one tag per call."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.server import RemoteServer

# Every test here talks to a server (its own process and engine): slow.
pytestmark = pytest.mark.slow

MODEL = "tiny"
SERVER_ARGS = (
    "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256",
    "--enable-control", "--enable-sleep-mode", "--logprobs-mode", "processed_logprobs",
    "--return-tokens-as-token-ids", "--log-level", "warning",
)  # fmt: skip
PROMPT = list(range(30, 50))


@pytest.fixture(scope="module")
def server(tiny_llama):
    with RemoteServer(tiny_llama, *SERVER_ARGS) as srv:
        yield srv


@pytest.fixture
def http(server: RemoteServer):
    with server.client(timeout=30.0) as c:
        yield c


def test_processed_logprobs_and_token_id_strings(http, tiny_llama) -> None:
    from transformers import AutoModelForCausalLM

    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count with me"}],
        "max_tokens": 8,
        "temperature": 0.5,
        "logprobs": True,
        "top_logprobs": 1,
        "seed": 3,
        "return_token_ids": True,
        "add_generation_prompt": True,
    }
    out = http.post("/v1/chat/completions", json=body).json()
    content = out["choices"][0]["logprobs"]["content"]
    tokens = out["choices"][0]["token_ids"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in tokens]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    sequence = out["prompt_token_ids"] + tokens
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0]
    expected = torch.log_softmax(logits / 0.5, dim=-1)  # the distribution sampled from
    start = len(out["prompt_token_ids"]) - 1
    for step, (token, entry) in enumerate(zip(tokens, content)):
        assert entry["logprob"] == pytest.approx(float(expected[start + step, token]), abs=1e-4)


def _generates(http) -> None:  # noqa: ANN001
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    "wake_calls",
    [
        [["weights"], ["kv_cache"]],  # OpenRLHF and verl: weights first, then the KV cache
        [["kv_cache"], ["weights"]],
        [["weights", "kv_cache"]],
        [None],
    ],
    ids=["weights-then-kv", "kv-then-weights", "both", "all"],
)
def test_vllm_wake_sequences_leave_the_engine_generating(http, wake_calls) -> None:
    digest = http.get("/weight_info").json()["digest"]
    assert http.post("/sleep", params={"level": 1}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    for tags in wake_calls:
        response = http.post("/wake_up", params={"tags": tags} if tags else None)
        assert response.status_code == 200, response.text
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.get("/is_paused").json() == {"is_paused": False}
    _generates(http)
    assert http.get("/weight_info").json()["digest"] == digest
