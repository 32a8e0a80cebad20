"""What RL frameworks send on the OpenAI routes: prompt logprobs (vLLM's shape), echo with
logprobs, penalties and cache_salt — checked against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from tests.entrypoints.openai.conftest import MODEL

PROMPT_IDS = list(range(60, 100))  # 40 tokens: two full 16-token blocks


@pytest.fixture(scope="module")
def hf_model(tiny_llama):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)


def test_prompt_logprobs_in_vllm_shape(http, hf_model) -> None:
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 1, "prompt_logprobs": 1}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    scored = response.json()["choices"][0]["prompt_logprobs"]
    expected = hf_logprobs(hf_model, PROMPT_IDS)
    assert scored[0] is None and len(scored) == len(PROMPT_IDS)
    for position, entries in enumerate(scored[1:]):
        token = PROMPT_IDS[position + 1]
        own = entries[str(token)]
        assert own["logprob"] == pytest.approx(float(expected[position, token]), abs=1e-4)
        assert own["rank"] == int((expected[position] > expected[position, token]).sum()) + 1
        assert isinstance(own["decoded_token"], str)
        best = int(expected[position].argmax())
        assert entries[str(best)]["rank"] == 1
    plain = http.post("/v1/completions", json={**body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain["choices"][0]


def test_echo_with_logprobs_scores_the_prompt(http, hf_model) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPT_IDS[:12],
        "max_tokens": 3,
        "temperature": 0,
        "echo": True,
        "logprobs": 2,
        "ignore_eos": True,
    }
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == 12 + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = hf_logprobs(hf_model, PROMPT_IDS[:12])
    for position in range(11):
        token = PROMPT_IDS[position + 1]
        got = logprobs["token_logprobs"][position + 1]
        assert got == pytest.approx(float(expected[position, token]), abs=1e-4)
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert choice["text"].startswith("".join(logprobs["tokens"][:12]))
    # streamed: the echo chunk carries the same prompt logprobs
    stream = {**body, "stream": True}
    with http.stream("POST", "/v1/completions", json=stream) as response:
        from tests.entrypoints.openai.test_completions import sse_events

        events = [e for e in sse_events(response) if isinstance(e, dict)]
    first = events[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"] == logprobs["token_logprobs"][:12]


def test_cache_salt_separates_prefix_cache(http) -> None:
    ids = list(range(110, 150))

    def cached(salt: str | None) -> int:
        body = {"model": MODEL, "prompt": ids, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        usage = http.post("/v1/completions", json=body).json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"]

    assert cached("policy-v1") == 0
    assert cached("policy-v1") > 0  # same salt: shared
    assert cached("policy-v2") == 0  # another salt never sees those blocks
    assert cached(None) == 0  # nor an unsalted request
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long enough message " * 4}],
        "max_tokens": 1,
        "cache_salt": "s1",
    }
    http.post("/v1/chat/completions", json=chat)
    usage = http.post("/v1/chat/completions", json={**chat, "cache_salt": "s2"}).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_repetition_penalty_matches_transformers(client, hf_model) -> None:
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=12,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.8, "return_token_ids": True},
    )
    inputs = torch.tensor([prompt])
    expected = hf_model.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        do_sample=False,
        max_new_tokens=12,
        repetition_penalty=1.8,
        pad_token_id=0,
    )[0].tolist()[len(prompt) :]
    assert out.choices[0].model_extra["token_ids"] == expected


def test_presence_and_frequency_penalties_change_the_output(client) -> None:
    def tokens(**penalties: float) -> list[int]:
        out = client.completions.create(
            model=MODEL,
            prompt=[7, 8, 9],
            temperature=0,
            max_tokens=24,
            extra_body={"ignore_eos": True, "return_token_ids": True},
            **penalties,
        )
        return out.choices[0].model_extra["token_ids"]

    plain = tokens()
    penalised = tokens(presence_penalty=2.0, frequency_penalty=2.0)
    assert penalised != plain
    assert len(set(penalised)) >= len(set(plain))


def test_chat_prompt_logprobs(http) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 2,
        "prompt_logprobs": 0,
    }
    out = http.post("/v1/chat/completions", json=body).json()
    scored = out["prompt_logprobs"]
    assert scored[0] is None and all(len(entries) == 1 for entries in scored[1:])
    assert len(scored) == out["usage"]["prompt_tokens"]
