"""End-to-end behaviour of the offline engine on a tiny random model."""

from __future__ import annotations

import weakref

import pytest
import torch

from hotswap import LLM, EngineDeadError, SamplingParams
from tests.helpers.recording import record_logits

# Engines in this process, each test seconds: the whole module is slow.
pytestmark = pytest.mark.slow

SHARED = "Reinforcement learning trains a policy while it keeps generating rollouts. " * 3
PROMPTS = [SHARED + "The quick", SHARED + "Paged attention", "Pause", SHARED + "Numbers 0123"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_llm(model_dir, **kw) -> LLM:  # noqa: ANN001
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 8)
    return LLM(str(model_dir), progress=False, **kw)


def token_ids(outputs) -> list[list[int]]:  # noqa: ANN001
    return [c.token_ids for o in outputs for c in o.outputs]


def test_prefix_cache_hits_give_same_outputs(tiny_llama) -> None:
    baseline = token_ids(
        make_llm(tiny_llama, enable_prefix_caching=False).generate(PROMPTS, GREEDY)
    )
    llm = make_llm(tiny_llama)
    first = llm.generate(PROMPTS, GREEDY)
    second = llm.generate(PROMPTS, GREEDY)
    assert token_ids(first) == baseline and token_ids(second) == baseline
    assert all(o.num_cached_tokens > 0 for o in second if len(o.prompt_token_ids) > 8)
    assert second[2].num_cached_tokens == 0  # "Pause" is shorter than a block
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.runner.num_blocks


def test_chunked_prefill_gives_same_outputs(tiny_llama) -> None:
    whole = make_llm(tiny_llama, enable_chunked_prefill=False, max_num_batched_tokens=512)
    chunked = make_llm(tiny_llama, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert token_ids(chunked.generate(PROMPTS, GREEDY)) == token_ids(
        whole.generate(PROMPTS, GREEDY)
    )


def test_preemption_under_tiny_kv_budget_gives_same_outputs(tiny_llama) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = make_llm(tiny_llama)
    # 18 blocks of 8 = 144 tokens: each request needs ~140, so they must take turns.
    tight = make_llm(tiny_llama, num_kv_blocks=18, max_model_len=144, enable_prefix_caching=False)
    expected = token_ids(roomy.generate(PROMPTS, params))
    assert token_ids(tight.generate(PROMPTS, params)) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.scheduler.kv.num_free_blocks == 18


def test_batch_invariant_logits_alone_vs_in_mixed_batch(tiny_llama) -> None:
    """One request alone, then inside 16 mixed requests (other lengths, chunked by a small
    budget, some served from the prefix cache): its logits must be bitwise identical."""
    target = SHARED + "The quick brown fox"
    alone_llm = make_llm(tiny_llama, batch_invariant=True)
    alone = record_logits(alone_llm)
    [out] = alone_llm.generate([target], GREEDY)
    alone_logits = torch.stack(alone.logits[out.request_id])

    mixed_llm = make_llm(tiny_llama, batch_invariant=True, max_num_batched_tokens=48)
    mixed_llm.generate([SHARED + "warm the prefix cache"], SamplingParams(max_tokens=2))
    mixed = record_logits(mixed_llm)
    others = [SHARED[: 7 * i + 3] + str(i) for i in range(15)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=5 + i) for i in range(15)]
    outs = mixed_llm.generate(
        others[:7] + [target] + others[7:], params[:7] + [GREEDY] + params[7:]
    )
    target_out = outs[7]
    assert target_out.num_cached_tokens > 0
    assert target_out.outputs[0].token_ids == out.outputs[0].token_ids
    assert torch.equal(torch.stack(mixed.logits[target_out.request_id]), alone_logits)


def test_seeded_sampling_is_independent_of_the_batch(tiny_llama) -> None:
    llm = make_llm(tiny_llama, batch_invariant=True)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16)
    [alone] = llm.generate(["The quick"], params)
    batch = llm.generate(["Pause", "The quick", SHARED], [GREEDY, params, params])
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = llm.generate(["The quick"], SamplingParams(temperature=1.0, seed=7, max_tokens=16))
    assert other_seed[0].outputs[0].token_ids != alone.outputs[0].token_ids


def test_n_choices_are_distinct_and_reproducible(tiny_llama) -> None:
    llm = make_llm(tiny_llama)
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    [first] = llm.generate("The quick", params)
    [again] = llm.generate("The quick", params)
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3
    assert token_ids([first]) == token_ids([again])


def test_stop_strings_token_ids_and_min_tokens(tiny_llama) -> None:
    llm = make_llm(tiny_llama)
    [free] = llm.generate("The quick", GREEDY)
    text, ids = free.outputs[0].text, free.outputs[0].token_ids
    stop = text[3:6]
    [stopped] = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=12, stop=[stop]))
    choice = stopped.outputs[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert choice.text == text[: text.index(stop)]
    [kept] = llm.generate(
        "The quick",
        SamplingParams(temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=True),
    )
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]
    [by_token] = llm.generate(
        "The quick", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ids[4]])
    )
    assert by_token.outputs[0].token_ids == ids[: ids.index(ids[4]) + 1]
    assert by_token.outputs[0].stop_reason == ids[4]
    [late] = llm.generate(
        "The quick",
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ids[0]], min_tokens=3),
    )
    assert len(late.outputs[0].token_ids) > 3 or late.outputs[0].finish_reason == "length"
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.runner.num_blocks


def test_min_tokens_suppresses_eos(tiny_llama) -> None:
    llm = make_llm(tiny_llama)
    recorder = record_logits(llm)
    [out] = llm.generate(
        "Pause", SamplingParams(temperature=1.0, seed=0, max_tokens=6, min_tokens=6)
    )
    assert len(out.outputs[0].token_ids) == 6
    eos = llm.tokenizer.eos_token_id
    assert all(step[eos] == float("-inf") for step in recorder.logits[out.request_id])


def test_logprobs_match_log_softmax_of_logits(tiny_llama) -> None:
    llm = make_llm(tiny_llama)
    recorder = record_logits(llm)
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)
    [out] = llm.generate("The quick", params)
    choice = out.outputs[0]
    assert len(choice.logprobs) == 5
    for token, entry, logits in zip(choice.token_ids, choice.logprobs, recorder.logits["0"]):
        expected = torch.log_softmax(logits, -1)
        top = expected.topk(3)
        assert set(top.indices.tolist()) <= set(entry)
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert entry[token].logprob == pytest.approx(float(expected[token]), abs=1e-5)
    assert choice.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(choice.token_ids, choice.logprobs))
    )


def test_chat_uses_the_template(tiny_llama) -> None:
    llm = make_llm(tiny_llama)
    [out] = llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    expected = llm.tokenizer.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert out.prompt_token_ids == expected and len(out.outputs[0].token_ids) == 12


def test_qwen_models_run(tiny_model_factory) -> None:
    for arch in ("qwen2", "qwen3"):
        llm = make_llm(tiny_model_factory(arch), dtype="bfloat16")
        [out] = llm.generate("The quick", GREEDY)
        assert len(out.outputs[0].token_ids) == 12


def test_batch_invariance_holds_with_penalties_and_processed_logprobs(tiny_llama) -> None:
    """A penalised, seeded request: the same tokens and bitwise-equal processed logprobs
    alone and inside a mixed batch (other penalties, prompt logprobs, greedy rows)."""
    params = SamplingParams(
        temperature=0.9,
        seed=5,
        max_tokens=12,
        logprobs=2,
        repetition_penalty=1.4,
        presence_penalty=0.6,
        frequency_penalty=0.4,
    )
    target = SHARED + "The quick brown fox"
    llm = make_llm(tiny_llama, batch_invariant=True, logprobs_mode="processed_logprobs")
    [alone] = llm.generate([target], params)
    others = [
        SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=2.0, prompt_logprobs=1),
        SamplingParams(temperature=1.2, seed=1, max_tokens=9, frequency_penalty=1.5),
    ]
    mixed = llm.generate([SHARED, target, "Pause"], [others[0], params, others[1]])
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert mixed[1].outputs[0].logprobs == alone.outputs[0].logprobs


def test_shutdown_frees_the_engine_and_refuses_later_use(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", progress=False)
    llm.generate(["hello world"], SamplingParams(max_tokens=2), use_tqdm=False)
    weights = weakref.ref(llm.engine.runner.model.lm_head_weight)
    cache = weakref.ref(llm.engine.runner.kv_caches[0][0])
    llm.shutdown()
    assert weights() is None and cache() is None  # released, not only stopped
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate(["hello world"], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()  # a second call does nothing
