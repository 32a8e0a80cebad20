"""The CUDA path on a GPU (skipped elsewhere; benchmarks/gpu_check.py runs these): decode
steps replayed from real CUDA graphs give the eager engine's and the CPU engine's tokens,
survive a sleep, read one value back per step, and a mid-flight weight swap with graphs on
equals a fresh engine on the new weights."""

from __future__ import annotations

import asyncio
import warnings

import pytest
import torch

from hotswap import LLM, AsyncLLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["The quick brown", "Pause, swap the weights, resume", "x", "0123456789 and sym",
           "Paged attention stores keys and values in blocks. " * 3]  # fmt: skip
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
          for n in (5, 9, 14, 17, 24)]  # fmt: skip


def outputs(llm: LLM) -> list:
    return [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def assert_close(got: list, want: list, tolerance: float) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert max(abs(x[t].logprob - y[t].logprob) for t in x.keys() & y.keys()) < tolerance


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_graphs_give_the_eager_and_the_cpu_tokens(tiny_model_factory, arch: str) -> None:  # noqa: ANN001
    path = str(tiny_model_factory(arch))
    runs = {}
    for name, kwargs in {"cpu": {"device": "cpu"}, "eager": {"device": "cuda",
                         "enforce_eager": True}, "graphs": {"device": "cuda"}}.items():  # fmt: skip
        llm = LLM(path, dtype="float32", progress=False, **kwargs)
        runs[name] = outputs(llm)
        if name == "graphs":
            graphs = llm.engine.runner.graphs
            assert graphs is not None and graphs.graph_steps > 0 and graphs.recaptures == 0
        llm.shutdown()
    assert_close(runs["graphs"], runs["eager"], 1e-5)
    assert_close(runs["graphs"], runs["cpu"], 1e-4)


def test_graphs_are_recaptured_after_a_sleep(tiny_llama) -> None:  # noqa: ANN001
    llm = LLM(str(tiny_llama), dtype="float32", device="cuda", progress=False,
              enable_sleep_mode=True)  # fmt: skip
    before = outputs(llm)
    graphs = llm.engine.runner.graphs
    captured = graphs.captures
    llm.call("sleep", level=1)
    llm.call("wake_up")
    assert_close(outputs(llm), before, 1e-5)
    assert graphs.captures > captured
    llm.shutdown()


def test_a_graphed_decode_step_reads_one_value_back(tiny_llama) -> None:  # noqa: ANN001
    """Every synchronising CUDA call torch reports, per decode step replayed from a graph
    (sampled rows of greedy and random requests with logprobs): one, the results' copy."""
    llm = LLM(str(tiny_llama), dtype="bfloat16", device="cuda", progress=False)
    runner = llm.engine.runner
    original, syncs = runner.execute, []

    def counted(plan):  # noqa: ANN001, ANN202
        steps_before = runner.graphs.graph_steps
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = original(plan)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if runner.graphs.graph_steps > steps_before:
            syncs.append(sum("synchroniz" in str(w.message) for w in caught))
        return result

    runner.execute = counted
    params = [SamplingParams(temperature=t, top_p=0.9, max_tokens=12, ignore_eos=True,
                             logprobs=1) for t in (0.0, 0.8, 1.0)]  # fmt: skip
    llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert syncs and max(syncs) <= 1, syncs
    llm.shutdown()


def test_a_mid_flight_swap_with_graphs_matches_a_fresh_engine(tiny_model_factory) -> None:  # noqa: ANN001
    """Batch-invariant float32, graphs on: pause (keep, clear_cache) once a stream has 5
    tokens, reload V2 in place, resume; each continuation equals a fresh V2 engine's."""
    v1, v2 = tiny_model_factory("llama", seed=0), tiny_model_factory("llama", seed=1)
    kwargs = {"dtype": "float32", "batch_invariant": True, "block_size": 8, "progress": False,
              "device": "cuda", "allowed_weight_dirs": [str(v2.parent)]}  # fmt: skip
    max_tokens = 24
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def run() -> tuple[list, list]:
        llm = AsyncLLM(str(v1), **kwargs)
        latest: dict[int, object] = {}
        reached = asyncio.Event()

        async def stream(i: int) -> None:
            async for out in llm.generate(PROMPTS[i], params, request_id=f"r{i}"):
                latest[i] = out.outputs[0]
                if len(latest[i].token_ids) >= 5:
                    reached.set()

        try:
            tasks = [asyncio.ensure_future(stream(i)) for i in range(len(PROMPTS))]
            await asyncio.wait_for(reached.wait(), 120)
            await llm.pause_generation(mode="keep", clear_cache=True)
            await llm.load_weights_from_disk(str(v2), "v2")
            await llm.resume_generation()
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert llm.client.core.runner.graphs.graph_steps > 0
            return [latest[i] for i in range(len(PROMPTS))], [
                llm.tokenizer.encode(p) for p in PROMPTS
            ]
        finally:
            llm.shutdown()

    finals, prompt_ids = asyncio.run(run())
    fresh = LLM(str(v2), **kwargs)
    swapped = 0
    for output, ids in zip(finals, prompt_ids, strict=True):
        boundary = next((s.start for s in output.weight_versions if s.version == 1), max_tokens)
        if boundary < max_tokens:
            swapped += 1
            pre, post = output.token_ids[:boundary], output.token_ids[boundary:]
            cont = SamplingParams(temperature=0.0, max_tokens=len(post), ignore_eos=True)
            again = fresh.generate([{"prompt_token_ids": ids + pre}], cont, use_tqdm=False)
            assert again[0].outputs[0].token_ids == post
    assert swapped >= 3


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_images_on_the_gpu_give_the_cpu_tokens(tmp_path, family: str) -> None:  # noqa: ANN001
    """A vision-language model on CUDA (its tower, image rows, M-RoPE) against the CPU."""
    import numpy as np
    from PIL import Image

    from tests.helpers.tiny_vl import IMAGE, write_tiny_vl_model

    path = str(write_tiny_vl_model(tmp_path / family, family=family))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (90, 120, 3), np.uint8))
    prompt = {"prompt": f"<|im_start|>user\nThe quick {IMAGE} jumps<|im_end|>\n"
              "<|im_start|>assistant\n", "multi_modal_data": {"image": image}}  # fmt: skip
    runs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(path, dtype="float32", progress=False, device=device)
        runs[device] = [o.outputs[0] for o in llm.generate([prompt], PARAMS[2], use_tqdm=False)]
        llm.shutdown()
    assert_close(runs["cuda"], runs["cpu"], 1e-4)
