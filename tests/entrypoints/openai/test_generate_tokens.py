"""POST /inference/v1/generate (vLLM 0.32's token-in/token-out route) end to end on the
shared tiny server, and the multi-turn recipe: turn k+1's prompt ids begin with exactly
turn k's prompt plus completion ids."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from hotswap.entrypoints.openai.params import IGNORED_FIELDS_WARNING
from tests.entrypoints.openai.conftest import MODEL
from tests.entrypoints.openai.test_completions import sse_events

ROUTE = "/inference/v1/generate"
PROMPT_IDS = [1, 87, 104, 101, 32, 279, 325]  # any in-vocabulary ids
EOS = 2  # <|im_end|> in the tiny tokenizer
# A body as vLLM's protocol writes it: token ids plus a nested SamplingParams object.
VLLM_BODY = json.loads("""
{
  "model": "tiny",
  "token_ids": [1, 87, 104, 101, 32, 279, 325],
  "sampling_params": {"temperature": 0.0, "max_tokens": 8, "logprobs": 2, "ignore_eos": true},
  "return_token_ids": true
}
""")
RESPONSE_KEYS = {
    "request_id", "model", "created", "usage", "prompt_logprobs", "prompt_token_id_logprobs",
    "prompt_token_ids", "mm_placeholders", "metrics", "kv_transfer_params",
    "ec_transfer_params", "output_mode", "choices",
}  # fmt: skip
CHOICE_KEYS = {
    "index", "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask",
    "weight_versions", "logprobs",
}  # fmt: skip


def generate(http: httpx.Client, body: dict) -> dict:
    response = http.post(ROUTE, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def greedy(ids: list[int], max_tokens: int = 8, **sampling: object) -> dict:
    params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **sampling}
    return {"token_ids": ids, "sampling_params": params}


def test_vllm_shaped_body(http) -> None:
    out = generate(http, VLLM_BODY)
    assert set(out) == RESPONSE_KEYS
    assert out["request_id"].startswith("generate-tokens-") and out["model"] == MODEL
    assert out["output_mode"] == "tokens" and out["prompt_token_ids"] == PROMPT_IDS
    (choice,) = out["choices"]
    assert set(choice) == CHOICE_KEYS
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 8
    assert out["usage"]["prompt_tokens"] == 7 and out["usage"]["completion_tokens"] == 8
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == choice["token_ids"]
    for entry in content:  # greedy: the sampled token is rank 1 and comes first, 2 in all
        assert entry["rank"] == 1 and len(entry["top_logprobs"]) == 2
        first, second = entry["top_logprobs"]
        assert (first["token_id"], first["logprob"]) == (entry["token_id"], entry["logprob"])
        assert second["rank"] == 2 and second["logprob"] <= first["logprob"] < 0
        # vLLM 0.22's "token_id:N" too (prime-rl's pin; verifiers' training client reads it)
        for each in (entry, first, second):
            assert each["token"] == f"token_id:{each['token_id']}"
    # vLLM's WeightVersionSpan (version: the label) plus hotswap's provenance
    assert choice["weight_versions"] == [
        {"version": "default", "start": 0, "end": 8, "label": "default", "weight_gen": 0,
         "stale": False}
    ]  # fmt: skip


def test_ids_and_logprobs_equal_completions(http) -> None:
    out = generate(http, greedy(PROMPT_IDS, 10, logprobs=3))
    body = {"model": MODEL, "prompt": PROMPT_IDS, "temperature": 0, "max_tokens": 10,
            "ignore_eos": True, "logprobs": 3, "return_token_ids": True}  # fmt: skip
    ref = http.post("/v1/completions", json=body).json()["choices"][0]
    choice = out["choices"][0]
    assert choice["token_ids"] == ref["token_ids"]
    ours = [c["logprob"] for c in choice["logprobs"]["content"]]
    assert ours == pytest.approx(ref["logprobs"]["token_logprobs"], abs=1e-5)
    for entry, top in zip(choice["logprobs"]["content"], ref["logprobs"]["top_logprobs"]):
        values = sorted((t["logprob"] for t in entry["top_logprobs"]), reverse=True)
        if len(top) == 3:  # (two tokens with the same text collapse in the legacy dict)
            assert values == pytest.approx(sorted(top.values(), reverse=True), abs=1e-5)


def test_stream_concatenates_to_the_same_ids(http) -> None:
    full = generate(http, greedy(PROMPT_IDS, 9, logprobs=1))["choices"][0]
    body = greedy(PROMPT_IDS, 9, logprobs=1) | {
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", ROUTE, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    usage, chunks = events[-2], events[:-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 9
    choices = [c["choices"][0] for c in chunks]
    assert [t for c in choices for t in c["token_ids"]] == full["token_ids"]
    logprobs = [e["logprob"] for c in choices for e in c["logprobs"]["content"]]
    assert logprobs == pytest.approx([e["logprob"] for e in full["logprobs"]["content"]])
    assert chunks[0]["prompt_token_ids"] == PROMPT_IDS
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    # provenance and the finish on the final chunk only, covering the whole output
    assert [c["weight_versions"] for c in choices[:-1]] == [None] * (len(choices) - 1)
    assert choices[-1]["finish_reason"] == "length"
    assert [(s["start"], s["end"]) for s in choices[-1]["weight_versions"]] == [(0, 9)]
    assert {c["request_id"] for c in chunks} == {usage["request_id"]}


def test_stream_interval_batches_tokens(http) -> None:
    body = greedy(PROMPT_IDS, 10, stream_interval=4) | {"stream": True}
    with http.stream("POST", ROUTE, json=body) as response:
        events = sse_events(response)
    sizes = [len(e["choices"][0]["token_ids"]) for e in events[:-1]]
    assert sizes == [1, 4, 4, 1]  # the first and the final chunks go out at once, as vLLM


def test_text_mode_matches_completions(http) -> None:
    out = generate(http, greedy(PROMPT_IDS, 8, logprobs=1) | {"output_mode": "text"})
    body = {"model": MODEL, "prompt": PROMPT_IDS, "temperature": 0, "max_tokens": 8,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    ref = http.post("/v1/completions", json=body).json()["choices"][0]
    choice = out["choices"][0]
    assert out["output_mode"] == "text" and choice["text"] == ref["text"]
    assert choice["token_ids"] == ref["token_ids"]
    entry = choice["logprobs"]["content"][0]
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert entry["bytes"] == list(entry["token"].encode("utf-8", "replace"))


def test_sampling_controls_behave_as_on_completions(http) -> None:
    allowed = [67, 68, 69]
    out = generate(http, greedy(PROMPT_IDS, 12, temperature=1.0, seed=5, allowed_token_ids=allowed))
    assert set(out["choices"][0]["token_ids"]) <= set(allowed)
    out = generate(http, greedy(PROMPT_IDS, 6, logit_bias={"71": 100}))
    assert out["choices"][0]["token_ids"] == [71] * 6
    choice = {"structured_outputs": {"choice": ["red", "green"]}}
    params = {"temperature": 1.0, "seed": 1, "max_tokens": 20, **choice}
    out = generate(http, {"token_ids": PROMPT_IDS, "sampling_params": params})
    ids = out["choices"][0]["token_ids"]
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text in ("red", "green") and out["choices"][0]["finish_reason"] == "stop"


def test_n_and_seed(http) -> None:
    params = {"n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 6, "ignore_eos": True}
    out = generate(http, {"token_ids": PROMPT_IDS, "sampling_params": params})
    assert [c["index"] for c in out["choices"]] == [0, 1]
    again = generate(http, {"token_ids": PROMPT_IDS, "sampling_params": params})
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in out["choices"]]
    assert out["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": [1, 10**6], "sampling_params": {}}, "body.token_ids"),
        ({"token_ids": [], "sampling_params": {}}, "body.token_ids"),
        ({"token_ids": [1, -1], "sampling_params": {}}, "body.token_ids.1"),
        ({"token_ids": [5] * 512, "sampling_params": {}}, "body.token_ids"),  # the context
        ({"token_ids": [1]}, "body.sampling_params"),
        ({"token_ids": [1], "sampling_params": {"temperature": -1}},
         "body.sampling_params.temperature"),
        ({"token_ids": [1], "sampling_params": {"top_p": 0}}, "body.sampling_params.top_p"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": 0}},
         "body.sampling_params.max_tokens"),
        ({"token_ids": [1], "sampling_params": {"logprobs": -1}},
         "body.sampling_params.logprobs"),
        ({"token_ids": [1], "sampling_params": {"logit_bias": {"99999": 1}}},
         "body.sampling_params.logit_bias"),
        ({"token_ids": [1], "sampling_params": {"structured_outputs": {"regex": "("}}},
         "body.sampling_params.structured_outputs.regex"),
        ({"token_ids": [1], "sampling_params": {"stop": "x", "detokenize": False}},
         "body.sampling_params.stop"),
        ({"token_ids": [1], "sampling_params": {"detokenize": False}, "output_mode": "text"},
         "body.output_mode"),
        ({"token_ids": [1], "sampling_params": {}, "cache_salt": "a/b"}, "body.cache_salt"),
        ({"token_ids": [1], "sampling_params": {}, "model": "other"}, "body.model"),
    ],
)  # fmt: skip
def test_bad_input_names_the_field(http, body: dict, param: str) -> None:
    response = http.post(ROUTE, json=body)
    assert response.status_code == (404 if param == "body.model" else 400), response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"features": {"mm_hashes": {}, "mm_placeholders": {}}}, "body.features"),
        ({"content_parts": [{"type": "image_url", "url": "x"}]}, "body.content_parts"),
        ({"kv_transfer_params": {"do_remote_decode": True}}, "body.kv_transfer_params"),
        ({"sampling_params": {"thinking_token_budget": 8}},
         "body.sampling_params.thinking_token_budget"),
        ({"sampling_params": {"logprob_token_ids": [5]}},
         "body.sampling_params.logprob_token_ids"),
        ({"sampling_params": {"trace_decode_token_ids": [5]}},
         "body.sampling_params.trace_decode_token_ids"),
        ({"sampling_params": {"repetition_detection": {"min_count": 2}}},
         "body.sampling_params.repetition_detection"),
        ({"sampling_params": {"watermarking": True}}, "body.sampling_params.watermarking"),
        ({"sampling_params": {"extra_args": {"k": 1}}}, "body.sampling_params.extra_args"),
        ({"sampling_params": {"structured_outputs": {"json_object": True,
                                                     "whitespace_pattern": " "}}},
         "body.sampling_params.structured_outputs.whitespace_pattern"),
    ],
)  # fmt: skip
def test_known_but_unsupported_fields_are_refused(http, body: dict, param: str) -> None:
    full = {"token_ids": [1, 2, 3]} | body
    full["sampling_params"] = {"max_tokens": 2} | body.get("sampling_params", {})
    response = http.post(ROUTE, json=full)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_lax_bodies_vllm_accepts(server, http) -> None:
    """What vLLM 0.32's GenerateRequest accepts (checked against its pydantic models):
    string ids, logprobs true (= 1), a numeric string n, fields it ignores; unknown ones
    are ignored with the usual warning naming them, nested ones under their parent."""
    params = {"max_tokens": "3", "logprobs": True, "n": "1", "temperature": "0",
              "output_kind": 1, "flat_logprobs": True, "skip_clone": True, "foo": 1}  # fmt: skip
    body = {"token_ids": ["1", 87, 104.0], "sampling_params": params, "bar": 2,
            "token_offsets": [[0, 1]], "priority": 0, "reasoning_ended": True}  # fmt: skip
    out = generate(http, body)
    (choice,) = out["choices"]
    assert len(choice["token_ids"]) == 3 and len(choice["logprobs"]["content"]) == 3
    assert len(choice["logprobs"]["content"][0]["top_logprobs"]) == 1
    deadline = time.monotonic() + 5
    while not any("'sampling_params.foo'" in line for line in server.log):
        assert time.monotonic() < deadline, "no warning naming the ignored fields"
        time.sleep(0.05)
    warning = next(line for line in server.log if "'sampling_params.foo'" in line)
    assert IGNORED_FIELDS_WARNING in warning and "'bar'" in warning


def test_max_tokens_beyond_the_context_stops_at_it(http) -> None:
    """vLLM's route does not refuse max_tokens past the context: it stops there."""
    out = generate(http, greedy([40 + i % 300 for i in range(500)], 100))
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 12  # max_model_len 512 - 500


def test_skip_reading_prefix_cache(http) -> None:
    ids = list(range(40, 140))  # several KV blocks
    details = [
        generate(http, greedy(ids, 2, **extra))["usage"]["prompt_tokens_details"]
        for extra in ({}, {}, {"skip_reading_prefix_cache": True})
    ]
    assert details[1]["cached_tokens"] > 0 and details[2]["cached_tokens"] == 0


def test_request_id_header_and_body(http) -> None:
    out = generate(http, greedy(PROMPT_IDS, 1) | {"request_id": "rollout-7"})
    assert out["request_id"] == "generate-tokens-rollout-7"
    response = http.post(ROUTE, json=greedy(PROMPT_IDS, 1), headers={"X-Request-Id": "h-1"})
    assert response.json()["request_id"] == "generate-tokens-h-1"


# -- the multi-turn recipe --------------------------------------------------------------------


def tokenize_chat(http: httpx.Client, messages: list[dict]) -> list[int]:
    return http.post("/tokenize", json={"messages": messages}).json()["tokens"]


def next_turn_suffix(http: httpx.Client, history: list[dict], user: str, prefix_len: int):  # noqa: ANN201
    """The ids the chat template writes after the assistant's content: the closing of its
    turn, the next user turn and the generation prompt (the template rendered with an
    empty assistant message, minus the turn-1 prompt it begins with)."""
    turn = [*history, {"role": "assistant", "content": ""}, {"role": "user", "content": user}]
    return tokenize_chat(http, turn)[prefix_len:]


def test_multi_turn_prompt_begins_with_previous_prompt_and_completion(http) -> None:
    history = [{"role": "user", "content": "Name a colour."}]
    p1 = tokenize_chat(http, history)
    turn1 = generate(http, greedy(p1, 8, logprobs=0) | {"return_token_ids": True})
    c1 = turn1["choices"][0]["token_ids"]
    suffix = next_turn_suffix(http, history, "Another one?", len(p1))
    if c1[-1] == EOS:  # the model closed its turn itself: do not close it twice
        suffix = suffix[1:]
    p2 = p1 + c1 + suffix
    turn2 = generate(http, greedy(p2, 8, prompt_logprobs=0) | {"return_token_ids": True})
    assert turn2["prompt_token_ids"][: len(p1) + len(c1)] == p1 + c1
    assert turn2["prompt_token_ids"] == p2
    # the trainer's view: turn 2 scores turn 1's completion as turn 1 sampled it
    scored = turn2["prompt_logprobs"][len(p1) : len(p1) + len(c1)]
    rescored = [entry[str(token)]["logprob"] for entry, token in zip(scored, c1)]
    sampled = [e["logprob"] for e in turn1["choices"][0]["logprobs"]["content"]]
    assert rescored == pytest.approx(sampled, abs=1e-3)
    # re-rendering the chat from the completion's text instead: the ids drift whenever
    # the text does not re-tokenize to the sampled ids (byte pieces, non-canonical splits)
    text = http.post("/detokenize", json={"tokens": c1}).json()["prompt"]
    retokenized = tok(http, text)
    rerendered = tokenize_chat(
        http, [*history, {"role": "assistant", "content": text}, {"role": "user", "content": "x"}]
    )
    if retokenized != c1:
        assert rerendered[: len(p1) + len(c1)] != p1 + c1


def test_rerendering_text_drifts_on_a_non_canonical_split(http) -> None:
    """A model may sample "T", "h", "e" where the tokenizer writes "The" as one token: the
    text round trip merges them, so a re-rendered turn-2 prompt no longer holds turn 1's
    ids, and turn 1's logprobs no longer line up with it."""
    sampled = [tok(http, ch)[0] for ch in "The"]
    assert len(sampled) == 3 and tok(http, "The") != sampled
    text = http.post("/detokenize", json={"tokens": sampled}).json()["prompt"]
    assert text == "The" and tok(http, text) != sampled


def tok(http: httpx.Client, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()[
        "tokens"
    ]
