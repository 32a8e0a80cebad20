"""SGLang's POST /generate end to end: the payloads slime and AReaL send, against a real
`hotswap serve` and checked against transformers on the same weights and against the
server's own /v1/completions."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers.server import RemoteServer

# Every test here talks to a server (its own process and engine): slow.
pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
LONG = 480  # new tokens: seconds of generation, long past a request or two
PROMPT = "Reinforcement learning trains a policy while it"
EOS = 2  # the tiny model's <|im_end|>


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[RemoteServer]:
    # float32: greedy tokens and logprobs do not depend on batching or the prefix cache.
    # No dialect flag: SGLang serves /generate unconditionally, and so does hotswap; the
    # control plane is on only for /abort_requests.
    args = ("--served-model-name", "tiny", "--dtype", "float32", "--log-level", "warning")
    limits = ("--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "128")
    # compact JSON for json_schema: a random model given free whitespace wanders in it
    compact = ("--structured-outputs-config", '{"disable_any_whitespace": true}')
    with RemoteServer(tiny_llama, *args, *limits, *compact, "--enable-control") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def prompt_ids(http: httpx.Client) -> list[int]:
    return http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]


@pytest.fixture(scope="module")
def hf_model(tiny_llama: Path):  # noqa: ANN201 - transformers' LlamaForCausalLM
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS may be generated
    return model


def hf_greedy(model, ids: list[int], num: int) -> tuple[list[int], torch.Tensor]:  # noqa: ANN001
    """transformers' greedy continuation and the log-softmax at every position of the
    whole sequence (row i scores token i + 1)."""
    with torch.no_grad():
        inputs = torch.tensor([ids])
        seq = model.generate(
            inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
            max_new_tokens=num, pad_token_id=0,
        )[0].tolist()  # fmt: skip
        return seq[len(ids) :], torch.log_softmax(model(torch.tensor([seq])).logits[0], -1)


def generate(http: httpx.Client, payload: dict) -> dict | list:
    response = http.post("/generate", json=payload)
    assert response.status_code == 200, response.text
    return response.json()


def sse_data(response: httpx.Response) -> list[dict | str]:
    events: list[dict | str] = []
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# -- what the frameworks send ---------------------------------------------------------------


def slime_payload(input_ids: list[int], max_new_tokens: int) -> dict:
    """slime/rollout/sglang_rollout.py `generate`: GenerateState's sampling_params (greedy
    here: rollout_temperature 0) and the payload it posts."""
    sampling_params = dict(
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        max_new_tokens=max_new_tokens,
        stop=None,
        stop_token_ids=None,
        skip_special_tokens=False,
        no_stop_trim=True,
        spaces_between_special_tokens=False,
    )
    return {"sampling_params": sampling_params, "return_logprob": True, "input_ids": input_ids}


def test_slime_payload_matches_transformers_and_completions(http, prompt_ids, hf_model) -> None:
    out = generate(http, slime_payload(prompt_ids, 16))
    meta = out["meta_info"]
    expected, logprobs = hf_greedy(hf_model, prompt_ids, 16)
    ids = out["output_ids"]
    assert ids == expected[: len(ids)]  # slime does not ignore EOS: it may stop early
    if meta["finish_reason"]["type"] == "stop":
        assert ids[-1] == EOS and meta["finish_reason"]["matched"] == EOS
    else:
        assert meta["finish_reason"] == {"type": "length", "length": 16} and len(ids) == 16
    # slime reads the tokens and logprobs from output_token_logprobs
    assert [entry[1] for entry in meta["output_token_logprobs"]] == ids
    for i, (value, token, text) in enumerate(meta["output_token_logprobs"]):
        assert value == pytest.approx(float(logprobs[len(prompt_ids) + i - 1, token]), abs=1e-4)
        assert text is None  # return_text_in_logprobs is off
    assert meta["prompt_tokens"] == len(prompt_ids) and meta["completion_tokens"] == len(ids)
    assert meta["weight_version"] == "default" and isinstance(meta["e2e_latency"], float)
    assert meta["weight_versions"] == [
        {"version": "default", "start": 0, "end": len(ids), "committed_version": 0, "stale": False}
    ]
    assert meta["input_token_logprobs"] == [[None, prompt_ids[-1], None]]  # SGLang's default
    # the same request on the OpenAI route: same tokens, same logprobs
    completion = http.post(
        "/v1/completions",
        json={"prompt": prompt_ids, "max_tokens": 16, "temperature": 0, "logprobs": 0,
              "return_token_ids": True, "skip_special_tokens": False},
    ).json()["choices"][0]  # fmt: skip
    assert completion["token_ids"] == ids
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(
        completion["logprobs"]["token_logprobs"], abs=1e-5
    )
    assert out["text"] == completion["text"]  # no_stop_trim: the EOS text stays


def test_areal_payload(http, prompt_ids, hf_model) -> None:
    """areal/engine/sglang_remote.py SGLangBackend.build_generation_request, greedy."""
    payload = {
        "input_ids": prompt_ids[:5],
        "image_data": None,
        "sampling_params": {
            "top_p": 1.0,
            "top_k": 100000000,
            "max_new_tokens": 8,
            "temperature": 0.0,
            "stop_token_ids": [],
            "ignore_eos": True,
            "skip_special_tokens": True,
            "frequency_penalty": 0.0,
        },
        "return_logprob": True,
        "stream": False,
    }
    meta = generate(http, payload)["meta_info"]
    expected, _ = hf_greedy(hf_model, prompt_ids[:5], 8)
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert [x[1] for x in meta["output_token_logprobs"]] == expected  # what AReaL reads


def test_prefill_only_scores_the_prompt(http, prompt_ids, hf_model) -> None:
    """slime's on-policy distillation: max_new_tokens 0, logprob_start_len 0, and the
    teacher's logprobs read from input_token_logprobs[1:]."""
    payload = {
        "input_ids": prompt_ids,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    out = generate(http, payload)
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == ""
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    scored = meta["input_token_logprobs"]
    assert [entry[1] for entry in scored] == prompt_ids and scored[0][0] is None
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([prompt_ids])).logits[0], -1)
    for i in range(1, len(prompt_ids)):
        assert scored[i][0] == pytest.approx(float(expected[i - 1, prompt_ids[i]]), abs=1e-4)
    # from position 3: SGLang's first reported entry is never scored
    later = generate(http, {**payload, "logprob_start_len": 3})["meta_info"]
    assert later["input_token_logprobs"] == [[None, prompt_ids[3], None], *scored[4:]]


def test_top_logprobs_and_text(http, prompt_ids) -> None:
    payload = slime_payload(prompt_ids, 4) | {
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
    }
    meta = generate(http, payload)["meta_info"]
    for (value, token, text), top in zip(
        meta["output_token_logprobs"], meta["output_top_logprobs"]
    ):
        assert len(top) == 3 and isinstance(text, str)
        assert [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
        assert top[0][:2] == [value, token]  # greedy: the sampled token is the most likely
    assert meta["input_top_logprobs"] == [None]


# -- finish reasons ---------------------------------------------------------------------------


def test_finish_reason_stop_token_and_string(http, prompt_ids) -> None:
    base = {"input_ids": prompt_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 12,
                                                          "ignore_eos": True}}  # fmt: skip
    full = generate(http, base)
    ids, text = full["output_ids"], full["text"]
    pieces = [http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in ids]
    k = next(
        i
        for i in range(1, len(ids))
        if ids[i] not in ids[:i] and pieces[i].isascii() and pieces[i].strip()
    )
    by_token = base["sampling_params"] | {"stop_token_ids": [ids[k]]}
    trimmed = generate(http, base | {"sampling_params": by_token})
    assert trimmed["output_ids"] == ids[: k + 1]  # the ids keep the matched token
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
    # its text goes, as SGLang trims a matched token, unless no_stop_trim (slime's choice)
    kept = generate(http, base | {"sampling_params": by_token | {"no_stop_trim": True}})
    assert kept["output_ids"] == trimmed["output_ids"]
    assert kept["text"] == trimmed["text"] + pieces[k]
    clean = re.sub(r"[^A-Za-z ]", "", text)
    stop = next(
        clean[i : i + 2] for i in range(1, len(clean) - 1) if text.find(clean[i : i + 2]) > 0
    )
    cut = text.find(stop)
    sampling = base["sampling_params"] | {"stop": [stop]}
    trimmed = generate(http, base | {"sampling_params": sampling})
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert trimmed["text"] == text[:cut]
    kept = generate(http, base | {"sampling_params": sampling | {"no_stop_trim": True}})
    assert kept["text"] == text[: cut + len(stop)]


def test_abort_finishes_with_partial_output(server, http) -> None:
    """What AReaL and slime see when the trainer aborts (pause, weight update): the tokens
    so far, with their logprobs, and finish_reason abort."""
    body = {"text": PROMPT, "rid": "sglang-abort", "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}  # fmt: skip
    with http.stream("POST", "/generate", json=body) as response:
        lines = (line for line in response.iter_lines() if line)
        assert json.loads(next(lines)[6:])["meta_info"]["finish_reason"] is None
        aborted = http.post("/abort_requests", json={"request_ids": ["sglang-abort"]})
        assert aborted.status_code == 200, aborted.text
        rest = [line[6:] for line in lines]
    assert rest[-1] == "[DONE]"
    last = json.loads(rest[-2])
    meta = last["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["id"] == "sglang-abort"
    assert 0 < len(last["output_ids"]) < LONG
    assert [x[1] for x in meta["output_token_logprobs"]] == last["output_ids"]


# -- batches, streaming, request ids ----------------------------------------------------------


def test_batch_and_n_answer_a_list(http) -> None:
    greedy = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    singles = [generate(http, {"text": t, "sampling_params": greedy}) for t in ("The", PROMPT)]
    batch = generate(
        http, {"text": ["The", PROMPT], "rid": "b", "sampling_params": greedy | {"n": 2}}
    )
    assert isinstance(batch, list) and len(batch) == 4  # prompt by prompt, n samples each
    assert [item["output_ids"] for item in batch] == [
        singles[0]["output_ids"], singles[0]["output_ids"],
        singles[1]["output_ids"], singles[1]["output_ids"],
    ]  # fmt: skip
    assert [item["meta_info"]["id"] for item in batch] == ["b_0", "b_0", "b_1", "b_1"]
    per_prompt = generate(
        http,
        {"input_ids": [[5, 6, 7], [8, 9]], "rid": ["x", "y"],
         "sampling_params": [{"max_new_tokens": 2, "ignore_eos": True},
                             {"max_new_tokens": 3, "ignore_eos": True}]},
    )  # fmt: skip
    assert [item["meta_info"]["completion_tokens"] for item in per_prompt] == [2, 3]
    assert [item["meta_info"]["prompt_tokens"] for item in per_prompt] == [3, 2]
    assert [item["meta_info"]["id"] for item in per_prompt] == ["x", "y"]


def test_stream_chunks_are_cumulative(http, prompt_ids) -> None:
    payload = slime_payload(prompt_ids, 10) | {"stream": True}
    payload["sampling_params"]["ignore_eos"] = True
    with http.stream("POST", "/generate", json=payload) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_data(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2 and all("index" not in c for c in chunks)
    for before, after in zip(chunks, chunks[1:]):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert after["text"].startswith(before["text"])
        assert before["meta_info"]["finish_reason"] is None
    final = chunks[-1]
    whole = generate(http, {**payload, "stream": False})
    assert final["output_ids"] == whole["output_ids"]
    # The engine's final-only text leaves out a trailing incomplete UTF-8 sequence that its
    # streamed text ends with as U+FFFD (as decode() gives): compare without it.
    assert final["text"].rstrip("\ufffd") == whole["text"].rstrip("\ufffd")
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    streamed, plain = (c["meta_info"]["output_token_logprobs"] for c in (final, whole))
    assert [e[1] for e in streamed] == [e[1] for e in plain]
    assert [e[0] for e in streamed] == pytest.approx([e[0] for e in plain], abs=1e-5)
    batch = {"text": ["The", PROMPT], "stream": True, "sampling_params": {"max_new_tokens": 3}}
    with http.stream("POST", "/generate", json=batch) as response:
        chunks = sse_data(response)[:-1]
    assert {c["index"] for c in chunks} == {0, 1}
    assert sum(c["meta_info"]["finish_reason"] is not None for c in chunks) == 2


def abort_count(http: httpx.Client) -> float:
    metrics = http.get("/metrics").text
    found = re.search(r'request_success_total\{finished_reason="abort"[^}]*\} (\S+)', metrics)
    return float(found.group(1)) if found else 0.0


def test_rid_in_use_and_disconnect_aborts(server, http) -> None:
    async def scenario() -> None:
        async with server.async_client() as client:
            body = {"text": PROMPT, "rid": "sglang-busy", "stream": True,
                    "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}  # fmt: skip
            async with client.stream("POST", "/generate", json=body) as response:
                lines = response.aiter_lines()  # kept: closing it would close the response
                while not await anext(lines):
                    pass
                busy = await client.post("/generate", json={"text": "x", "rid": "sglang-busy"})
                assert busy.status_code == 400 and busy.json()["error"]["param"] == "body.rid"
            # leaving the stream closes the connection: the server aborts the request

    before = abort_count(http)
    asyncio.run(scenario())
    for _ in range(100):
        again = http.post("/generate", json={"text": "x", "rid": "sglang-busy",
                                             "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
        if again.status_code == 200:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert again.status_code == 200, again.text
    assert abort_count(http) == before + 1


# -- refused input ----------------------------------------------------------------------------

BAD = [
    ({}, "body.text"),
    ({"text": "x", "input_ids": [1]}, "body.text"),
    ({"text": 5}, "body.text"),
    ({"text": ["a", 1]}, "body.text[1]"),
    ({"input_ids": []}, "body.input_ids"),
    ({"input_ids": [1, "a"]}, "body.input_ids[1]"),
    ({"input_ids": [[1, 2], [3, True]]}, "body.input_ids[1][1]"),
    ({"input_ids": [100000]}, "body.input_ids"),
    ({"input_ids": [[5], [7] * MAX_MODEL_LEN]}, "body.input_ids[1]"),
    ({"text": "x", "sampling_params": {"temperature": -1}}, "body.sampling_params.temperature"),
    ({"text": "x", "sampling_params": {"temperature": "hot"}}, "body.sampling_params.temperature"),
    ({"text": "x", "sampling_params": {"temperature": 1e300}}, "body.sampling_params.temperature"),
    ({"text": "x", "sampling_params": {"top_p": 0}}, "body.sampling_params.top_p"),
    ({"text": "x", "sampling_params": {"top_k": -2}}, "body.sampling_params.top_k"),
    ({"text": "x", "sampling_params": {"n": 0}}, "body.sampling_params.n"),
    ({"text": "x", "sampling_params": {"max_new_tokens": -1}},
     "body.sampling_params.max_new_tokens"),
    ({"text": "x", "sampling_params": {"min_new_tokens": 3, "max_new_tokens": 2}},
     "body.sampling_params.min_new_tokens"),
    ({"text": "x", "sampling_params": {"stop": [1]}}, "body.sampling_params.stop"),
    ({"text": "x", "sampling_params": {"regex": "a(b"}}, "body.sampling_params.regex"),
    ({"text": "x", "sampling_params": {"json_schema": "{oops"}},
     "body.sampling_params.json_schema"),
    ({"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
     "body.sampling_params"),
    ({"text": "x", "sampling_params": {"logit_bias": {"x": 1}}}, "body.sampling_params.logit_bias"),
    ({"text": "x", "sampling_params": 3}, "body.sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"top_p": 2}]}, "body.sampling_params[1].top_p"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}, "body.sampling_params"),
    ({"text": "x", "return_logprob": "yes"}, "body.return_logprob"),
    ({"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "body.top_logprobs_num"),
    ({"text": "x", "return_logprob": True, "logprob_start_len": 99}, "body.logprob_start_len"),
    ({"text": "x", "rid": 5}, "body.rid"),
    ({"text": ["a", "b"], "rid": ["same", "same"]}, "body.rid"),
    ({"text": "x", "stream": "maybe"}, "body.stream"),
    ({"text": "x", "return_routed_experts": "yes"}, "body.return_routed_experts"),
    ({"text": "x", "lora_path": "adapter"}, "body.lora_path"),
    ({"text": "x", "image_data": ["img.png"]}, "body.image_data"),
]  # fmt: skip


@pytest.mark.parametrize(("payload", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_input_is_400_naming_the_field(http, payload: dict, param: str) -> None:
    response = http.post("/generate", json=payload)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_unknown_fields_are_ignored_and_bad_json_refused(http) -> None:
    payload = {"text": "x", "bar": 1, "sampling_params": {"max_new_tokens": 1, "foo": 2,
               "custom_params": {"return_top_p_token_ids": True}}}  # fmt: skip
    assert generate(http, payload)["meta_info"]["completion_tokens"] == 1
    broken = http.post(
        "/generate", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "body"
    assert http.get("/health").status_code == 200


def test_sglang_constraints_shape_the_output(http: httpx.Client) -> None:
    """SGLang's json_schema (JSON text), regex and ebnf (GBNF) sampling params."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    cases = [
        ({"json_schema": json.dumps(schema)}, lambda t: set(json.loads(t)) == {"ok", "n"}),
        ({"regex": "[a-d]{2}-[0-9]{2}"}, lambda t: re.fullmatch("[a-d]{2}-[0-9]{2}", t)),
        ({"ebnf": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ]
    for constraint, check in cases:
        sampling = {"max_new_tokens": 60, "temperature": 0.8, "sampling_seed": 1, **constraint}
        out = http.post("/generate", json={"text": PROMPT, "sampling_params": sampling})
        assert out.status_code == 200, out.text
        assert check(out.json()["text"]), (constraint, out.json()["text"])
